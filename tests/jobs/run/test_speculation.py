"""Speculative decoding in a run: `engine.speculative` reaches the Generator, each row's request
carries its document's prompt as the lookup drafter's context (one tuple per document), the
draft counts land in the results, and changing the settings reruns nothing."""

from __future__ import annotations

from salabatch.engine.speculative import Speculation
from salabatch.jobs.run import answerer
from tests.drafts import record_generators
from tests.jobs.run.test_runner import rows, run_cli, write_docs, write_job

POOLED = "notes.txt"  # under the job's pool_max_tokens: its rows prefill their whole prompts


def test_settings_and_document_context_reach_the_generator_and_counts_the_results(
    tmp_path, tiny_model, monkeypatch
):
    seen = record_generators(monkeypatch, answerer)
    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    result = run_cli("run", str(job), "--set", "engine.speculative={draft: layers, tokens: 3}")
    assert result.exit_code == 0, result.output

    assert seen.speculations and set(seen.speculations) == {Speculation("layers", 3, 8)}
    got = rows(tmp_path)
    assert len(got) == 9 and len(seen.requests) == 9
    by_doc: dict[str, list] = {}
    for r in got:
        request = seen.request(r["request_key"])
        by_doc.setdefault(r["doc_id"], []).append(request)
        n = r["completion_tokens"]
        assert (r["draft_tokens"], r["accepted_tokens"]) == (2 * n + 1, n), r["custom_id"]
        if r["doc_id"] == POOLED:  # the prompt holds the document, and is searched itself
            assert request.context == () and len(request.prompt) == r["prompt_tokens"]
        else:
            assert len(request.context) == r["doc_tokens"] > 0
            assert len(request.context) + len(request.prompt) == r["prompt_tokens"]
    for doc_id, requests in by_doc.items():
        if doc_id != POOLED:  # one tuple shared by the document's rows, not a copy each
            assert len({id(q.context) for q in requests}) == 1, doc_id


def test_changing_speculation_reruns_nothing_and_keeps_the_stored_prefixes(tmp_path, tiny_model):
    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    first = run_cli("run", str(job), "--set", "engine.speculative.draft=off")
    assert first.exit_code == 0, first.output
    assert all((r["draft_tokens"], r["accepted_tokens"]) == (0, 0) for r in rows(tmp_path))

    again = run_cli("run", str(job), "--set", "engine.speculative={draft: lookup, tokens: 6}")
    assert again.exit_code == 0, again.output
    assert "0 rows written" in again.output and "9 already done" in again.output

    engine = {"prefill_chunk": 128, "pool_max_tokens": 128, "batch_size": 4}
    engine["speculative"] = {"draft": "layers", "layers": 2}
    questions = [{"id": "when", "text": "When?"}]
    job = write_job(tmp_path, tiny_model, engine=engine, questions=questions)
    assert run_cli("run", str(job)).exit_code == 0
    for r in rows(tmp_path):
        if r["doc_id"] != POOLED:  # the prefix stored by the first run, whatever the drafts
            assert r["cache_source"] == "disk" and r["cached_tokens"] == r["doc_tokens"]
