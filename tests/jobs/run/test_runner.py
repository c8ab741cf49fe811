"""`salabatch run` end to end on builtin:random (an untrained test model): rows, resume after
SIGKILL, bad input, error rows, dry run, context overflow (OpenAI batch requests:
test_openai_batch.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from salabatch.cli import main
from salabatch.jobs.results.read import read_metadata, read_results
from salabatch.models import resolve_model
from salabatch.plural import counted
from tests import REPO, SHARED
from tests.jobs.results.test_results import DESIGN_COLUMNS

DEMO_PDF = REPO / "jobs" / "demo" / "docs" / "westcliff-energy.pdf"
SHARED_PDFS = SHARED / "pdfs"
# every column an ok document row must fill (think is off, so no reasoning; no error; float
# weights, so no quant_bits; no request line; no choices question)
FILLED = [
    c
    for c in DESIGN_COLUMNS
    if c
    not in (
        "reasoning",
        "reasoning_tokens",
        "error",
        "logprobs",
        "choice_logprobs",
        "quant_bits",
        "request_line",
    )
]
QUESTIONS = [
    {"id": "summary", "text": "Summarize this."},
    {"id": "who", "text": "Who is named here?"},
    {"id": "cost", "text": "What does it cost?"},
]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return resolve_model("builtin:random", tmp_path_factory.mktemp("models"))


def write_docs(folder: Path) -> Path:
    docs = folder / "docs"
    docs.mkdir(parents=True)
    (docs / "notes.txt").write_text("The ferry to Eastwick leaves at 7:10. " * 3)
    (docs / "report.md").write_text("# Report\n\n" + "The quay needs new fenders. " * 60)
    shutil.copy(DEMO_PDF, docs / "letter.pdf")
    return docs


def write_job(folder: Path, model: Path, **overrides) -> Path:
    job = {
        "name": "t",
        "model": str(model),
        "documents": [{"path": "docs"}],
        "questions": QUESTIONS,
        "generation": {"max_tokens": 6},
        "engine": {"prefill_chunk": 128, "pool_max_tokens": 128, "batch_size": 4},
        "cache": {"dir": str(folder / "cache")},
        "output": {"path": "out/results.parquet"},
    }
    for key, value in overrides.items():
        job[key] = value
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run_cli(*args: str):
    return CliRunner().invoke(main, [*args, "--no-progress"] if args[0] == "run" else list(args))


def rows(folder: Path) -> list[dict]:
    return read_results(folder / "out" / "results.parquet").to_pylist()


def test_three_documents_three_questions(tmp_path, tiny_model):
    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    result = run_cli("run", str(job))
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    got = table.to_pylist()
    assert len(got) == 9 and len({r["request_key"] for r in got}) == 9
    for r in got:
        missing = [c for c in FILLED if r[c] is None]
        assert not missing, f"{r['custom_id']}: {missing}"
        assert r["status"] == "ok" and r["error"] is None
        assert 0 < r["completion_tokens"] <= 6 and r["finish_reason"] in ("stop", "length")
        assert r["prompt_tokens"] >= r["doc_tokens"] > 0
        assert r["ttft_s"] > 0 and r["prefill_tok_s"] > 0
        # a rate after the first token: none for a one-token answer (it was 0.0)
        assert (r["decode_tok_s"] is None) == (r["completion_tokens"] < 2)
        assert r["started_at"] <= r["finished_at"] and r["peak_mem_gb"] > 0
        assert r["quant_bits"] is None and r["cache_source"] == "none"
    shared = [r for r in got if r["doc_id"] != "notes.txt"]  # over pool_max_tokens: one prefix
    assert all(1 <= r["batch_size"] <= 4 for r in shared)
    # the time to first token counts from the request's start: its document's prefill too
    assert all(r["ttft_s"] >= r["doc_prefill_s"] > 0 for r in shared)
    meta = read_metadata(tmp_path / "out" / "results.parquet")
    assert meta["job_spec"]["name"] == "t" and meta["versions"]["salabatch"]
    shown = run_cli("inspect", str(tmp_path / "out" / "results.parquet"))
    assert re.search(r"^rows\s+9$", shown.output, re.M)


def test_generation_logprobs_fill_the_logprobs_column_of_every_row(tmp_path, tiny_model):
    """Rows of a shared prefix and of a pool alike: one entry per generated token, with the
    asked number of alternatives, the first the token itself (greedy); setting it reruns the
    rows (their key changes), a job without it keeps none."""
    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    assert run_cli("run", str(job)).exit_code == 0
    assert all(r["logprobs"] is None for r in rows(tmp_path))
    result = run_cli("run", str(job), "--set", "generation.logprobs=1")
    assert result.exit_code == 0, result.output
    got = rows(tmp_path)
    assert len(got) == 9 and {r["doc_id"] for r in got} >= {"notes.txt", "report.md"}
    for r in got:
        entries = r["logprobs"]
        assert len(entries) == r["completion_tokens"], r["custom_id"]
        for e in entries:
            (best,) = e["top_logprobs"]
            assert best == {k: e[k] for k in ("token", "logprob", "bytes")} and e["logprob"] <= 0


def test_questions_with_a_json_schema_or_choices_answer_within_them(tmp_path, tiny_model):
    """A question given a JSON schema, another given choices: every document's answer to the
    first parses and has its required field, to the second is one of the choices (prefix and
    pool rows alike). Adding them reruns those questions' rows only: a question without either
    keeps its rows' keys."""
    write_docs(tmp_path)
    generation = {"max_tokens": 40}
    assert (
        run_cli("run", str(write_job(tmp_path, tiny_model, generation=generation))).exit_code == 0
    )
    plain = {r["custom_id"]: r["request_key"] for r in rows(tmp_path)}
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
    }
    questions = [
        {**QUESTIONS[0], "json_schema": schema},
        {**QUESTIONS[1], "choices": ["yes", "no", "not stated"]},
        QUESTIONS[2],
    ]
    job = write_job(tmp_path, tiny_model, questions=questions, generation=generation)
    result = run_cli("run", str(job))
    assert result.exit_code == 0, result.output
    got = rows(tmp_path)
    assert len(got) == 9 and {r["doc_id"] for r in got} >= {"notes.txt", "report.md"}
    for r in got:
        if r["question_id"] == "summary":
            assert set(json.loads(r["answer"])) == {"name"} and r["finish_reason"] == "stop"
        elif r["question_id"] == "who":
            assert r["answer"] in ("yes", "no", "not stated") and r["finish_reason"] == "stop"
    kept = {r["custom_id"] for r in got if plain[r["custom_id"]] == r["request_key"]}
    assert kept == {c for c in plain if c.endswith("/cost")}


def test_a_choices_question_is_answered_by_the_likeliest_choice_with_its_probabilities(
    tmp_path, tiny_model
):
    """A choices question (not thinking): each choice's log-probability is what one call over
    the row's whole prompt, the choice and the answer's end token gives it (float32), prefix
    and pool rows alike; the answer is the likeliest; probabilities sum to 1; the answer's
    logprobs are its tokens'. Sampling draws by the row's seed, the same on a rerun. A thinking
    choices question decodes under its grammar (no probabilities), and a rerun keeps every row.
    """
    import math

    import numpy as np

    from salabatch.engine.choose import choice_ids
    from salabatch.engine.load import load_model
    from salabatch.engine.tokenizer import load_tokenizer
    from salabatch.jobs.ingest.documents import DocumentSource, iter_documents
    from tests.engine.test_choose import reference_logprobs

    docs = write_docs(tmp_path)
    choices = ["yes", "no", "not stated"]
    questions = [
        {"id": "ask", "text": "Is the ferry late?", "choices": choices},
        {"id": "hot", "text": "Is it cold?", "choices": choices, "think": True},
    ]
    generation = {"max_tokens": 12, "logprobs": 1}
    job = write_job(tmp_path, tiny_model, questions=questions, generation=generation)
    assert run_cli("run", str(job)).exit_code == 0
    got = {r["custom_id"]: r for r in rows(tmp_path)}
    model, tok = load_model(tiny_model), load_tokenizer(tiny_model)
    texts = {d.doc_id: d.text for d in iter_documents([DocumentSource(docs)])}
    for doc_id, text in texts.items():  # notes.txt pooled, the others over their prefix
        r = got[f"{doc_id}/ask"]
        prompt = tok.document_prompt(text, system=None, think=False)
        prompt += tok.prompt_suffix("Is the ferry late?", system=None, think=False)
        want = reference_logprobs(model, tok, prompt, choices)
        entries = r["choice_logprobs"]
        assert [e["choice"] for e in entries] == choices
        assert [e["logprob"] for e in entries] == pytest.approx(want, abs=1e-3), doc_id
        assert sum(e["probability"] for e in entries) == pytest.approx(1.0)
        assert r["answer"] == choices[int(np.argmax(want))] and r["finish_reason"] == "stop"
        assert len(r["logprobs"]) == r["completion_tokens"] == len(choice_ids(tok, r["answer"]))
        assert r["prompt_tokens"] == len(prompt)
        assert math.exp(entries[0]["logprob"] - entries[1]["logprob"]) == pytest.approx(
            entries[0]["probability"] / entries[1]["probability"], rel=1e-6
        )
        hot = got[f"{doc_id}/hot"]
        assert hot["choice_logprobs"] is None and hot["answer"] in choices
    shown = run_cli("inspect", str(tmp_path / "out" / "results.parquet"), "--show", "6").output
    assert "choices answered: 3, the answer's probability" in shown
    assert shown.count("    choices: ") == 3  # each ask row's, likeliest first
    results = str(tmp_path / "out" / "results.parquet")
    probable = {r["custom_id"]: max(e["probability"] for e in r["choice_logprobs"]) for r in
                rows(tmp_path) if r["choice_logprobs"]}  # fmt: skip
    cut = sorted(probable.values())[1] + 1e-9  # the least probable two are below it
    listed = run_cli("inspect", results, "--below", str(cut)).output
    assert f"choices answers less probable than {cut}: 2" in listed
    assert listed.count("    choices: ") == 2
    first_only = run_cli("inspect", results, "--below", str(cut), "--show", "1").output
    assert first_only.count("    choices: ") == 1 and "… and 1 more" in first_only
    nan = run_cli("inspect", results, "--below", "nan")  # passed a range's comparisons
    assert nan.exit_code == 2 and "'nan' is not a finite number" in nan.output
    first = {r["custom_id"]: r["request_key"] for r in rows(tmp_path)}
    assert run_cli("run", str(job)).exit_code == 0  # nothing to do
    assert {r["custom_id"]: r["request_key"] for r in rows(tmp_path)} == first

    sampled = write_job(
        tmp_path, tiny_model, questions=questions[:1], generation={"temperature": 5.0, "seed": 1}
    )
    assert run_cli("run", str(sampled)).exit_code == 0
    drawn = {r["custom_id"]: r["answer"] for r in rows(tmp_path) if r["question_id"] == "ask"}
    assert set(drawn.values()) <= set(choices)
    (tmp_path / "out" / "results.parquet").unlink()
    assert run_cli("run", str(sampled)).exit_code == 0
    assert {r["custom_id"]: r["answer"] for r in rows(tmp_path)} == drawn


def test_each_document_and_each_pool_measures_its_own_peak_memory(
    tmp_path, tiny_model, monkeypatch
):
    # peak_mem_gb of pooled rows must not carry the peak of a document answered before them
    import mlx.core as mx

    resets = []
    reset = mx.reset_peak_memory
    monkeypatch.setattr(mx, "reset_peak_memory", lambda: resets.append(1) or reset())
    write_docs(tmp_path)
    assert run_cli("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    assert len(resets) == 3  # report.md and letter.pdf (a prefix each), the pool of notes.txt


def test_the_dry_run_counts_the_prefill_the_run_does(tmp_path, tiny_model):
    """A document twice (the second answers from the first's prefix in memory) and a request
    group sharing a prefix: the dry run counted the copy's prefill and not the group's; after
    the run, every prefix is stored."""
    docs = write_docs(tmp_path)
    shutil.copy(docs / "report.md", docs / "report-copy.md")
    system = "Answer from the document. " * 30  # request lines sharing a long system prompt
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "system", "content": system},
                               {"role": "user", "content": f"Question {i}?"}]}}
        for i in range(5)
    ]  # fmt: skip
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = str(write_job(tmp_path, tiny_model, requests=str(requests)))
    plan = run_cli("run", job, "--dry-run").output
    assert "report-copy.md" in plan and "prefix in memory" in plan, plan
    prefill, stored = map(
        int, re.search(r"prefill (\d+) document tokens, (\d+) from", plan).groups()
    )
    assert run_cli("run", job).exit_code == 0
    done = rows(tmp_path)
    # per prefix: notes.txt is short (pooled: prefilled with each of its 3 questions), the
    # request lines' group is one prefix (its first row prefilled it, the others reused it)
    docs_rows = [r for r in done if r["doc_id"] in {p.name for p in docs.iterdir()}]
    fresh = {r["doc_id"]: r["doc_tokens"] for r in docs_rows if r["cache_source"] == "none"}
    reused = {r["doc_id"]: r["doc_tokens"] for r in docs_rows if r["cache_source"] == "memory"}
    group = next(r["doc_tokens"] for r in done if r["doc_id"] == "r0")
    assert set(reused) == {"report.md"} and fresh["notes.txt"] < 128
    assert prefill == sum(fresh.values()) + 2 * fresh["notes.txt"] + group
    assert stored == reused["report.md"]
    assert run_cli("run", job, "--no-resume", "--dry-run").output.count("prefix stored") >= 2


def test_the_dry_run_lets_a_prefix_go_where_a_full_pool_decodes(tmp_path, tiny_model):
    """A document, 8 short ones whose rows fill a pool (4 batches of 2) and decode, then the
    first document again: the run let its prefix go for the pool, so without a store it
    prefills the copy again, and the dry run counts that prefill (it said "prefix in memory")."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Report\n\n" + "The quay needs new fenders. " * 30)
    for i in range(8):
        (docs / f"b{i}.txt").write_text(f"Ferry {i} leaves at 7:1{i}.")
    shutil.copy(docs / "a.md", docs / "c.md")
    job = str(
        write_job(
            tmp_path,
            tiny_model,
            questions=QUESTIONS[:1],
            engine={"prefill_chunk": 128, "pool_max_tokens": 64, "batch_size": 2},
            cache={"dir": str(tmp_path / "cache"), "enabled": False},
        )
    )
    plan = run_cli("run", job, "--dry-run").output
    assert "prefix in memory" not in plan, plan
    assert re.search(r"c\.md: .*, to prefill once", plan), plan
    prefill = int(re.search(r"prefill (\d+) document tokens", plan).group(1))
    assert run_cli("run", job).exit_code == 0
    done = rows(tmp_path)
    assert {r["doc_id"]: r["cache_source"] for r in done}["c.md"] == "none"
    assert prefill == sum(r["doc_tokens"] for r in done)  # every row prefilled its document


def test_the_dry_runs_memory_lines_are_the_plans_the_run_checks(tmp_path, tiny_model, monkeypatch):
    from salabatch.engine import memory

    write_docs(tmp_path)
    engine = {"prefill_chunk": 128, "pool_max_tokens": 128, "batch_size": 512}
    job = write_job(tmp_path, tiny_model, engine=engine)  # far more rows a batch than there are
    said = run_cli("run", str(job), "--dry-run").output
    found = re.findall(
        r"memory: the (largest of the documents|longest pooled row).*? needs about (\S+ GB)", said
    )
    planned = {"document" if what.startswith("largest") else "pooled": gb for what, gb in found}
    checked = []
    check = memory.check
    monkeypatch.setattr(
        memory, "check", lambda plan, **kw: checked.append(plan) or check(plan, **kw)
    )
    assert run_cli("run", str(job)).exit_code == 0
    documents, pools = checked[:-1], checked[-1:]  # the pool of short ones runs last
    assert planned["document"] == memory.gb(max(p.peak for p in documents))
    assert planned["pooled"] == memory.gb(pools[0].peak)


def test_no_earlier_prefix_is_held_when_the_next_work_is_checked(tmp_path, tiny_model, monkeypatch):
    """A document's or a pool's memory check sees the last document's prefix let go (its plan
    counts no other: the check, and MLX's limit after it, counted it as used)."""
    import gc
    import weakref

    from salabatch.engine import memory
    from salabatch.jobs.store import document_cache

    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model, engine={"prefill_chunk": 128, "pool_max_tokens": 128})
    prefixes, held = [], []
    get = document_cache.DocumentCaches.get

    def recorded(self, *args, **kwargs):
        found = get(self, *args, **kwargs)
        prefixes.append(weakref.ref(found.cache))
        return found

    def check(plan, **kw):
        gc.collect()
        held.append(sum(p() is not None for p in prefixes))
        return memory_check(plan, **kw)

    memory_check = memory.check
    monkeypatch.setattr(document_cache.DocumentCaches, "get", recorded)
    monkeypatch.setattr(memory, "check", check)
    assert run_cli("run", str(job)).exit_code == 0
    assert len(prefixes) >= 2 and len(held) >= 3  # two documents, then the pool
    assert held == [0] * len(held), held


def test_each_document_and_pool_runs_within_the_plan_it_was_checked_against(
    tmp_path, tiny_model, monkeypatch
):
    """MLX's memory limit is the plan while a document (or a pool) is answered, so what the
    check let in runs in what it was checked against; the limit before is restored."""
    import mlx.core as mx

    from salabatch.engine import memory

    checked, limits = [], []
    check, bounded = memory.check, memory.bounded

    @contextmanager
    def recorded(plan):
        with bounded(plan) as limit:
            limits.append((plan, limit, mx.get_memory_limit()))
            yield limit

    monkeypatch.setattr(memory, "check", lambda p, **kw: checked.append(p) or check(p, **kw))
    monkeypatch.setattr(memory, "bounded", recorded)
    before = mx.get_memory_limit()
    write_docs(tmp_path)
    assert run_cli("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    assert [plan for plan, _, _ in limits] == checked and len(checked) == 3
    assert all(limit == held < before for _, limit, held in limits)
    assert mx.get_memory_limit() == before


def test_rerun_skips_done_rows_and_reuses_stored_prefixes(tmp_path, tiny_model):
    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    assert run_cli("run", str(job)).exit_code == 0
    again = run_cli("run", str(job))
    assert "0 rows written" in again.output and "9 already done" in again.output
    more = [*QUESTIONS, {"id": "when", "text": "When?"}]
    job = write_job(tmp_path, tiny_model, questions=more)
    assert run_cli("run", str(job)).exit_code == 0
    new = [r for r in rows(tmp_path) if r["question_id"] == "when"]
    assert len(new) == 3 and len(rows(tmp_path)) == 12
    for r in new:
        if r["doc_id"] != "notes.txt":  # long documents: prefix from disk, no document prefill
            assert r["cache_source"] == "disk" and r["doc_prefill_s"] == 0
            assert r["cached_tokens"] == r["doc_tokens"]


def test_a_limit_that_ends_inside_the_last_document_says_its_rows_are_left(tmp_path, tiny_model):
    """9 rows, 3 a document: --limit 8 takes 2 of the last document's 3 rows."""
    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    plan = run_cli("run", str(job), "--dry-run", "--limit", "8").output
    assert "plan: 8 rows to do (--limit 8; 1 more of the job left for later runs)" in plan
    limited = run_cli("run", str(job), "--limit", "8")
    assert limited.exit_code == 4, limited.output
    assert "--limit 8: 1 row of the job left" in limited.output
    assert run_cli("run", str(job), "--limit", "1").exit_code == 0  # the last row: done
    # --no-resume again would start over, the same first rows each time: the hint says so
    fresh = run_cli("run", str(job), "--no-resume", "--limit", "8")
    assert fresh.exit_code == 4
    assert "run the same command without --no-resume for the next ones" in fresh.output
    assert run_cli("run", str(job), "--limit", "8").exit_code == 0  # as it says: the 9th


def test_retry_errors_with_a_limit_goes_on_with_the_next_error_rows(tmp_path, tiny_model):
    """`--retry-errors --limit N` redoes N error rows a run, each once, as `--limit` goes on with
    the next rows; the series ends with the run that reaches the end of the job (exit 3 when the
    rows fail again). Before, each run redid the same first N and said the other rows and
    those N were left (exit 4), for ever."""
    write_docs(tmp_path)
    engine = {"prefill_chunk": 128, "pool_max_tokens": 128, "max_context": 40}
    job = write_job(tmp_path, tiny_model, engine=engine)  # every document overflows: 9 errors
    assert run_cli("run", str(job)).exit_code == 3
    first = {r["request_key"]: r["run_id"] for r in rows(tmp_path)}
    redone, codes = [], []
    for limit, left in ((4, 5), (4, 1)):
        before = {r["request_key"]: r["run_id"] for r in rows(tmp_path)}
        plan = run_cli("run", str(job), "--retry-errors", "--limit", str(limit), "--dry-run")
        done = 9 - limit - left
        assert f"(--limit {limit}; {left} more of the job left for later runs), {done} already" in (
            plan.output
        )
        result = run_cli("run", str(job), "--retry-errors", "--limit", str(limit))
        assert f"{limit} rows written ({limit} errors), {done} already done" in result.output
        assert f"--limit {limit}: {counted(left, 'row')} of the job left" in result.output
        assert "the job has 9 error rows" in result.output  # all of the job's, not the planned
        codes.append(result.exit_code)
        now = {r["request_key"]: r["run_id"] for r in rows(tmp_path)}
        redone.append({key for key in now if now[key] != before[key]})
    last = run_cli("run", str(job), "--retry-errors", "--limit", "4")
    assert "1 row written (1 error), 8 already done" in last.output
    codes.append(last.exit_code)
    now = {r["request_key"]: r["run_id"] for r in rows(tmp_path)}
    redone.append({key for key in now if now[key] != first[key]} - redone[0] - redone[1])
    assert codes == [4, 4, 3]
    assert [len(keys) for keys in redone] == [4, 4, 1] and set().union(*redone) == set(first)
    # the series ended: the next retry run starts again from the job's first error rows
    again = run_cli("run", str(job), "--retry-errors", "--limit", "4")
    assert again.exit_code == 4 and "4 rows written (4 errors), 0 already done" in again.output
    assert run_cli("run", str(job), "--retry-errors").exit_code == 3  # no limit: every one
    assert {r["run_id"] for r in rows(tmp_path)} == {rows(tmp_path)[0]["run_id"]}


def test_rows_no_longer_in_the_job_are_dropped(tmp_path, tiny_model):
    docs = write_docs(tmp_path)
    assert run_cli("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    first_run = {r["request_key"]: r["run_id"] for r in rows(tmp_path)}

    def pairs() -> set[tuple[str, str]]:
        return {(r["doc_id"], r["question_id"]) for r in rows(tmp_path)}

    questions = [q for q in QUESTIONS if q["id"] != "cost"] + [{"id": "when", "text": "When?"}]
    job = write_job(tmp_path, tiny_model, questions=questions)
    # --limit leaves the rest of the job unplanned: nothing is dropped yet; its dry run says so
    plan = run_cli("run", str(job), "--dry-run", "--limit", "1").output
    assert "plan: 1 row to do (--limit 1; 2 more of the job left for later runs), 6 already" in plan
    assert "\n  letter.pdf: " in plan and "\n  notes.txt: " not in plan  # only what it would do
    assert "no longer in the job" not in plan
    limited = run_cli("run", str(job), "--limit", "1")
    assert limited.exit_code == 4  # the job is not finished: rows are left
    assert "--limit 1: 2 rows of the job left; run the same command" in limited.output
    # over the whole job, as its dry run counts them (not only the planned document's 2)
    assert "1 row written (0 errors), 6 already done, 1 document" in limited.output
    assert "no longer in the job" not in limited.output
    assert len(pairs()) == 10 and ("notes.txt", "cost") in pairs()
    plan = run_cli("run", str(job), "--dry-run").output
    assert "plan: 2 rows to do, 7 already done" in plan
    stale = "3 rows of earlier runs are no longer in the job (a document, question, request or"
    assert stale in plan
    assert len(pairs()) == 10  # a dry run writes nothing

    finished = run_cli("run", str(job))
    assert finished.exit_code == 0
    assert f"warning: {stale}" in finished.output  # the run says so before it drops them
    docs_now = ["letter.pdf", "notes.txt", "report.md"]
    assert pairs() == {(d, q["id"]) for d in docs_now for q in questions}
    kept = [r for r in rows(tmp_path) if r["question_id"] != "when"]
    assert all(first_run[r["request_key"]] == r["run_id"] for r in kept)  # not recomputed

    (docs / "notes.txt").unlink()
    again = run_cli("run", str(job))
    assert again.exit_code == 0 and "0 rows written" in again.output
    assert pairs() == {(d, q["id"]) for d in docs_now if d != "notes.txt" for q in questions}

    job = write_job(tmp_path, tiny_model, questions=QUESTIONS[:1])
    assert run_cli("run", str(job), "--no-resume").exit_code == 0
    assert pairs() == {("letter.pdf", "summary"), ("report.md", "summary")}


def start_long_run(
    tmp_path: Path, model: Path, parts_wanted: int, max_tokens: int = 24
) -> subprocess.Popen:
    """A run of 21 rows in a subprocess, returned once `parts_wanted` parts are durable."""
    docs = write_docs(tmp_path)
    for i in range(4):
        (docs / f"extra{i}.md").write_text(f"Section {i}. " + "Tides and ledgers. " * 80)
    job = write_job(tmp_path, model, generation={"max_tokens": max_tokens})
    parts = tmp_path / "out" / "results.parquet.parts"
    proc = subprocess.Popen(
        [sys.executable, "-m", "salabatch.cli", "run", str(job), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    deadline = time.time() + 240
    while time.time() < deadline and len(list(parts.glob("part-*.parquet"))) < parts_wanted:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    return proc


def _ctrl_c_as_at_a_terminal() -> None:
    """SIGINT back to its default in the child: a suite started in the background by a shell
    without job control (`(make test &)`) ignores SIGINT, and Python keeps an ignored SIGINT
    ignored, so the run would not see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigkill_mid_run_then_rerun_gives_every_row_once(tmp_path, tiny_model):
    proc = start_long_run(tmp_path, tiny_model, parts_wanted=4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = rows(tmp_path)  # readable mid-run, from the parts
    assert 4 <= len(partial) < 21
    result = run_cli("run", str(tmp_path / "job.yaml"))
    assert result.exit_code == 0, result.output
    final = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    keys = [r["request_key"] for r in final]
    assert len(final) == 21 and len(set(keys)) == 21
    assert {(r["doc_id"], r["question_id"]) for r in final} == {
        (d, q["id"])
        for d in ["notes.txt", "report.md", "letter.pdf", *[f"extra{i}.md" for i in range(4)]]
        for q in QUESTIONS
    }
    assert not (tmp_path / "out" / "results.parquet.parts").exists()


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda j: j.update(colour="red"), "colour: unknown field"),
        (lambda j: j["questions"][1].pop("text"), "questions[1].text: field required"),
        (lambda j: j["engine"].update(batch_size="four"), "engine.batch_size"),
        (lambda j: j.update(documents=[{"path": "nowhere"}]), "documents[0].path"),
    ],
)
def test_bad_job_files_exit_2_with_the_location(tmp_path, tiny_model, edit, where):
    write_docs(tmp_path)
    path = write_job(tmp_path, tiny_model)
    job = yaml.safe_load(path.read_text())
    edit(job)
    path.write_text(yaml.safe_dump(job))
    for command in ("validate", "run"):
        result = subprocess.run(
            [sys.executable, "-m", "salabatch.cli", command, str(path)],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2, (command, result.stderr)
        assert where in result.stderr and "Traceback" not in result.stderr
        assert result.stderr.startswith("error: ")


def test_unreadable_documents_become_error_rows(tmp_path, tiny_model):
    docs = write_docs(tmp_path)
    (docs / "broken.pdf").write_bytes(b"%PDF-1.4\n garbage \x00\x01 no xref")
    (docs / "empty.txt").write_bytes(b"")
    scanned = SHARED_PDFS / "imagemagick-images.pdf"
    if scanned.is_file():
        shutil.copy(scanned, docs / "scanned.pdf")
    job = write_job(tmp_path, tiny_model)
    result = run_cli("run", str(job))
    assert result.exit_code == 3, result.output  # the run finished, with error rows
    got = {(r["doc_id"], r["question_id"]): r for r in rows(tmp_path)}
    bad = ["broken.pdf", "empty.txt"] + (["scanned.pdf"] if scanned.is_file() else [])
    for doc in bad:
        for q in QUESTIONS:
            r = got[(doc, q["id"])]
            assert r["status"] == "error" and r["finish_reason"] == "error" and r["error"]
    assert "corrupt PDF" in got[("broken.pdf", "who")]["error"]
    assert "empty" in got[("empty.txt", "who")]["error"]
    if scanned.is_file():
        assert "no extractable text" in got[("scanned.pdf", "who")]["error"]
    for doc in ("notes.txt", "report.md", "letter.pdf"):
        assert all(got[(doc, q["id"])]["status"] == "ok" for q in QUESTIONS)


def test_dry_run_plans_without_loading_weights(tmp_path, tiny_model, monkeypatch):
    import salabatch.engine.load as load

    def refuse(*_a, **_k):
        raise AssertionError("dry run loaded the weights")

    monkeypatch.setattr(load, "load_model", refuse)
    write_docs(tmp_path)
    result = run_cli("run", str(write_job(tmp_path, tiny_model)), "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("letter.pdf: ", "report.md: ", "notes.txt: ", "summary: Summarize this."):
        assert text in out
    assert re.search(r"letter\.pdf: \d+ tokens, 1 page, ", out)  # a one-page PDF
    assert "tokens" in out and "plan: 9 rows to do" in out and "prefill" in out
    assert not (tmp_path / "out").exists()


def test_context_overflow(tmp_path, tiny_model):
    write_docs(tmp_path)
    job = write_job(
        tmp_path,
        tiny_model,
        engine={"max_context": 400, "prefill_chunk": 128, "pool_max_tokens": 128},
    )
    assert run_cli("run", str(job)).exit_code == 3  # error rows
    over = [r for r in rows(tmp_path) if r["doc_id"] == "report.md"]
    assert all(r["status"] == "error" and "tokens with its prompt" in r["error"] for r in over)
    assert all(r["status"] == "ok" for r in rows(tmp_path) if r["doc_id"] == "notes.txt")
    engine = {
        "max_context": 400,
        "prefill_chunk": 128,
        "pool_max_tokens": 128,
        "on_overflow": "truncate_middle",
    }
    job = write_job(tmp_path, tiny_model, engine=engine, output={"path": "out/cut.parquet"})
    assert run_cli("run", str(job)).exit_code == 0
    cut = read_results(tmp_path / "out" / "cut.parquet").to_pylist()
    assert all(r["status"] == "ok" for r in cut)
    assert all(r["prompt_tokens"] + 6 <= 400 for r in cut)


def test_each_row_of_a_document_is_planned_within_max_context_by_its_own_room(tmp_path, tiny_model):
    """One question's longer answer, or a question longer than the context, failed every row
    of the document, rows that fit included; truncation cut ~1 % more than the overshoot,
    and only the dry run said it cut."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "report.md").write_text("# Report\n\n" + "The quay needs new fenders. " * 60)

    runs = iter(range(10))

    def run(*args, questions, **engine):
        engine = {"prefill_chunk": 128, "pool_max_tokens": 0, **engine}
        out = {"path": f"out/{next(runs)}.parquet"}  # each run its own results
        job = write_job(tmp_path, tiny_model, questions=questions, engine=engine, output=out)
        return run_cli("run", str(job), *args), tmp_path / out["path"]

    short = {"id": "short", "text": "Who?", "max_tokens": 6}
    plan, _ = run("--dry-run", questions=[short], max_context=100_000)
    tokens = int(re.search(r"report\.md: (\d+) tokens", plan.output).group(1))
    long = {"id": "long", "text": "Who?", "max_tokens": 60}
    huge = {"id": "huge", "text": "word " * (tokens + 80), "max_tokens": 6}
    result, path = run(questions=[short, long, huge], max_context=tokens + 40)
    assert result.exit_code == 3, result.output
    got = {r["question_id"]: r for r in read_results(path).to_pylist()}
    assert got["short"]["status"] == "ok" and got["short"]["doc_tokens"] == tokens
    assert got["long"]["error"].startswith(f"document has {tokens} tokens with its prompt")
    assert got["huge"]["error"].startswith("question huge has ")
    assert "which leaves no room for the document" in got["huge"]["error"]

    room = got["short"]["prompt_tokens"] - tokens + 6  # the question's prompt and answer
    for over in (1, 40):  # tokens over: the cut keeps what fits, within a few tokens
        result, path = run(
            questions=[short], max_context=tokens + room - over, on_overflow="truncate_end"
        )
        (row,) = read_results(path).to_pylist()
        assert tokens - over - 3 <= row["doc_tokens"] <= tokens - over, (row, over)
        said = f"note: document report.md: truncate_end: document cut from {tokens} to "
        assert f"{said}{row['doc_tokens']} tokens" in result.output, result.output


def test_truncate_middle_fits_what_truncate_end_fits(tmp_path, tiny_model):
    """A tight context after a long system prompt: the middle cut fits the document as the end
    cut does (it cut text already holding the last cut's mark, and stalled at the mark's
    length: error rows); an answer longer than the context names max_tokens as the fix."""
    write_docs(tmp_path)
    system = "You are a careful analyst. " * 8
    sizes = {}
    for mode in ("truncate_middle", "truncate_end"):
        engine = {"max_context": 520, "pool_max_tokens": 128, "on_overflow": mode}
        job = write_job(tmp_path, tiny_model, engine=engine, system=system)
        result = run_cli("run", str(job), "--dry-run", "--no-resume")
        assert result.exit_code == 0 and "error" not in result.output, result.output
        sizes[mode] = re.findall(rf"{mode}: document cut from \d+ to (\d+) tokens", result.output)
    assert sizes["truncate_middle"] and len(sizes["truncate_middle"]) == len(sizes["truncate_end"])
    job = write_job(
        tmp_path, tiny_model, engine={"max_context": 520}, generation={"max_tokens": 510}
    )
    result = run_cli("run", str(job), "--dry-run", "--no-resume")
    assert "lower max_tokens" in result.output, result.output


def test_ctrl_c_stops_after_finished_rows(tmp_path, tiny_model):
    # Interrupted early and with long answers left: a loaded machine may be slow to send the
    # signal, and the run must still be going when it arrives.
    proc = start_long_run(tmp_path, tiny_model, parts_wanted=1, max_tokens=128)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    err = proc.stderr.read()
    assert "interrupted" in err and "Traceback" not in err
    saved = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()  # merged on exit
    assert 1 <= len(saved) < 21
    assert not (tmp_path / "out" / "results.parquet.parts").exists()


def test_a_file_name_that_is_not_utf8_is_stored_escaped_and_its_row_says_so(tmp_path, tiny_model):
    # Defect 2: a surrogate-escaped name stopped the whole run at the Parquet write, exit 1,
    # losing the pooled batch it was in, and every rerun failed the same way.
    docs = write_docs(tmp_path)
    name = os.fsdecode(b"caf\xe9 menu.txt")
    (docs / name).write_text("Soup of the day: leek.")
    result = run_cli("run", str(write_job(tmp_path, tiny_model)))
    assert result.exit_code == 0, result.output
    got = {r["doc_id"]: r for r in rows(tmp_path)}
    assert len(rows(tmp_path)) == 12 and all(r["status"] == "ok" for r in rows(tmp_path))
    escaped = got["caf_menu.txt"]["doc_path"]
    assert escaped == f"{docs}/caf\\xe9 menu.txt (file name not UTF-8: its bytes shown as \\xNN)"
    assert got["notes.txt"]["doc_path"] == str(docs / "notes.txt")
    again = run_cli("run", str(write_job(tmp_path, tiny_model)))
    assert again.exit_code == 0 and "12 already done" in again.output


def test_a_rerun_stopped_before_its_plan_counts_the_rows_already_done(
    tmp_path, tiny_model, monkeypatch
):
    """Ctrl-C while the model loads: it said "0 already done" of a job all done."""
    from salabatch.jobs.run import runner

    write_docs(tmp_path)
    job = str(write_job(tmp_path, tiny_model))
    assert run_cli("run", job).exit_code == 0

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "load_model", interrupted)
    again = run_cli("run", job)
    done = len(rows(tmp_path))
    assert again.exit_code == 130 and f"{done} already done" in again.output, again.output


def test_sigterm_stops_like_ctrl_c_and_says_the_rows_are_safe(tmp_path, tiny_model):
    proc = start_long_run(tmp_path, tiny_model, parts_wanted=1, max_tokens=128)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143  # 128 + SIGTERM, as a shell reports it
    err = proc.stderr.read()
    assert "terminated (SIGTERM): finished rows are saved; run the same command to resume" in err
    assert "Traceback" not in err
    saved = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()  # merged on exit
    assert 1 <= len(saved) < 21
    assert not (tmp_path / "out" / "results.parquet.parts").exists()


def test_cache_ls_names_the_documents_of_the_stored_prefixes(tmp_path, tiny_model):
    write_docs(tmp_path)
    assert run_cli("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    listed = run_cli("cache", "ls", "--dir", str(tmp_path / "cache"))
    assert listed.exit_code == 0, listed.output
    header, *entries = listed.output.splitlines()[:-1]
    assert "document" in header.split()
    documents = sorted(line.split()[8] for line in entries if " prefix " in line)
    assert documents == ["letter.pdf", "report.md"]  # notes.txt is short: pooled, not stored


def test_a_document_that_does_not_fit_is_refused_before_its_prefill(
    tmp_path, tiny_model, monkeypatch
):
    """Each document, and each pooled batch of short ones, is planned before its prefill: one
    that needs more memory than is free becomes error rows saying both figures, the run goes
    on; the dry run prints the plan."""
    from salabatch.engine import memory

    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    plan = run_cli("run", str(job), "--dry-run")
    assert re.search(
        r"memory: the largest of the documents, \S+ \(\d+ tokens, 3 rows\) needs about .* "
        "free now",
        plan.output,
    )
    assert re.search(  # notes.txt, short: pooled
        r"memory: the longest pooled row \(\d+ tokens, its document with it\) needs about",
        plan.output,
    )
    monkeypatch.setattr(memory, "available_bytes", lambda gpu: 1 << 20)
    result = run_cli("run", str(job))
    assert result.exit_code == 3, result.output
    refused = [r for r in rows(tmp_path) if r["status"] == "error"]
    assert refused and all("is free" in r["error"] and "GB" in r["error"] for r in refused)
    assert "error in document" in result.output and "OutOfMemoryError" in result.output
    # the pooled short one too (it was answered whatever memory was free)
    assert "error in a pooled batch: OutOfMemoryError" in result.output
    assert len(refused) == len(rows(tmp_path)) == 9
    monkeypatch.undo()
    again = run_cli("run", str(job), "--retry-errors")
    assert again.exit_code == 0 and all(r["status"] == "ok" for r in rows(tmp_path))


def test_the_dry_runs_memory_line_is_the_document_that_plans_the_most(tmp_path, tiny_model):
    """Not the longest document: cut by --limit (or resumed) it may have one row left, a
    shorter one all of theirs; the dry run said the job fits where the run refused one."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The ferry to Eastwick leaves at 7:10 every day. " * 20)
    (docs / "z.txt").write_text("The quay needs new fenders before the winter. " * 60)
    job = write_job(tmp_path, tiny_model, generation={"max_tokens": 300})
    plan = run_cli("run", str(job), "--dry-run", "--limit", "4")
    assert plan.exit_code == 0, plan.output
    assert re.search(r"a\.txt: \d+ tokens, 3 rows", plan.output)
    assert re.search(r"z\.txt: \d+ tokens, 1 row", plan.output)
    assert re.search(
        r"memory: the largest of the documents, a\.txt \(\d+ tokens, 3 rows\) needs about",
        plan.output,
    ), plan.output


def test_a_document_whose_rows_reach_dense_len_is_answered_from_whole_prompts(tmp_path):
    """A document prefilled alone below dense_len runs the sparse layers dense; one call over
    a row's whole prompt past dense_len runs them sparse over the document too (SPEC P7): such
    a document's rows carry their whole prompts (pooled), as a single request prefills them,
    or the answers differed (a greedy token changed on builtin:random)."""
    from salabatch.engine.sampling import SamplingParams
    from salabatch.jobs.ingest.documents import Document
    from salabatch.jobs.run.plan import DocPlan, Row, pooled

    doc = Document("d", "d.txt", "x", "")

    def plan(doc_tokens: int, *prompts: int) -> DocPlan:
        rows = [
            Row(f"k{i}", doc, f"q{i}", "?", f"d.q{i}", SamplingParams(), 8, False, (0,) * n)
            for i, n in enumerate(prompts)
        ]
        return DocPlan(doc, rows, doc_prompt=list(range(doc_tokens)))

    from salabatch.jobs.run.prepare import JobSetup
    from salabatch.jobs.spec.load import read_job

    write_docs(tmp_path)
    spec, _ = read_job(str(write_job(tmp_path, "builtin:tiny")), ())
    config = JobSetup.of(spec).config
    sc = config.sparse  # builtin:tiny: sparse from 2048, a query selects 12 blocks of 64
    assert (sc.dense_len, sc.topk_eff * sc.block_size) == (2048, 768)
    big = dict(pool_max_tokens=0, batch_size=8)  # never short: only crossing pools
    assert pooled(plan(2030, 40, 10), **big, config=config)  # one row's prompt reaches it
    assert not pooled(plan(2000, 40, 10), **big, config=config)  # none does
    assert not pooled(plan(2048, 40), **big, config=config)  # sparse alone already
    assert not pooled(plan(700, 1400), **big, config=config)  # the modes agree over 700
    assert not pooled(plan(2030, 40), **big)  # no config: as before
