"""`salabatch bench serve` end to end, small: a real `salabatch serve` process, streaming
clients, the same questions one at a time and through `salabatch run`, and a short soak. It
measures nothing here; the numbers live in benchmarks/."""

from __future__ import annotations

import statistics

import pytest

from salabatch.bench import serve


@pytest.fixture(scope="module")
def result():
    return serve.run(
        "builtin:tiny",
        clients=3,
        max_tokens=6,
        soak=50,
        soak_documents=3,
        turn_tokens=1500,  # its prompts all below builtin:tiny's dense_len (2048): one side
        progress=lambda _: None,
    )


def test_three_modes_answer_the_same_questions(result):
    modes = [result[m] for m in ("concurrent", "one_at_a_time", "run")]
    assert all(m["completion_tokens"] > 0 and m["tokens_per_s"] > 0 for m in modes)
    # the server answers the same requests alike, together or one at a time (greedy)
    assert result["concurrent"]["completion_tokens"] == result["one_at_a_time"]["completion_tokens"]
    # every request resumed from the document its warm-up request left held
    doc = result["document_tokens"]
    assert result["concurrent"]["cached_tokens"] >= 3 * doc
    assert result["one_at_a_time"]["cached_tokens"] >= 3 * doc
    for m in ("concurrent", "one_at_a_time"):
        assert 0 < result[m]["ttft_p50_s"] <= result[m]["ttft_p95_s"]
    ratios = result["ratios"]
    assert set(ratios) == {
        "concurrent_over_one_at_a_time",
        "concurrent_over_one_at_a_time_rounds",
        "concurrent_over_run",
    }
    # the modes alternate on one server: a ratio per pair of rounds, the median reported
    rounds = ratios["concurrent_over_one_at_a_time_rounds"]
    assert len(rounds) == serve.ROUNDS == len(result["concurrent"]["rounds_s"])
    assert ratios["concurrent_over_one_at_a_time"] == round(statistics.median(rounds), 2)


def test_a_second_turn_resumes_from_the_first(result):
    t = result["turns"]
    assert t["turn1_cached_tokens"] == 0 and t["turn1_prompt_tokens"] >= 1500
    assert t["turn2_cached_tokens"] >= t["turn1_prompt_tokens"] - 256  # the snapshot rule
    assert t["turn2_prefilled_share_of_turn1"] < 0.2


def test_questions_and_choices_after_an_unmarked_document_resume(result):
    """Nothing marks the document off (it is in the user message, or a completions prompt):
    the later questions and scored choices resume before the first's tail."""
    for name in ("questions", "choices"):
        u = result["unmarked"][name]
        assert u["cached_tokens"][0] == 0 and min(u["cached_tokens"][1:]) >= 1500 - 256, name
        assert u["later_prefilled_share_of_first"] < 0.2, name


def test_soak_samples_the_servers_memory(result):
    soak = result["soak"]
    assert soak["requests"] == 50 and len(soak["rss_gb_every_50"]) == 1
    assert soak["rss_gb_every_50"][0] > 0.05  # a server with a model, not this process
    # the server's own counters: every soak request (and the two before it) reached it
    assert soak["server"]["requests_total"] >= 50 and "prefix_held_bytes" in soak["server"]


def test_table_and_chart(result, tmp_path):
    text = serve.table(result)
    assert "concurrent / one at a time" in text and "soak" in text
    pytest.importorskip("matplotlib")
    serve.chart(result, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").stat().st_size > 1000
