"""The Parquet sink: schema, durability under SIGKILL, resume, inspect and export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from salabatch.errors import OutputError
from salabatch.jobs.export import export_openai_jsonl, export_results, inspect_results
from salabatch.jobs.output import (
    RESULT_SCHEMA,
    SCHEMA_VERSION,
    OutputWarning,
    ResultRow,
    ResultWriter,
    current_versions,
    read_metadata,
    read_results,
)

REPO = Path(__file__).resolve().parents[1]
SPEC = json.dumps({"name": "contracts", "questions": [{"id": "q0", "text": "Who?"}]})
VERSIONS = {"salabatch": "0.1.0", "mlx": "0.30.0", "python": "3.11.0"}
T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)

# DESIGN.md's columns, in its order, with request_key and reasoning added.
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
    "answer",
    "reasoning",
    "finish_reason",
    "status",
    "error",
    "model",
    "model_sha",
    "quant_bits",
    "doc_tokens",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
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
        model="builtin:tiny",
        model_sha="f00d" * 16,
        quant_bits=8,
        doc_tokens=1000,
        prompt_tokens=1010,
        cached_tokens=1000,
        completion_tokens=20,
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


# --- writing, merging, metadata --------------------------------------------------------------


def test_batches_merge_into_one_file_with_metadata(tmp_path):
    path = tmp_path / "out" / "r.parquet"  # the folder is created
    with writer(path) as out:
        out.write([make_row("b.q0"), make_row("b.q1")])
        out.write([])
        out.write([make_row("a.q0"), make_row("a.q1", status="error")])
        parts = sorted(p.name for p in out.parts_dir.glob("part-*"))
        assert parts[0].startswith("part-000001-") and parts[1].startswith("part-000002-")
        assert not path.exists()
        assert keys_of(read_results(path)) == ["a.q0", "a.q1", "b.q0", "b.q1"]  # mid-run view
    assert not out.parts_dir.exists()
    table = pq.read_table(path)
    assert keys_of(table) == ["a.q0", "a.q1", "b.q0", "b.q1"]  # sorted by doc, question
    meta = read_metadata(path)
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["job_spec"] == json.loads(SPEC)
    assert meta["versions"] == VERSIONS
    assert meta["created_at"] and meta["updated_at"]
    assert table.schema.metadata[b"salabatch.job_spec"] == SPEC.encode()
    assert set(current_versions()) >= {"salabatch", "mlx", "python"}


def test_one_row_per_key_ok_beats_error_then_latest_wins(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0", answer="first"), make_row("a.q1", status="error")])
        out.write([make_row("a.q0", status="error"), make_row("a.q1", answer="fixed")])
        out.write([make_row("a.q0", answer="second")])
    table = read_results(path)
    assert keys_of(table) == ["a.q0", "a.q1"]
    assert table.column("answer").to_pylist() == ["second", "fixed"]


def test_closes_on_keyboard_interrupt(tmp_path):
    path = tmp_path / "r.parquet"
    with pytest.raises(KeyboardInterrupt), writer(path) as out:
        out.write([make_row("a.q0")])
        raise KeyboardInterrupt
    assert keys_of(pq.read_table(path)) == ["a.q0"]
    assert not out.parts_dir.exists()
    with pytest.raises(ValueError, match="closed"):
        out.write([make_row("a.q1")])


def test_one_writer_per_file(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path), pytest.raises(OutputError, match="another salabatch run"):
        writer(path)
    with writer(path):  # released on close
        pass


# --- resume ----------------------------------------------------------------------------------


def test_resume_skips_done_rows_and_adds_new_ones(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        assert out.done_keys() == frozenset()
        out.write([make_row("a.q0"), make_row("a.q1", status="error")])
    with writer(path) as out:
        assert out.done_keys() == {"a.q0", "a.q1"}
        out.write([make_row("b.q0", run_id="run-2")])
        assert out.done_keys() == {"a.q0", "a.q1", "b.q0"}
    table = read_results(path)
    assert keys_of(table) == ["a.q0", "a.q1", "b.q0"]
    assert table.column("run_id").to_pylist() == ["run-1", "run-1", "run-2"]


def test_retry_errors_redoes_error_rows(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0"), make_row("a.q1", status="error")])
    with writer(path, retry_errors=True) as out:
        assert out.done_keys() == {"a.q0"}
        out.write([make_row("a.q1", answer="now it works")])
    assert read_results(path).column("status").to_pylist() == ["ok", "ok"]


def test_no_resume_replaces_the_results_when_it_closes(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("old.q0"), make_row("old.q1")])
    before = path.read_bytes()
    with writer(path, resume=False) as out:
        assert out.done_keys() == frozenset()
        out.write([make_row("new.q0")])
        assert path.read_bytes() == before  # the old results stay until the new run ends
        assert keys_of(read_results(path)) == ["new.q0"]  # but readers see the new run
    assert keys_of(pq.read_table(path)) == ["new.q0"]


def test_a_run_without_rows_changes_nothing(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path):
        pass
    assert not path.exists() and not (tmp_path / "r.parquet.parts").exists()
    with writer(path) as out:
        out.write([make_row("old.q0")])
    before = path.read_bytes()
    with pytest.raises(RuntimeError), writer(path, resume=False):
        raise RuntimeError("the model failed to load")
    assert path.read_bytes() == before
    assert keys_of(read_results(path)) == ["old.q0"]


def test_retain_drops_stale_rows_of_earlier_runs(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0"), make_row("a.q1"), make_row("gone.q0")])
    with writer(path) as out:
        out.retain(["a.q0", "a.q1", "b.q0"])
        out.write([make_row("b.q0"), make_row("extra.q0")])  # written now: always kept
    assert keys_of(read_results(path)) == ["a.q0", "a.q1", "b.q0", "extra.q0"]


# --- files that are not ours, damaged parts ---------------------------------------------------


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


# --- SIGKILL at any moment --------------------------------------------------------------------

# Writes N_BATCHES batches of two rows ("<b>.q0", "<b>.q1") and kills itself with SIGKILL at the
# moment named by argv[3], by wrapping os.replace / os.unlink as the writer calls them.
KILLED_RUN = r"""
import os, signal, sys
from datetime import datetime, timezone
from salabatch.jobs import output

path, resume, moment = sys.argv[1], sys.argv[2] == "resume", sys.argv[3]
n_batches, kill_after = int(sys.argv[4]), int(sys.argv[5])
real_replace, real_unlink = os.replace, os.unlink
renamed_parts, unlinked_parts = [0], [0]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def replace(src, dst):
    if str(dst) == path and moment == "merge-before-rename":
        die()
    if ".parts" in str(dst) and moment == "temp-part" and renamed_parts[0] == kill_after:
        die()  # a part written and fsync'd, never renamed: left as a temp file
    real_replace(src, dst)
    renamed_parts[0] += ".parts" in str(dst)
    if str(dst) == path and moment == "merge-after-rename":
        die()

def unlink(p, *a, **k):
    if "part-" in str(p) and moment == "merge-mid-delete" and unlinked_parts[0] == 1:
        die()
    real_unlink(p, *a, **k)
    unlinked_parts[0] += "part-" in str(p)

output.os.replace, output.os.unlink = replace, unlink

def row(key):
    doc, q = key.split(".")
    return output.ResultRow(
        run_id="killed", job_name="contracts", doc_id=doc, doc_path="/d", doc_sha256="",
        question_id=q, question="?", request_key=key, model="m", answer="a " + key,
        finished_at=datetime.now(timezone.utc),
    )

out = output.ResultWriter(path, job_spec_json="{}", versions={}, resume=resume)
for b in range(n_batches):
    if moment == "between-parts" and b == kill_after:
        die()
    out.write([row(f"{b:02d}.q0"), row(f"{b:02d}.q1")])
out.close()
print("closed without being killed", file=sys.stderr)
sys.exit(3)
"""
N_BATCHES, KILL_AFTER = 5, 3


def run_killed(path: Path, *, resume: bool, moment: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [str(path), "resume" if resume else "fresh", moment, str(N_BATCHES), str(KILL_AFTER)]
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *args], env=env, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def batch_keys(batches: range) -> set[str]:
    return {f"{b:02d}.q{q}" for b in batches for q in (0, 1)}


@pytest.mark.parametrize(
    "moment, finished, resume",
    [
        ("between-parts", range(KILL_AFTER), True),
        ("temp-part", range(KILL_AFTER), True),
        ("merge-before-rename", range(N_BATCHES), True),
        ("merge-after-rename", range(N_BATCHES), True),
        ("merge-mid-delete", range(N_BATCHES), True),
        # --no-resume: the old rows must not come back, the killed run's rows must not go
        ("between-parts", range(KILL_AFTER), False),
        ("merge-after-rename", range(N_BATCHES), False),
        ("merge-mid-delete", range(N_BATCHES), False),
    ],
)
def test_sigkill_loses_no_finished_row_and_resume_completes(tmp_path, resume, moment, finished):
    path = tmp_path / "r.parquet"
    old = {"old.q0", "old.q1"}
    with writer(path) as out:
        out.write([make_row(k) for k in sorted(old)])

    run_killed(path, resume=resume, moment=moment)

    assert keys_of(pq.read_table(path))  # the file on disk is readable at every moment
    expected = batch_keys(finished) | (old if resume else set())
    assert sorted(keys_of(read_results(path))) == sorted(expected)
    with writer(path) as out:  # the rerun resumes (also after --no-resume)
        assert out.done_keys() == expected
        todo = sorted(batch_keys(range(N_BATCHES)) - out.done_keys())
        out.write([make_row(k, run_id="rerun") for k in todo])
    keys = keys_of(pq.read_table(path))
    assert sorted(keys) == sorted(batch_keys(range(N_BATCHES)) | (old if resume else set()))
    assert len(keys) == len(set(keys))
    assert not (tmp_path / "r.parquet.parts").exists()  # temp files and parts cleaned up


# --- inspect and export ----------------------------------------------------------------------


@pytest.fixture
def results(tmp_path) -> Path:
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write(
            [
                make_row("a.q0", answer="line 1\nline 2\nline 3\nline 4\nline 5\nline 6"),
                make_row("a.q1", cache_source="memory", doc_prefill_s=0.0, prefill_tok_s=9e9),
                make_row("b.q0", prefill_tok_s=300.0, decode_tok_s=30.0, finish_reason="length"),
                make_row("b.q1", status="error", error="out of memory"),
                make_row("c.q0", status="error", error="document has no text: scanned PDF"),
                make_row("c.q1", status="error", error="document has no text: scanned PDF"),
            ]
        )
    return path


def test_inspect_summarizes_counts_tokens_speeds_and_errors(results):
    text = inspect_results(results)
    lines = {line.strip().split("  ")[0]: " ".join(line.split()) for line in text.splitlines()}
    assert lines["rows"] == "rows 6" and lines["ok"] == "ok 3" and lines["errors"] == "errors 3"
    assert lines["documents"] == "documents 3" and lines["questions"] == "questions 2"
    assert lines["completion tokens"] == "completion tokens 120"
    assert lines["prompt tokens"] == "prompt tokens 6,060"
    # prefill: only rows that prefilled their document (a.q1 came from memory)
    assert lines["prefill tok/s, mean"].startswith("prefill tok/s, mean 400.0 (over 2 rows")
    assert lines["decode tok/s, mean"] == "decode tok/s, mean 23.3"
    assert "contracts" in lines["job"] and "builtin:tiny (8-bit, sha f00df00df00d)" in text
    assert "2  document has no text: scanned PDF" in text and "1  out of memory" in text
    assert "answers" not in text


def test_inspect_shows_answers(results):
    text = inspect_results(results, show=2)
    assert "answers (first 2 of 6)" in text
    assert "[a / q0] stop, 20 tokens\n    line 1\n    line 2\n    line 3\n    line 4\n" in text
    assert "… (2 more lines)" in text and "[a / q1] stop" in text and "[b / q0]" not in text


def test_export_openai_batch_output_lines(results, tmp_path):
    out = tmp_path / "batch_output.jsonl"
    assert export_openai_jsonl(results, out) == 6
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [x["custom_id"] for x in lines] == ["a/q0", "a/q1", "b/q0", "b/q1", "c/q0", "c/q1"]
    ok, error = lines[2], lines[3]
    assert set(ok) == {"id", "custom_id", "response", "error"} and ok["error"] is None
    assert ok["id"].startswith("batch_req_") and ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "builtin:tiny"
    assert body["created"] == int(T0.timestamp())
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "answer to b.q0\nsecond line",
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 1010 and body["usage"]["completion_tokens"] == 20
    assert body["usage"]["total_tokens"] == 1030
    assert error["response"] is None
    assert error["error"] == {"code": "salabatch_error", "message": "out of memory"}
    assert len({x["id"] for x in lines}) == 6

    again = tmp_path / "again.jsonl"
    export_results(results, again, "openai-jsonl")
    assert again.read_bytes() == out.read_bytes()  # stable ids: same results, same bytes
    with pytest.raises(OutputError, match="format"):
        export_results(results, again, "csv")
