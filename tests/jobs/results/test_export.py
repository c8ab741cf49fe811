"""inspect and export of a results file: OpenAI Batch output lines in input order, with the
reasoning; results of an older salabatch; a folder of results files (Ray's dataset)."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from salabatch.errors import OutputError
from salabatch.jobs.results.export import export_openai_jsonl, export_results, inspect_results
from salabatch.jobs.results.read import read_results
from salabatch.jobs.results.schema import RESULT_SCHEMA, OutputWarning, ResultRow, encode_metadata
from tests.jobs.results.test_results import SPEC, T0, make_row, write_file, writer


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
    assert "contracts" in lines["job"] and "builtin:random (8-bit, sha f00df00df00d)" in text
    assert "2  document has no text: scanned PDF" in text and "1  out of memory" in text
    assert "answers" not in text


def test_inspect_means_only_the_rates_there_are(tmp_path):
    """A one-token answer has no decode rate (null): it drew the mean down as 0.0."""
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0", decode_tok_s=40.0), make_row("a.q1", decode_tok_s=None)])
    text = inspect_results(path)
    assert "decode tok/s, mean 40.0" in " ".join(text.split()), text


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
    assert re.fullmatch("req_[0-9a-f]{32}", ok["response"]["request_id"])  # OpenAI's shape
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "builtin:random"
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


def test_export_puts_request_rows_first_in_line_order_then_documents(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write(
            [
                make_row("doc.q1"),
                make_row("req.z", custom_id="z", question_id="request", request_line=1),
                make_row("req.a", custom_id="a", question_id="request", request_line=3),
                make_row(
                    "req.m",
                    custom_id="m",
                    question_id="request",
                    request_line=2,
                    status="error",
                    error="line 2: unsupported field: tools",
                ),
                make_row("doc.q0"),
            ]
        )
    stream = io.StringIO()
    assert export_openai_jsonl(path, stream) == 5
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [x["custom_id"] for x in lines] == ["z", "m", "a", "doc/q0", "doc/q1"]
    assert lines[1]["error"]["line"] == 2 and "line" not in lines[3]
    # the lines of the requests file as it is now, where a run knows them, win
    stream = io.StringIO()
    export_openai_jsonl(path, stream, lines={"req.a": 1, "req.z": 7})
    got = [json.loads(x)["custom_id"] for x in stream.getvalue().splitlines()]
    assert got == ["a", "m", "z", "doc/q0", "doc/q1"]


def test_export_gives_the_reasoning_of_a_think_row(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0", reasoning="first, the dates"), make_row("a.q1")])
    stream = io.StringIO()
    export_openai_jsonl(path, stream)
    think, plain = (json.loads(x) for x in stream.getvalue().splitlines())
    message = think["response"]["body"]["choices"][0]["message"]
    assert message["reasoning_content"] == "first, the dates"
    assert "reasoning_content" not in plain["response"]["body"]["choices"][0]["message"]


TOKENS = [
    {"token": "A", "logprob": -0.25, "bytes": [65], "top_logprobs": []},
    {
        "token": "\ufffd",  # the first byte of é: the text cannot show it, the bytes do
        "logprob": -1.5,
        "bytes": [0xC3],
        "top_logprobs": [{"token": " x", "logprob": -0.75, "bytes": [32, 120]}],
    },
]


@pytest.mark.parametrize(
    "added",
    [["request_line"], ["draft_tokens", "accepted_tokens"], ["logprobs"]],
    ids=lambda a: a[0],
)
def test_results_of_an_older_salabatch_without_added_columns_still_read(tmp_path, added):
    path = tmp_path / "old.parquet"
    table = pa.Table.from_pylist(
        [make_row("b.q0").to_record(), make_row("a.q0").to_record()], schema=RESULT_SCHEMA
    )
    pq.write_table(table.drop_columns(added), path)
    assert all(read_results(path)[c].to_pylist() == [None, None] for c in added)
    assert "drafts accepted" not in inspect_results(path)
    stream = io.StringIO()
    assert export_openai_jsonl(path, stream) == 2
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [x["custom_id"] for x in lines] == ["a/q0", "b/q0"]
    assert "completion_tokens_details" not in lines[0]["response"]["body"]["usage"]
    assert all(x["response"]["body"]["choices"][0]["logprobs"] is None for x in lines)
    value = TOKENS if added == ["logprobs"] else 4
    with writer(path) as out:  # a run resumes it, and merges it into the current schema
        out.write([make_row("c.q0", **dict.fromkeys(added, value))])
    merged = read_results(path)
    assert merged.column_names == RESULT_SCHEMA.names
    assert all(merged[c].to_pylist() == [None, None, value] for c in added)


def test_logprobs_round_trip_and_export_as_openais_content(tmp_path):
    """The column holds OpenAI's logprobs.content entries; openai-jsonl gives them back as
    they were, the rows' jsonl as JSON, CSV as JSON text; a row without them has null."""
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0", logprobs=TOKENS), make_row("a.q1")])
    rows = read_results(path).to_pylist()
    assert [r["logprobs"] for r in rows] == [TOKENS, None]
    shown = inspect_results(path, show=2)
    assert "[a / q0] stop, 20 tokens, mean token logprob -0.875" in shown, shown
    assert "[a / q1] stop, 20 tokens\n" in shown
    stream = io.StringIO()
    export_openai_jsonl(path, stream)
    choices = [
        json.loads(x)["response"]["body"]["choices"][0] for x in stream.getvalue().splitlines()
    ]
    assert choices[0]["logprobs"] == {"content": TOKENS, "refusal": None}
    assert choices[1]["logprobs"] is None
    stream = io.StringIO()
    export_results(path, stream, "jsonl")
    assert json.loads(stream.getvalue().splitlines()[0])["logprobs"] == TOKENS
    stream = io.StringIO()
    export_results(path, stream, "csv")
    records = list(csv.DictReader(io.StringIO(stream.getvalue())))
    assert json.loads(records[0]["logprobs"]) == TOKENS and records[1]["logprobs"] == ""


def test_draft_counts_in_inspect_and_in_the_openai_usage(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write(
            [
                make_row("a.q0", draft_tokens=30, accepted_tokens=12),
                make_row("a.q1", draft_tokens=10, accepted_tokens=8),
                make_row("b.q0"),  # speculative decoding off: 0 drafted
            ]
        )
    text = inspect_results(path)
    assert re.search(r"^drafts accepted\s+20 of 40 \(50%\)$", text, re.M), text
    stream = io.StringIO()
    export_openai_jsonl(path, stream)
    usage = [json.loads(x)["response"]["body"]["usage"] for x in stream.getvalue().splitlines()]
    assert usage[0]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 12,
        "rejected_prediction_tokens": 18,
    }
    assert usage[1]["completion_tokens_details"]["rejected_prediction_tokens"] == 2
    assert "completion_tokens_details" not in usage[2]


def test_inspect_and_export_read_a_folder_as_a_file(tmp_path, results):
    folder = tmp_path / "collected"
    write_file(folder / "mac-1.parquet", [make_row("a.q0"), make_row("b.q1", status="error")])
    write_file(folder / "mac-2.parquet", [make_row("b.q1"), make_row("c.q0"), make_row("a.q0")])
    text = inspect_results(folder)
    assert f"results  {folder} (a folder: 2 .parquet files)" in text
    lines = {line.strip().split("  ")[0]: " ".join(line.split()) for line in text.splitlines()}
    assert lines["rows"] == "rows 3" and lines["errors"] == "errors 0"
    assert lines["updated"] == "updated -"
    stream = io.StringIO()
    assert export_openai_jsonl(folder, stream) == 3
    got = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [x["custom_id"] for x in got] == ["a/q0", "b/q1", "c/q0"]
    assert all(x["error"] is None for x in got)

    # a results file copied in joins them: its b.q1 and c.q0 are error rows, mac-2's are ok
    shutil.copy(results, folder / "r.parquet")
    both = read_results(folder)
    assert both["request_key"].to_pylist() == ["a.q0", "a.q1", "b.q0", "b.q1", "c.q0", "c.q1"]
    assert both["status"].to_pylist() == ["ok"] * 5 + ["error"]
    # a .parquet file that is not salabatch results: skipped, and not counted as one
    pq.write_table(pa.table({"x": [1]}), folder / "other.parquet")
    with pytest.warns(OutputWarning, match="not salabatch results"):
        text = inspect_results(folder)
    assert "(a folder: 3 .parquet files, 1 other .parquet file skipped)" in text


@pytest.mark.ray
def test_a_dataset_ray_wrote_reads_as_its_rows(tmp_path):
    ray = pytest.importorskip("ray", reason="needs ray: pip install 'salabatch[ray]'")
    rows = [make_row(f"d{i}.q0", finished_at=T0) for i in range(6)]
    table = pa.Table.from_pylist([r.to_record() for r in rows], schema=RESULT_SCHEMA)
    meta = encode_metadata(job_spec_json=SPEC, versions_json="{}", created_at=T0.isoformat())
    table = table.replace_schema_metadata({**RESULT_SCHEMA.metadata, **meta})
    started = ray.is_initialized()
    if not started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.from_arrow(table).repartition(3).write_parquet(str(tmp_path / "ds"))
    finally:
        if not started:
            ray.shutdown()
    assert len(list((tmp_path / "ds").glob("*.parquet"))) >= 2
    assert [ResultRow.from_record(r) for r in read_results(tmp_path / "ds").to_pylist()] == rows
    summary = [" ".join(line.split()) for line in inspect_results(tmp_path / "ds").splitlines()]
    assert "rows 6" in summary


def test_the_cli_reads_a_folder_and_says_in_one_line_when_it_holds_no_results(tmp_path):
    from click.testing import CliRunner

    from salabatch.cli import main

    write_file(tmp_path / "ds" / "0.parquet", [make_row("a.q0"), make_row("a.q1")])
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "ds"), "--show", "1"])
    assert shown.exit_code == 0 and "[a / q0] stop" in shown.output
    out = tmp_path / "out.jsonl"
    assert CliRunner().invoke(main, ["export", str(tmp_path / "ds"), "-o", str(out)]).exit_code == 0
    assert len(out.read_text().splitlines()) == 2
    (tmp_path / "empty").mkdir()
    for command in ("inspect", "export"):
        result = CliRunner().invoke(main, [command, str(tmp_path / "empty")])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
        assert "a folder without .parquet files" in result.output


def test_export_csv_and_flat_jsonl_into_new_folders(results, tmp_path):
    import csv

    from click.testing import CliRunner

    from salabatch.cli import main

    table = read_results(results)
    out = tmp_path / "new" / "deeper" / "answers.csv"  # the format from the suffix
    result = CliRunner().invoke(main, ["export", str(results), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"6 rows -> {out}" in result.output
    with open(out, newline="", encoding="utf-8") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == table.column_names and len(got) == 6
    assert got[0]["answer"] == "line 1\nline 2\nline 3\nline 4\nline 5\nline 6"
    assert got[3]["error"] == "out of memory" and got[3]["answer"] == ""
    assert got[0]["finished_at"] == table["finished_at"][0].as_py().isoformat()

    flat = tmp_path / "other" / "rows.jsonl"
    result = CliRunner().invoke(
        main, ["export", str(results), "--format", "jsonl", "-o", str(flat)]
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in flat.read_text(encoding="utf-8").splitlines()]
    assert [list(x) for x in lines] == [table.column_names] * 6
    # a suffix that does not fit the format: the hint names the file as it would fit
    wrong = CliRunner().invoke(main, ["export", str(results), "--format", "csv", "-o", str(flat)])
    assert wrong.exit_code == 2, wrong.output
    assert "writes a .csv file, not .jsonl: name the output rows.csv," in wrong.output
    assert lines[1]["custom_id"] == "a/q1" and lines[3]["answer"] is None
    assert lines[0]["started_at"] == T0.isoformat()

    for fmt, name in (("csv", "answers.jsonl"), ("openai-jsonl", "answers.csv"), ("jsonl", "x")):
        wrong = tmp_path / name
        result = CliRunner().invoke(
            main, ["export", str(results), "--format", fmt, "-o", str(wrong)]
        )
        assert result.exit_code == 2 and f"--format {fmt} writes a" in result.output
        assert not wrong.exists()


def test_a_carriage_return_in_a_csv_cell_stays_in_its_field(tmp_path):
    """A lone CR (a message "Line one\\rLine two") was written bare: csv readers split the
    record there. Records now end with CRLF (RFC 4180), so a CR in a cell is quoted."""
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0", answer="Line one\rLine two"), make_row("b.q0", answer="x")])
    stream = io.StringIO()
    export_results(path, stream, "csv")
    records = list(csv.DictReader(io.StringIO(stream.getvalue(), newline="")))
    assert [r["answer"] for r in records] == ["Line one\rLine two", "x"]


def test_a_drawn_choice_is_judged_by_its_own_probability(tmp_path):
    """Above temperature 0 a choices answer is drawn, and need not be the likeliest: inspect
    took the likeliest choice's probability for every answer, so `--below` missed an answer
    of probability 0.1 (its likeliest 0.9)."""

    def row(key: str, answer: str) -> ResultRow:
        choices = [
            {"choice": "yes", "logprob": -0.105, "probability": 0.9},
            {"choice": "no", "logprob": -2.303, "probability": 0.1},
        ]
        return make_row(key, answer=answer, choice_logprobs=choices)

    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([row("a.q0", "yes"), row("b.q0", "no")])
    shown = inspect_results(path, below=0.5)
    assert "the answer's probability 0.500 on average, 1 below 0.5" in shown
    assert "choices answers less probable than 0.5: 1" in shown and "[b / q0]" in shown
