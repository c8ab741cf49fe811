"""What a results file is and how it reads: schema, rows, files that are not ours, damaged
parts."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from salabatch.errors import OutputError
from salabatch.jobs.results.read import read_metadata, read_results
from salabatch.jobs.results.schema import (
    RESULT_SCHEMA,
    SCHEMA_VERSION,
    OutputWarning,
    ResultRow,
    encode_metadata,
)
from salabatch.jobs.results.writer import ResultWriter

SPEC = json.dumps({"name": "contracts", "questions": [{"id": "q0", "text": "Who?"}]})
VERSIONS = {"salabatch": "0.1.0", "mlx": "0.30.0", "python": "3.11.0"}
T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)

# DESIGN.md's columns, in its order, with request_key, reasoning and the draft counts added.
DESIGN_COLUMNS = [
    "run_id",
    "job_name",
    "doc_id",
    "doc_path",
    "doc_sha256",
    "question_id",
    "question",
    "custom_id",
    "request_key",
    "request_line",
    "answer",
    "reasoning",
    "finish_reason",
    "status",
    "error",
    "logprobs",
    "choice_logprobs",
    "model",
    "model_sha",
    "quant_bits",
    "doc_tokens",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "draft_tokens",
    "accepted_tokens",
    "doc_prefill_s",
    "prefill_tok_s",
    "ttft_s",
    "decode_s",
    "decode_tok_s",
    "batch_size",
    "cache_source",
    "peak_mem_gb",
    "started_at",
    "finished_at",
]


def make_row(key: str, *, status: str = "ok", run_id: str = "run-1", **kw) -> ResultRow:
    """A full row; `key` is "<doc>.<question>" so ids and keys line up."""
    doc, question = key.split(".")
    fields = dict(
        run_id=run_id,
        job_name="contracts",
        doc_id=doc,
        doc_path=f"/data/{doc}.pdf",
        doc_sha256="ab" * 32,
        question_id=question,
        question=f"question {question}?",
        request_key=key,
        model="builtin:random",
        model_sha="f00d" * 16,
        quant_bits=8,
        doc_tokens=1000,
        prompt_tokens=1010,
        cached_tokens=1000,
        completion_tokens=20,
        draft_tokens=0,
        accepted_tokens=0,
        doc_prefill_s=2.0,
        prefill_tok_s=500.0,
        ttft_s=0.25,
        decode_s=1.0,
        decode_tok_s=20.0,
        batch_size=2,
        cache_source="none",
        peak_mem_gb=1.5,
        started_at=T0,
        finished_at=T0 + timedelta(seconds=3),
    )
    if status == "ok":
        fields.update(answer=f"answer to {key}\nsecond line", finish_reason="stop")
    else:
        fields.update(status="error", finish_reason="error", error=kw.pop("error", "boom"))
        for name in ("doc_prefill_s", "prefill_tok_s", "ttft_s", "decode_s", "decode_tok_s"):
            fields[name] = None
    fields.update(kw)
    return ResultRow(**fields)


def writer(path: Path, **kw) -> ResultWriter:
    return ResultWriter(path, job_spec_json=SPEC, versions=VERSIONS, **kw)


def keys_of(table: pa.Table) -> list[str]:
    return table.column("request_key").to_pylist()


# --- schema and rows ---------------------------------------------------------------------------


def test_schema_has_design_columns_and_types():
    assert RESULT_SCHEMA.names == DESIGN_COLUMNS
    assert [f.name for f in ResultRow.__dataclass_fields__.values()] == DESIGN_COLUMNS
    assert RESULT_SCHEMA.metadata[b"salabatch.schema_version"] == str(SCHEMA_VERSION).encode()
    types = {f.name: f.type for f in RESULT_SCHEMA}
    assert types["finished_at"] == pa.timestamp("us", tz="UTC")
    assert types["prompt_tokens"] == pa.int64() and types["decode_tok_s"] == pa.float64()
    required = {f.name for f in RESULT_SCHEMA if not f.nullable}
    assert {"run_id", "doc_id", "question_id", "request_key", "status"} <= required
    assert not {"answer", "error", "ttft_s", "decode_tok_s", "started_at"} & required


def test_rows_round_trip_exactly(tmp_path):
    path = tmp_path / "r.parquet"
    rows = [
        make_row(
            "a.q0", reasoning="think first", started_at=T0.astimezone(timezone(timedelta(hours=2)))
        ),
        make_row("a.q1", status="error", error="document has no text: encrypted PDF"),
        make_row(
            "b.q0", custom_id="req-17", quant_bits=None, cache_source="disk", doc_prefill_s=0.0
        ),
    ]
    with writer(path) as out:
        out.write(rows)
    back = [ResultRow.from_record(r) for r in read_results(path).to_pylist()]
    assert back == rows  # aware datetimes compare as instants
    assert back[0].started_at.utcoffset() == timedelta(0)
    assert back[1].custom_id == "a/q1" and back[2].custom_id == "req-17"
    assert pq.read_schema(path).equals(RESULT_SCHEMA, check_metadata=False)


def test_text_that_utf8_cannot_hold_is_escaped_and_a_path_says_so(tmp_path):
    path = tmp_path / "r.parquet"
    row = make_row(
        "a.q0",
        doc_path="/data/caf" + os.fsdecode(b"\xe9") + ".txt",
        custom_id="line-\ud800",  # JSON allows a lone surrogate
    )
    assert row.doc_path == "/data/caf\\xe9.txt (file name not UTF-8: its bytes shown as \\xNN)"
    assert row.custom_id == "line-\\ud800"
    with writer(path) as out:
        out.write([row])
    assert ResultRow.from_record(read_results(path).to_pylist()[0]) == row


@pytest.mark.parametrize(
    "change, complaint",
    [
        (dict(doc_id=""), "doc_id"),
        (dict(request_key=None), "request_key"),
        (dict(status="done"), "status"),
        (dict(cache_source="ram"), "cache_source"),
        (dict(finished_at=datetime(2025, 1, 1)), "finished_at"),
        (dict(prompt_tokens=True), "prompt_tokens"),
        (dict(answer=None), "ok row"),
        (dict(status="error", finish_reason="error", answer=None), "error row"),
    ],
)
def test_invalid_rows_are_refused(change, complaint):
    with pytest.raises(ValueError, match=complaint):
        replace(make_row("a.q0"), **change)


# --- files that are not ours, damaged parts ---------------------------------------------------


def test_a_results_file_with_a_damaged_page_is_refused_before_any_work(tmp_path):
    """One byte flipped in the answers' page, the footer intact: the checks before a run read
    the footer only, and the run failed at its merge, after all its work, every time."""
    from salabatch.jobs.spec.load import _output_problems

    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row(f"d{i}.q0", answer=f"answer number {i} " * 20) for i in range(50)])
    column = next(
        c
        for c in (pq.ParquetFile(path).metadata.row_group(0).column(i) for i in range(40))
        if c.path_in_schema == "answer"
    )
    at = (column.dictionary_page_offset or column.data_page_offset) + column.total_compressed_size
    data = bytearray(path.read_bytes())
    data[at - 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(OutputError, match="CRC.*refusing to overwrite it") as e:
        writer(path)
    assert e.value.exit_code == 2 and path.read_bytes() == bytes(data)
    (problem,) = _output_problems(path, None, None)
    assert "refusing to overwrite it" in problem


@pytest.mark.parametrize("kind", ["foreign-parquet", "garbage", "empty", "folder"])
def test_refuses_to_touch_a_file_that_is_not_salabatch_results(tmp_path, kind):
    path = tmp_path / "r.parquet"
    if kind == "foreign-parquet":
        pq.write_table(pa.table({"x": [1, 2, 3]}), path)
    elif kind == "garbage":
        path.write_bytes(b"name,answer\nthis is a csv\n")
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        path.mkdir()
    before = path.read_bytes() if path.is_file() else None
    for resume in (True, False):
        with pytest.raises(OutputError) as e:
            writer(path, resume=resume)
        assert str(path) in str(e.value) and e.value.exit_code == 2
    if kind != "folder":
        with pytest.raises(OutputError, match=str(path)):
            read_results(path)
        assert path.read_bytes() == before
    assert not (tmp_path / "r.parquet.parts").exists()


def test_results_with_other_columns_are_refused(tmp_path):
    path = tmp_path / "r.parquet"
    table = RESULT_SCHEMA.empty_table().drop_columns(["ttft_s"])
    pq.write_table(table.replace_schema_metadata(RESULT_SCHEMA.metadata), path)
    with pytest.raises(OutputError, match="ttft_s: missing"):
        writer(path)


def test_truncated_part_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0")])
        out.write([make_row("a.q1")])
        good, bad = sorted(out.parts_dir.glob("part-*"))
        saved = {p.name: p.read_bytes() for p in (good, bad)}
    # Put back the state of a killed run, with the second part damaged on disk.
    path.unlink()
    out.parts_dir.mkdir()
    (out.parts_dir / good.name).write_bytes(saved[good.name])
    (out.parts_dir / bad.name).write_bytes(saved[bad.name][: len(saved[bad.name]) // 2])
    with pytest.warns(OutputWarning, match=bad.name):
        assert keys_of(read_results(path)) == ["a.q0"]
    with pytest.warns(OutputWarning, match="recomputed"), writer(path) as out:
        assert out.done_keys() == {"a.q0"}
        out.write([make_row("a.q1")])
    assert keys_of(read_results(path)) == ["a.q0", "a.q1"]
    assert not out.parts_dir.exists()


def test_no_results_at_all(tmp_path):
    with pytest.raises(OutputError, match="no such results file"):
        read_results(tmp_path / "missing.parquet")


# --- a results folder (a dataset: Ray's write_parquet, files from several machines) -----------


def write_file(path: Path, rows: list[ResultRow], spec: dict | None = None) -> None:
    """One Parquet file of `rows` as a Ray worker writes it: salabatch's schema and metadata."""
    meta = encode_metadata(
        job_spec_json=json.dumps(spec or json.loads(SPEC)),
        versions_json=json.dumps(VERSIONS),
        created_at=(T0 + timedelta(minutes=len(rows))).isoformat(),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([r.to_record() for r in rows], schema=RESULT_SCHEMA)
    pq.write_table(table.replace_schema_metadata({**RESULT_SCHEMA.metadata, **meta}), path)


def test_a_folder_reads_as_the_dedupe_of_its_files(tmp_path):
    later = T0 + timedelta(hours=1)
    write_file(
        tmp_path / "0_000001.parquet",
        [
            make_row("a.q0", finished_at=later, answer="newer"),  # a later finish wins
            make_row("a.q1", status="error"),
            make_row("b.q0"),
            make_row("c.q0", request_key="c.q0-edited", finished_at=later),  # one per custom_id
        ],
    )
    write_file(
        tmp_path / "mac-2" / "r.parquet",
        [
            make_row("a.q0", answer="older"),
            make_row("a.q1"),  # ok beats error
            make_row("b.q0", status="error", finished_at=later),
            make_row("c.q0"),
            make_row("d.q0", run_id="run-2"),
        ],
        spec={"name": "newest"},
    )
    write_file(tmp_path / ".tmp-1.parquet", [make_row("z.q0")])  # hidden: a write under way
    write_file(tmp_path / "_staging" / "r.parquet", [make_row("y.q0")])
    (tmp_path / "_SUCCESS").write_text("")

    table = read_results(tmp_path)
    assert keys_of(table) == ["a.q0", "a.q1", "b.q0", "c.q0-edited", "d.q0"]
    assert table["status"].to_pylist() == ["ok"] * 5
    assert table["answer"][0].as_py() == "newer"
    assert table.schema.equals(RESULT_SCHEMA, check_metadata=False)
    meta = read_metadata(tmp_path)
    assert meta["job_spec"] == {"name": "newest"}  # the newest file's
    assert meta["created_at"] == (T0 + timedelta(minutes=4)).isoformat()  # the earliest
    assert meta["updated_at"] is None and meta["schema_version"] == SCHEMA_VERSION


def test_a_folder_of_two_jobs_keeps_each_jobs_rows(tmp_path):
    """results/ of two jobs whose documents share names (a.txt/q0 in each): one row per
    custom_id across the folder dropped one job's rows without a word."""
    write_file(tmp_path / "2024.parquet", [make_row("a.q0", job_name="y2024", request_key="k1")])
    write_file(
        tmp_path / "2025.parquet",
        [make_row("a.q0", job_name="y2025", request_key="k2"), make_row("b.q0", job_name="y2025")],
    )
    table = read_results(tmp_path)
    assert list(zip(table["job_name"].to_pylist(), keys_of(table), strict=True)) == [
        ("y2024", "k1"),
        ("y2025", "k2"),
        ("y2025", "b.q0"),
    ]


def test_a_parts_folder_reads_as_its_results_file_does(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0", status="error")])
        out.write([make_row("a.q0"), make_row("b.q0")])
        out.write([make_row("b.q0", custom_id="b/q0", request_key="b.q0-edited")])
        parts = out.parts_dir
        assert read_results(parts).equals(read_results(path))
    assert keys_of(read_results(path)) == ["a.q0", "b.q0-edited"]


def test_a_folder_skips_files_that_are_not_results_with_a_warning(tmp_path):
    write_file(tmp_path / "good.parquet", [make_row("a.q0")])
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.warns(OutputWarning) as caught:
        assert keys_of(read_results(tmp_path)) == ["a.q0"]
    assert sorted(Path(str(w.message).split(":")[0]).name for w in caught) == [
        "broken.parquet",
        "other.parquet",
    ]
    (tmp_path / "good.parquet").unlink()
    with pytest.warns(OutputWarning), pytest.raises(OutputError) as e:
        read_results(tmp_path)
    assert "none of its 2 .parquet files is salabatch results" in str(e.value)


def test_an_empty_folder_is_a_one_line_error(tmp_path):
    (tmp_path / "notes.txt").write_text("no results here")
    with pytest.raises(OutputError) as e:
        read_results(tmp_path)
    assert str(e.value) == (
        f"{tmp_path}: a folder without .parquet files; expected a results file or a folder of them"
    )


def test_a_fifo_named_as_results_is_refused_not_waited_on(tmp_path):
    """inspect and export of a FIFO, or of a folder holding one named *.parquet, waited for a
    writer forever."""
    fifo = tmp_path / "r.parquet"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="not a regular file"):
        read_results(fifo)
    write_file(tmp_path / "real.parquet", [make_row("a.q0")])
    assert keys_of(read_results(tmp_path)) == ["a.q0"]  # the folder: the FIFO is no file of it
