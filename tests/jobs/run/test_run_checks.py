"""`salabatch run` fails before the expensive part, says what went wrong in one line, exits with
a code that tells the truth, and keeps one row per custom_id when the job changes."""

from __future__ import annotations

import errno
import json
import os
import re
import shlex

import pytest

from salabatch.jobs.results import writer as result_writer
from salabatch.jobs.results.read import read_results
from salabatch.jobs.results.writer import ResultWriter
from salabatch.jobs.run import answerer, prepare, runner
from tests.jobs.run.test_runner import QUESTIONS, rows, run_cli, write_docs, write_job


def custom_ids(folder) -> list[str]:
    return [r["custom_id"] for r in rows(folder)]


def test_an_edited_question_replaces_its_rows_even_in_a_limited_run(tmp_path, tiny_model):
    write_docs(tmp_path)
    assert run_cli("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    before = {r["custom_id"]: r for r in rows(tmp_path)}
    edited = [{**QUESTIONS[0], "text": "Summarize this in one line."}, *QUESTIONS[1:]]
    job = write_job(tmp_path, tiny_model, questions=edited)
    assert run_cli("run", str(job), "--limit", "1").exit_code == 4  # rows of the job are left
    ids = custom_ids(tmp_path)
    assert len(ids) == len(set(ids)) == 9  # the new row took its custom_id's place
    changed = [r for r in rows(tmp_path) if r["question"] == "Summarize this in one line."]
    assert len(changed) == 1 and before[changed[0]["custom_id"]]["question"] == "Summarize this."

    assert run_cli("run", str(job)).exit_code == 0
    now = rows(tmp_path)
    assert len(now) == 9 and len({r["custom_id"] for r in now}) == 9
    summaries = [r for r in now if r["question_id"] == "summary"]
    assert {r["question"] for r in summaries} == {"Summarize this in one line."}
    others = [r for r in now if r["question_id"] != "summary"]
    assert all(before[r["custom_id"]]["run_id"] == r["run_id"] for r in others)  # kept


def test_changed_generation_settings_rerun_every_row(tmp_path, tiny_model):
    write_docs(tmp_path)
    assert run_cli("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    job = write_job(tmp_path, tiny_model, generation={"max_tokens": 3})
    result = run_cli("run", str(job))
    assert result.exit_code == 0 and "9 rows written" in result.output
    assert len(rows(tmp_path)) == 9 and all(r["completion_tokens"] <= 3 for r in rows(tmp_path))


def test_an_entrys_reading_settings_are_part_of_its_rows(tmp_path, tiny_model):
    """A jsonl entry's text_field, or an entry's format, changes the text a file's bytes give:
    a rerun after an edit of one redoes the rows (it kept answers about the old text); the
    dry run says so too, and where nothing changed, nothing reruns."""
    docs = tmp_path / "docs"
    docs.mkdir()
    records = [{"id": "r1", "summary": "A ferry.", "body": "The ferry leaves at 7:10. " * 4}]
    (docs / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (docs / "plain.dat").write_text("The quay needs new fenders. " * 5)  # no known suffix

    def job(text_field, fmt):
        entries = [{"path": "docs/records.jsonl", "text_field": text_field}]
        entries.append({"path": "docs/plain.dat", "format": fmt})
        return str(write_job(tmp_path, tiny_model, documents=entries, questions=QUESTIONS[:1]))

    assert run_cli("run", job("summary", "text")).exit_code == 0
    assert run_cli("run", job("summary", "text")).output.count("0 rows written") == 1
    dry = run_cli("run", job("body", "text"), "--dry-run")
    assert dry.exit_code == 0 and "1 row to do" in dry.output, dry.output
    result = run_cli("run", job("body", "text"))
    assert result.exit_code == 0 and "1 row written" in result.output, result.output
    (record,) = [r for r in rows(tmp_path) if r["doc_id"] == "r1"]
    assert record["doc_tokens"] > 30  # the body's text, not the summary's
    result = run_cli("run", job("body", "pdf"))  # the same file, its text now no PDF's
    assert result.exit_code == 3 and "1 row written" in result.output, result.output
    (plain,) = [r for r in rows(tmp_path) if r["doc_id"] == "plain.dat"]
    assert plain["status"] == "error" and "PDF" in plain["error"]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if the run gets as far as loading the weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(runner, "load_model", refuse)


def test_a_locked_results_file_fails_before_the_model_loads(tmp_path, tiny_model, no_model_load):
    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    held = ResultWriter(tmp_path / "out" / "results.parquet", job_spec_json="{}", versions={})
    try:
        result = run_cli("run", str(job))
    finally:
        held.close()
    assert result.exit_code == 2 and "another salabatch run" in result.output
    assert "Traceback" not in result.output and len(result.output.splitlines()) == 1


def test_too_little_free_space_fails_before_the_model_loads(
    tmp_path, tiny_model, no_model_load, monkeypatch
):
    write_docs(tmp_path)
    real = prepare.shutil.disk_usage
    monkeypatch.setattr(prepare.shutil, "disk_usage", lambda p: real(p)._replace(free=5 * 2**20))
    result = run_cli("run", str(write_job(tmp_path, tiny_model)))
    assert result.exit_code == 2 and "only 5.0 MB free" in result.output
    assert not (tmp_path / "out" / "results.parquet").exists()


def test_an_unwritable_output_folder_fails_before_the_model_loads(
    tmp_path, tiny_model, no_model_load
):
    write_docs(tmp_path)
    (tmp_path / "out").write_text("a file where the output folder should be")
    result = run_cli("run", str(write_job(tmp_path, tiny_model)))
    assert result.exit_code == 2, result.output
    assert f"output.path: cannot make the folder of {tmp_path / 'out' / 'results.parquet'}: " in (
        result.output
    )  # found with the job's paths, as validate finds it


def test_a_full_output_disk_mid_run_is_one_line(tmp_path, tiny_model, monkeypatch):
    write_docs(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(result_writer, "_write_durably", full)
    result = run_cli("run", str(write_job(tmp_path, tiny_model)))
    assert result.exit_code == 2, result.output
    assert "cannot write finished rows (No space left on device)" in result.output
    assert "Traceback" not in result.output and "error in document" not in result.output


def failing_generator(monkeypatch):
    class Broken(answerer.Generator):
        def generate(self, requests, prefix=None):
            raise RuntimeError("the decoder\nbroke")
            yield  # a generator, like the real one

    monkeypatch.setattr(answerer, "Generator", Broken)


def test_a_row_that_cannot_be_made_is_its_own_error_row_not_lost(tmp_path, tiny_model, monkeypatch):
    """Making a finished row raised (an answer the tokenizer cannot decode): the row had
    already left the rows still owed, so it was neither written nor an error row (exit 0 with
    rows missing), and its batch's later rows became error rows too. Now it alone is an error
    row, pooled (the short documents) or from a document's prefix (report.md)."""
    write_docs(tmp_path)
    job = str(write_job(tmp_path, tiny_model))
    real = answerer.Answerer._row

    def row(self, r, plan, *more):
        if r.question_id == "who":
            raise RuntimeError("cannot decode")
        return real(self, r, plan, *more)

    monkeypatch.setattr(answerer.Answerer, "_row", row)
    result = run_cli("run", job)
    assert result.exit_code == 3, result.output
    got = {(r["doc_id"], r["question_id"]): r["status"] for r in rows(tmp_path)}
    assert len(got) == 9 and "9 rows written (3 errors)" in result.output
    assert {key for key, status in got.items() if status == "error"} == {
        (doc, "who") for doc in ("letter.pdf", "notes.txt", "report.md")
    }
    assert "error in row report.md/who: RuntimeError: cannot decode" in result.output


def test_error_rows_exit_3_in_one_line_and_debug_shows_the_traceback(
    tmp_path, tiny_model, monkeypatch
):
    write_docs(tmp_path)
    job = str(write_job(tmp_path, tiny_model))
    with monkeypatch.context() as m:
        failing_generator(m)
        result = run_cli("run", job)
        assert result.exit_code == 3, result.output
        assert "error in document report.md: RuntimeError: the decoder broke" in result.output
        assert "Traceback" not in result.output and "the job has 9 error rows" in result.output
        assert all(r["status"] == "error" for r in rows(tmp_path))

        debug = run_cli("--debug", "run", job, "--no-progress", "--retry-errors")
        assert debug.exit_code == 3 and "Traceback" in debug.output
    again = run_cli("run", job)  # error rows count as done, and still as errors
    assert again.exit_code == 3 and "0 rows written" in again.output
    fixed = run_cli("run", job, "--retry-errors")
    assert fixed.exit_code == 0, fixed.output
    assert [r["status"] for r in rows(tmp_path)] == ["ok"] * 9


def test_warnings_are_one_line(tmp_path, tiny_model):
    write_docs(tmp_path)
    assert run_cli("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    out = tmp_path / "out" / "results.parquet"
    parts = out.with_name(out.name + ".parts")
    parts.mkdir()
    (parts / f"part-000001-{'0' * 32}.parquet").write_bytes(b"not parquet")
    result = run_cli("inspect", str(out))
    assert result.exit_code == 0
    warned = [line for line in result.output.splitlines() if "unreadable part file" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: ")
    assert ".py:" not in result.output and "warnings.warn" not in result.output


def test_reading_a_file_that_is_not_results_says_so(tmp_path):
    bad = tmp_path / "notes.parquet"
    bad.write_text("plain text")
    for command in ("inspect", "export"):
        result = run_cli(command, str(bad))
        assert result.exit_code == 2 and "not a readable Parquet file" in result.output
        assert "overwrite" not in result.output


def test_an_unexpected_error_is_one_line_unless_debug(tmp_path, monkeypatch):
    from salabatch.jobs.results import export

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(export, "inspect_results", broken)
    result = run_cli("inspect", str(tmp_path / "x.parquet"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip() == (
        "error: ZeroDivisionError: division by zero (run with --debug for the traceback)"
    )
    debug = run_cli("--debug", "inspect", str(tmp_path / "x.parquet"))
    assert debug.exit_code == 1 and isinstance(debug.exception, ZeroDivisionError)


def test_an_edited_request_body_replaces_its_row(tmp_path, tiny_model):
    def request(custom_id: str, content: str, max_tokens: int = 4) -> str:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
        return json.dumps(line | {"body": body})

    requests, out = tmp_path / "in.jsonl", tmp_path / "out" / "results.parquet"
    args = ["--requests", str(requests), "--model", str(tiny_model), "-o", str(out)]
    args += ["--set", f"cache.dir={tmp_path / 'cache'}"]
    requests.write_text(request("a", "Name a river.") + "\n" + request("b", "Name a hill.") + "\n")
    assert run_cli("run", *args).exit_code == 0
    first = {r["custom_id"]: r for r in read_results(out).to_pylist()}
    requests.write_text(request("a", "Name a lake.") + "\n" + request("b", "Name a hill.") + "\n")
    result = run_cli("run", *args)
    assert result.exit_code == 0 and "1 row written" in result.output
    now = {r["custom_id"]: r for r in read_results(out).to_pylist()}
    assert len(read_results(out)) == 2 and now["a"]["question"] == "Name a lake."
    assert now["b"]["run_id"] == first["b"]["run_id"]  # unchanged: not redone
    requests.write_text(request("a", "Name a lake.", max_tokens=2) + "\n")  # b removed
    assert run_cli("run", *args).exit_code == 0
    (only,) = read_results(out).to_pylist()
    assert only["custom_id"] == "a" and only["completion_tokens"] <= 2


# ---- output paths: checked before the model loads, never a foreign file overwritten -------------


def test_output_never_overwrites_the_requests_file_or_a_jsonl_that_is_not_salabatchs(
    tmp_path, tiny_model, no_model_load
):
    # Defect 1: `--requests req.jsonl -o req.jsonl` replaced the input with the output, exit 0;
    # so did a job's output.path naming any existing .jsonl.
    body = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    requests = tmp_path / "req.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "body": body}) + "\n")
    before = requests.read_bytes()
    result = run_cli(
        "run", "--requests", str(requests), "--model", str(tiny_model), "-o", str(requests)
    )
    assert result.exit_code == 2, result.output
    assert f"output.path: {requests} is the requests file" in result.output
    assert requests.read_bytes() == before

    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"note": "mine, not salabatch output"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: j\nmodel: {tiny_model}\nrequests: req.jsonl\noutput: {{path: notes.jsonl}}\n"
    )
    for command in ("validate", "run"):
        result = run_cli(command, str(job))
        assert result.exit_code == 2, (command, result.output)
        assert f"output.path: {notes} exists and is not salabatch's OpenAI Batch output" in (
            result.output
        )
        assert notes.read_text() == '{"note": "mine, not salabatch output"}\n'
    assert not (tmp_path / "notes.parquet").exists()


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        ("res\0.parquet", "must not contain a NUL byte"),
        ("r" * 250 + ".parquet", "file name of 258 bytes"),
        (os.fsdecode(b"r\xe9s.parquet"), "not valid UTF-8"),
        ("res.csv", "must end in .parquet"),
        ("job.yaml/res.parquet", "job.yaml is not a folder"),  # validate said ok
    ],
    ids=["nul", "long-name", "not-utf8", "csv", "under-a-file"],
)
def test_output_path_problems_exit_2_in_validate_and_run_before_the_model_loads(
    tmp_path, tiny_model, no_model_load, output, problem
):
    # Defect 6: these passed validate and failed after the model loaded, exit 1, with a Python
    # error; `output.path: res.csv` wrote Parquet into res.csv while `-o res.csv` was refused.
    write_docs(tmp_path)
    job = str(write_job(tmp_path, tiny_model))
    checks = [
        ("validate", job, "--set", f"output.path={output}"),
        ("run", job, "--set", f"output.path={output}"),
        ("run", job, "-o", str(tmp_path / output)),
    ]
    for args in checks:
        result = run_cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "output.path: " in result.output and problem in result.output, result.output
        assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "job.yaml"]


def test_the_closing_hint_is_a_command_to_paste_and_an_empty_path_is_no_folder(
    tmp_path, tiny_model
):
    write_docs(tmp_path)
    job = str(write_job(tmp_path, tiny_model, questions=QUESTIONS[:1]))
    spaced = tmp_path / "my results" / "it's.parquet"
    result = run_cli("run", job, "-o", str(spaced))
    assert result.exit_code == 0, result.output
    hint = f"see: salabatch inspect {shlex.quote(str(spaced))} --show 5"
    assert hint in result.output and "'\"'\"'" in hint  # quoted for a shell
    for option in ("-o", "--requests", "--model"):  # the current folder, before
        empty = run_cli("run", job, option, "")
        assert empty.exit_code == 2 and "is empty" in empty.output, empty.output


def test_each_failed_document_is_named_in_one_line_during_the_run(tmp_path, tiny_model):
    # Defect 7: the run ended with "the job has 6 error rows" and no word of which
    # documents failed or why: the user needed `inspect`.
    docs = write_docs(tmp_path)
    (docs / "empty.txt").write_bytes(b"")
    (docs / "broken.pdf").write_bytes(b"%PDF-1.4\n garbage")
    job = write_job(tmp_path, tiny_model)
    result = run_cli("run", str(job))
    assert result.exit_code == 3, result.output
    failed = [line for line in result.output.splitlines() if line.startswith("error in ")]
    assert len(failed) == 2, result.output
    assert failed[0].startswith("error in document broken.pdf: corrupt PDF")
    assert failed[1] == "error in document empty.txt: empty file (0 bytes)"
    again = run_cli("run", str(job))  # error rows kept: said again in the summary, not per row
    assert again.exit_code == 3 and "error in document" not in again.output


def test_a_3gb_file_and_a_fifo_in_a_job_become_error_rows_without_being_read(tmp_path, tiny_model):
    docs = write_docs(tmp_path)
    with open(docs / "huge.txt", "wb") as f:
        f.truncate(3 * 2**30)  # sparse: no disk used; reading it would take seconds and GBs
    os.mkfifo(docs / "pipe.md")  # a walk leaves it out; named, it is an error row
    job = write_job(tmp_path, tiny_model, documents=[{"path": "docs"}, {"path": "docs/pipe.md"}])
    # validate warns of it, as of every error row it can tell before reading (it said "ok")
    checked = run_cli("validate", str(job))
    assert checked.exit_code == 0, checked.output
    assert "pipe.md: not a regular file: a FIFO (named pipe)" in checked.output
    result = run_cli("run", str(job))
    assert result.exit_code == 3, result.output
    got = {(r["doc_id"], r["question_id"]): r for r in rows(tmp_path)}
    assert got[("huge.txt", "who")]["error"].startswith("too large: 3.0 GB, over the 16.0 MB")
    assert got[("pipe.md", "who")]["error"] == "not a regular file: a FIFO (named pipe)"
    assert len(got) == 15 and sum(r["status"] == "ok" for r in got.values()) == 9


def test_debug_works_after_the_command_name_too(tmp_path, tiny_model, monkeypatch):
    from salabatch.jobs.results import export

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(export, "inspect_results", broken)
    debug = run_cli("inspect", str(tmp_path / "x.parquet"), "--debug")
    assert debug.exit_code == 1 and isinstance(debug.exception, ZeroDivisionError)
    write_docs(tmp_path)
    failing_generator(monkeypatch)
    result = run_cli("run", str(write_job(tmp_path, tiny_model)), "--debug")
    assert result.exit_code == 3 and "Traceback" in result.output
    assert run_cli("cache", "ls", "--dir", str(tmp_path / "c"), "--debug").exit_code == 0


def test_run_model_replaces_the_jobs_model_and_is_checked_as_it(tmp_path, tiny_model, monkeypatch):
    # Audit: `run JOB --model X` was ignored, `--model /nonexistent` accepted.
    write_docs(tmp_path)
    job = str(write_job(tmp_path, tmp_path / "no-model-here"))
    own = run_cli("run", job)
    assert own.exit_code == 2
    assert re.search(r"model: no such folder: .*no-model-here \(line \d+\)", own.output)
    for args in (("run", job), ("run", job, "--dry-run")):
        bad = run_cli(*args, "--model", str(tmp_path / "nowhere"))
        assert bad.exit_code == 2 and "Traceback" not in bad.output
        assert f"model: no such folder: {tmp_path / 'nowhere'} (from the command line)" in (
            bad.output
        )
    monkeypatch.chdir(tiny_model.parent)  # a folder relative to the current directory
    plan = run_cli("run", job, "--model", tiny_model.name, "--dry-run")
    assert plan.exit_code == 0 and f"model {tiny_model}," in plan.output
    result = run_cli("run", job, "--model", tiny_model.name, "--limit", "2")
    assert result.exit_code == 4, result.output
    assert {r["model"] for r in rows(tmp_path)} == {str(tiny_model)}


def test_a_file_of_another_type_named_directly_is_an_error_row_not_a_job_error(
    tmp_path, tiny_model
):
    # Audit: the README promised an error row; validate and run refused the whole job (exit 2).
    docs = write_docs(tmp_path)
    (docs / "data.xyz").write_text("x")
    (docs / "NOTES").write_text("no suffix")
    entries = [{"path": "docs/notes.txt"}, {"path": "docs/data.xyz"}, {"path": "docs/NOTES"}]
    job = str(write_job(tmp_path, tiny_model, documents=entries))
    checked = run_cli("validate", job)
    assert checked.exit_code == 0, checked.output
    warned = [line for line in checked.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 2
    assert warned[0].startswith(f"warning: documents[1].path: {docs / 'data.xyz'}: unsupported")
    assert re.search(r"format: \(line \d+\); the run makes it an error row$", warned[0])
    result = run_cli("run", job)
    assert result.exit_code == 3, result.output
    failed = {r["doc_id"]: r["error"] for r in rows(tmp_path) if r["status"] == "error"}
    assert sorted(failed) == ["NOTES", "data.xyz"]
    assert failed["NOTES"].startswith("unsupported file type (none); supported: .txt .md")
    assert failed["data.xyz"].endswith("or any file with the entry's format:")
