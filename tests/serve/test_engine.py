"""The serving engine on a tiny random model: concurrent jobs decode together and each gets
exactly what it gets alone (greedy); cancel, the bounded queue, failures and close end jobs as
they should; a conversation's next turn and a document's next question resume from the held
prefix; the held prefixes keep to their memory cap, and an evicted one comes back from disk."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine import generate as generate_module
from salabatch.engine.cache import ModelCache
from salabatch.engine.generate import Batch, Generator, Prefill, Request, prefill, prefill_forks
from salabatch.engine.load import load_model
from salabatch.engine.sampling import SamplingParams
from salabatch.engine.sparse_cache import SparseKVCache
from salabatch.engine.speculative import OFF, Speculation
from salabatch.jobs.store.prefix_store import PrefixKey
from salabatch.serve import engine as engine_module
from salabatch.serve.app import usage
from salabatch.serve.completion import QUESTION_TAIL, tail
from salabatch.serve.engine import (
    COUNTERS,
    GAUGES,
    EngineClosed,
    Failed,
    Finished,
    Job,
    JobFailed,
    PromptLogprobs,
    QueueFull,
    ServeEngine,
    Token,
    padded_batches,
    save_points,
)
from salabatch.serve.prefixes import SeenPrompts, owned, prefix_digests
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint

GREEDY = SamplingParams()
TOL = 1e-4  # float32 logits, as tests/engine/test_batching.py
# float32 lightning states (entries up to ~100): relative to the largest, the replay of a rolled
# back call (decode's arithmetic) against a chunked prefill's
STATE_REL = 1e-5


class Detok:
    """A streaming detokenizer's interface; token t reads as `<t>`, the tokens it continues
    (`after`) as `[t]` before them."""

    def __init__(self, after=()) -> None:
        self.text = "".join(f"[{t}]" for t in after)

    def add_token(self, token: int) -> None:
        self.text += f"<{token}>"

    def finalize(self) -> None:
        pass


class Tok:
    """What the engine reads of a tokenizer: its fingerprint and a streaming detokenizer."""

    fingerprint = "test-tokenizer"

    def detokenizer(self, *, skip_special: bool = False, after=()) -> Detok:
        return Detok(after)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # sparse (InfLLM-v2) from 256 tokens: the documents below run the sparse kernels
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), tiny_config_dict(**SPARSE_AT_256))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, dtype="float32")


def ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(3, 256, size=n).tolist())


def job(name: str, prompt, max_tokens: int = 12, **kw) -> Job:
    return Job(name, tuple(prompt), kw.pop("params", GREEDY), max_tokens, frozenset(), **kw)


def collect(ticket) -> tuple[list[int], Finished | Failed]:
    tokens = []
    for event in ticket:
        if isinstance(event, Token):
            tokens.append(event.token)
        else:
            return tokens, event
    raise AssertionError("no last event")


def alone(model, prompt, max_tokens: int = 12, doc=None) -> list[int]:
    """The reference: the Generator, one request at a time; with `doc` (a prefilled document's
    cache), over a fork of it, as the engine resumes at a boundary."""
    own = tuple(prompt[0 if doc is None else doc.offset :])
    request = Request("r", own, GREEDY, max_tokens)
    return next(iter(Generator(model, batch_size=1).generate([request], doc))).tokens


def prefilled(model, doc: tuple[int, ...]):
    cache = model.make_cache()
    prefill(model, doc, cache)
    return cache


def test_save_points():
    assert save_points(0, 1000, (), 256) == [1000]
    assert save_points(0, 100, (), 256) == []  # too short to be worth holding
    assert save_points(0, 2020, (2000,), 256) == [2000]  # the question after it is short
    assert save_points(2000, 2400, (2020, 2300), 256) == [2300]  # 2400: 100 past 2300
    assert save_points(0, 900, (300, 400, 700), 256) == [300, 700]


def test_jobs_over_one_document_decode_together_each_as_alone(model):
    """16 questions of one 1500-token document, 8 queued before the engine starts and 8 sent
    while they decode: one prefill of the document, the rows in one batch (the late ones join
    it), and each the tokens it gets alone."""
    doc = ids(1500, 1)
    questions = [ids(3 + 2 * i, 100 + i) for i in range(16)]
    jobs = [job(f"q{i}", doc + q, boundaries=(len(doc),)) for i, q in enumerate(questions)]
    engine = ServeEngine(model, Tok(), batch_size=16, prefill_chunk=512)
    tickets = [engine.submit(j) for j in jobs[:8]]
    with engine:
        first = iter(tickets[0])
        early = [next(first).token]
        tickets += [engine.submit(j) for j in jobs[8:]]
        tokens, fin = collect(first)
        got = [(early + tokens, fin)] + [collect(t) for t in tickets[1:]]
        stats = engine.stats()
    doc_cache = prefilled(model, doc)
    for j, (tokens, fin) in zip(jobs, got, strict=True):
        assert isinstance(fin, Finished) and fin.finish_reason == "length", fin
        assert tokens == alone(model, j.prompt, doc=doc_cache), j.id
        assert fin.completion_tokens == 12 and fin.prompt_tokens == len(j.prompt)
    assert sorted(f.cached_tokens for _, f in got) == [0] + [1500] * 15
    assert stats["prefill_tokens_total"] == 1500 + sum(map(len, questions))
    assert stats["prefix_misses_total"] == 1 and stats["prefix_hits_memory_total"] == 15
    # decoded together: far fewer steps than tokens (a group per row would be 16 × 11 steps)
    assert stats["decode_step_seconds_count"] < 32
    assert stats["completion_tokens_total"] == 192 and stats["requests_finished_total"] == 16
    assert set(COUNTERS) | set(GAUGES) <= set(stats)
    assert stats["ttft_seconds_count"] == 16 == stats["ttft_seconds_bucket_+Inf"]
    assert stats["decode_step_seconds_bucket_1"] <= stats["decode_step_seconds_count"]


def test_different_prompts_decode_together_each_as_alone(model):
    """Unrelated prompts submitted from threads: short ones share one batch (their caches
    joined), long ones each decode over their own held prefix."""
    prompts = [ids(n, n) for n in (5, 40, 1, 17, 300, 9, 120, 280, 33, 2)]
    engine = ServeEngine(model, Tok(), batch_size=10, max_queue=16)
    out: dict[int, tuple] = {}
    submitted = threading.Barrier(len(prompts) + 1)

    def client(i: int) -> None:
        ticket = engine.submit(job(f"p{i}", prompts[i], max_tokens=10))
        submitted.wait()
        out[i] = collect(ticket)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    submitted.wait()
    with engine:
        for t in threads:
            t.join()
        stats = engine.stats()
    for i, prompt in enumerate(prompts):
        tokens, fin = out[i]
        assert fin.finish_reason == "length" and fin.cached_tokens == 0
        assert tokens == alone(model, prompt, max_tokens=10), i
    assert stats["decode_step_seconds_count"] < 40  # 10 + 10 + 10; one group per job: 100
    assert stats["prefix_held_count"] == 2  # the prompts of ≥ 256 tokens


def test_cancel_running_and_queued(model):
    engine = ServeEngine(model, Tok(), batch_size=1, max_queue=4)
    long = engine.submit(job("long", ids(20, 5), max_tokens=10_000))
    queued = engine.submit(job("queued", ids(20, 6)))
    queued.cancel()
    after = engine.submit(job("after", ids(20, 7)))
    with engine:
        tokens = []
        for event in long:
            if isinstance(event, Token):
                tokens.append(event.token)
                if len(tokens) == 3:
                    long.cancel()
            else:
                last = event
        assert isinstance(last, Finished) and last.finish_reason == "cancelled"
        assert 3 <= last.completion_tokens == len(tokens) < 100
        tokens, fin = collect(queued)
        assert not tokens and fin.finish_reason == "cancelled" and fin.completion_tokens == 0
        got, fin = collect(after)
        assert fin.finish_reason == "length" and got == alone(model, ids(20, 7))
        stats = engine.stats()
    assert stats["requests_cancelled_total"] == 2 and stats["running_rows"] == 0


def test_leaving_the_loop_cancels(model):
    with ServeEngine(model, Tok(), batch_size=2) as engine:
        ticket = engine.submit(job("a", ids(10, 1), max_tokens=10_000))
        for event in ticket:
            assert isinstance(event, Token)
            break
        assert ticket.cancelled  # the break closed the generator: the job is cancelled
        other = collect(engine.submit(job("b", ids(10, 2))))
        assert other[1].finish_reason == "length"
        deadline = time.monotonic() + 120  # a loaded machine: the engine thread may lag
        while engine.stats()["requests_cancelled_total"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["requests_cancelled_total"] == 1


def test_queue_full(model):
    engine = ServeEngine(model, Tok(), batch_size=1, max_queue=2)
    # not started: one job will take the free row, two wait, the next is refused
    queued = [engine.submit(job(f"j{i}", ids(8, i))) for i in range(3)]
    with pytest.raises(QueueFull, match="max_queue 2"):
        engine.submit(job("j3", ids(8, 3)))
    with engine:
        done = [collect(t)[1] for t in queued]
        assert all(f.finish_reason == "length" for f in done)
        # one row: each waited in the queue for the one before it to finish
        for before, f in zip(done, done[1:], strict=False):
            assert f.queued_s >= before.queued_s + before.decode_s > 0
        stats = engine.stats()
        assert stats["queue_seconds_count"] == 3 == stats["queue_seconds_bucket_+Inf"]
        assert stats["queue_seconds_sum"] == pytest.approx(sum(f.queued_s for f in done))
        # under load: one row decoding (batch_size 1), two waiting, the next refused
        busy = engine.submit(job("busy", ids(8, 3), max_tokens=10_000))
        assert isinstance(next(iter(busy)), Token)
        waiting = [engine.submit(job(f"w{i}", ids(8, 10 + i))) for i in range(2)]
        with pytest.raises(QueueFull):
            engine.submit(job("refused", ids(8, 20)))
        busy.cancel()
        for t in waiting:
            assert collect(t)[1].finish_reason == "length"
        assert engine.stats()["requests_rejected_total"] == 2


def conversation_turn(engine, prompt, boundaries=()) -> tuple[list[int], Finished]:
    tokens, fin = collect(engine.submit(job("turn", prompt, max_tokens=16, boundaries=boundaries)))
    assert isinstance(fin, Finished), fin
    return tokens, fin


def test_next_turn_resumes_from_the_last(model):
    """Turn 1 of a conversation over a 2000-token document; turn 2 re-sends it with the answer
    and a new question and prefills under 5 % of turn 1's tokens, with the answer it gets on a
    fresh engine. A document's next question resumes at the document's boundary."""
    doc = ids(2000, 3)
    one = doc + ids(12, 4)
    with ServeEngine(model, Tok(), prefill_chunk=512) as engine:
        answer, fin1 = conversation_turn(engine, one)
        assert fin1.cached_tokens == 0
        two = one + tuple(answer) + ids(15, 5)
        answer2, fin2 = conversation_turn(engine, two, boundaries=(len(one),))
        assert fin2.cached_tokens == len(one) and fin2.cache_source == "memory"
        assert fin2.prompt_tokens - fin2.cached_tokens < 0.05 * fin1.prompt_tokens
    with ServeEngine(model, Tok(), prefill_chunk=512) as fresh:
        assert conversation_turn(fresh, two, boundaries=(len(one),))[0] == answer2

    # a document with its boundary: the question after it is too short to be held, so the
    # next turn resumes at the document and prefills question, answer and new question
    with ServeEngine(model, Tok(), prefill_chunk=512) as engine:
        first = doc + ids(12, 6)
        answer, fin1 = conversation_turn(engine, first, boundaries=(len(doc),))
        second = first + tuple(answer) + ids(15, 7)
        _, fin2 = conversation_turn(engine, second, boundaries=(len(doc), len(first)))
        assert fin2.cached_tokens == len(doc)
        assert fin2.prompt_tokens - fin2.cached_tokens < 0.05 * fin1.prompt_tokens
        # a segment long enough is held even on a fork (a copy), and the third turn finds it
        third = second + ids(300, 8)
        _, fin3 = conversation_turn(engine, third, boundaries=(len(doc), len(second)))
        fourth = third + ids(5, 9)
        _, fin4 = conversation_turn(engine, fourth, boundaries=(len(doc), len(third)))
        assert fin3.cached_tokens == len(doc) and fin4.cached_tokens == len(third)
        # the same prompt again: held whole with its logits, nothing prefilled
        again, fin5 = conversation_turn(engine, third)
        assert fin5.cached_tokens == len(third)
    with ServeEngine(model, Tok(), prefill_chunk=512) as fresh:
        assert conversation_turn(fresh, third, boundaries=(len(doc), len(second)))[0] == again


def test_a_scoring_job_scores_its_whole_prompt_then_answers_as_alone(model):
    """A job with prompt_logprobs prefills its whole prompt even where the engine holds a
    prefix of it, and puts its scores (a scored Prefill's) before its tokens, which are what
    the job without them answers; with max_tokens 0 it only scores (length, no token). A
    prompt of one token has no score."""
    doc = ids(600, 21)
    prompt = doc + ids(9, 22)
    feed = Prefill(model, prompt, model.make_cache(), 256, score=2)
    while not feed.finished:
        feed.step()
    with ServeEngine(model, Tok(), prefill_chunk=256) as engine:
        collect(engine.submit(job("doc", doc, 2, boundaries=(len(doc),))))  # now held
        events = list(engine.submit(job("s", prompt, 6, prompt_logprobs=2)))
        only = list(engine.submit(job("z", prompt, 0, prompt_logprobs=0)))
        bare = list(engine.submit(job("b", prompt[:1], 0, prompt_logprobs=0)))
        with pytest.raises(JobFailed, match="max_tokens must be ≥ 1"):
            engine.check(job("x", prompt, 0))
    assert isinstance(events[0], PromptLogprobs)
    got, want = events[0].logprobs, feed.scores()
    assert [x.token for x in got] == list(prompt[1:])
    assert [[t for t, _ in x.top] for x in got] == [[t for t, _ in x.top] for x in want]
    flat = [v for x in got for _, v in x.top]
    assert flat == pytest.approx([v for x in want for _, v in x.top], abs=TOL)
    assert [x.logprob for x in got] == pytest.approx([x.logprob for x in want], abs=TOL)
    tokens = [e.token for e in events if isinstance(e, Token)]
    assert tokens == alone(model, prompt, 6)
    assert events[-1].cached_tokens == 0 and events[-1].completion_tokens == 6
    assert [type(e) for e in only] == [PromptLogprobs, Finished]
    assert [x.logprob for x in only[0].logprobs] == pytest.approx(
        [x.logprob for x in want], abs=TOL
    )
    assert only[0].logprobs[0].top == ()
    assert only[1].finish_reason == "length" and only[1].completion_tokens == 0
    assert bare[0].logprobs == () and bare[1].finish_reason == "length"


def whole_scores(model, prompt, k: int):
    """The reference: `prompt` scored in one fresh prefill (k alternatives)."""
    feed = Prefill(model, prompt, model.make_cache(), 256, score=k)
    while not feed.finished:
        feed.step()
    return feed.scores()


def assert_same_scores(got, want) -> None:
    assert [x.token for x in got] == [x.token for x in want]
    assert [x.logprob for x in got] == pytest.approx([x.logprob for x in want], abs=TOL)
    assert [[t for t, _ in x.top] for x in got] == [[t for t, _ in x.top] for x in want]
    flat = [v for x in got for _, v in x.top]
    assert flat == pytest.approx([v for x in want for _, v in x.top], abs=TOL)


def test_questions_after_one_document_resume_before_their_tail(model):
    """Prompts that share a 1,500-token document and differ in their last tokens (a raw
    prompt's question, with `completion.tail`'s boundary QUESTION_TAIL before its end): the
    first snapshots there, the others resume from it and answer what they answer alone."""
    doc = ids(1500, 41)
    prompts = [doc + ids(n, 42 + n) for n in (20, 60, 9)]
    with ServeEngine(model, Tok(), prefill_chunk=512) as engine:
        got = [
            collect(engine.submit(job(f"q{i}", p, boundaries=tuple(tail(len(p), ())))))
            for i, p in enumerate(prompts)
        ]
    at = len(prompts[0]) - QUESTION_TAIL
    assert [fin.cached_tokens for _, fin in got] == [0, at, at]
    for p, (tokens, _) in zip(prompts, got, strict=True):
        assert tokens == alone(model, p)


def test_seen_prompts_find_where_a_prompt_starts_as_a_recent_one():
    seen = SeenPrompts(block=4, most=6)
    assert seen.agreed(list(range(20))) == 0  # nothing seen yet
    assert seen.agreed([*range(10), 99, 98]) == 8  # agrees on 10 ids: cut to a block
    assert seen.agreed(list(range(12))) == 8  # below its own length, never at it
    assert seen.agreed([7, *range(10)]) == 0  # six prefixes seen: all remembered
    assert seen.agreed(list(range(20))) == 16
    # five more: the least recently seen go, the first prompt's among them
    assert seen.agreed([7, *range(30)]) == 8
    assert seen.agreed(list(range(20))) == 0


def test_questions_longer_than_the_tail_resume_from_the_third(model):
    """Long questions (300-450 tokens) over one 1,500-token document, no boundary marking it
    off: the second snapshots where it starts as the first did (1,472: 23 blocks of 64), and the
    ones after it resume there; each answers what it answers alone."""
    doc = ids(1500, 61)
    prompts = [doc + ids(300 + 50 * i, 62 + i) for i in range(4)]
    with ServeEngine(model, Tok(), prefill_chunk=512) as engine:
        got = [collect(engine.submit(job(f"q{i}", p))) for i, p in enumerate(prompts)]
    assert [fin.cached_tokens for _, fin in got] == [0, 0, 1472, 1472]
    for p, (tokens, _) in zip(prompts, got, strict=True):
        assert tokens == alone(model, p)


def test_scoring_jobs_resume_from_snapshots_held_with_their_scores(model):
    """lm-eval's loglikelihood over one context: each choice a job scoring context + choice.
    The first snapshots at its boundaries with its scores so far (fresh, on a fork, and at its
    end); the next resumes from the longest with scores of as many alternatives and scores
    only its own tokens (the first from the held logits); one asking more alternatives than
    held prefills whole and its snapshots give the held prefixes those, for the next. Every
    job's scores are those of its prompt scored whole, and a plain job resumes from the scored
    prefixes as from any; the held bytes count the scores."""
    doc = ids(700, 51)
    choices = [ids(3, 52), ids(5, 53), ids(3, 54), ids(3, 55)]
    prompts = [doc + c for c in choices]
    marks = (300, 575)  # 575: the tail of a 703-token prompt
    with ServeEngine(model, Tok(), prefill_chunk=256, snapshot_min=64) as engine:

        def scored(name, prompt, k):
            events = list(engine.submit(job(name, prompt, 0, prompt_logprobs=k, boundaries=marks)))
            assert [type(e) for e in events] == [PromptLogprobs, Finished], events
            return events[0].logprobs, events[-1].cached_tokens

        got = [scored(*case) for case in zip("abcd", prompts, (2, 1, 3, 3), strict=True)]
        tokens, fin = collect(engine.submit(job("p", prompts[1], 6, boundaries=marks)))
        whole, cached_whole = scored("w", prompts[1], 1)  # held whole: nothing to prefill
        prefixes = engine._prefixes
        held_bytes = sum(h.nbytes for h in prefixes.held.values())
        assert prefixes.held_bytes == held_bytes
        kept = {h.tokens: (h.scores.shape[1] - 1) // 2 for h in prefixes.held.values()}
    # from b on, each also snapshots at 640, where its prompt starts as a's did (`SeenPrompts`)
    assert [cached for _, cached in got] == [0, 575, 0, 640]
    for (scores, _), prompt, k in zip(got, prompts, (2, 1, 3, 3), strict=True):
        assert_same_scores(scores, whole_scores(model, prompt, k))
    # b snapshotted its end too (130 tokens past 575): held whole, with its logits
    assert fin.cached_tokens == 705 and tokens == alone(model, prompts[1], 6)
    assert cached_whole == 705
    assert_same_scores(whole, whole_scores(model, prompts[1], 1))
    assert kept[300] == kept[575] == kept[640] == 3


@pytest.mark.parametrize("seed", [0, 1])
def test_a_mixed_workload_over_shared_documents_answers_and_scores_as_alone(model, tmp_path, seed):
    """Seeded: 16 jobs over two documents (a document, then a tail of 1-300 tokens; marked at
    the document's end, before the tail, or not at all), half of them scoring their prompts (0-3
    alternatives, answering 0-4 tokens), in waves submitted together, through an engine that
    snapshots every 64 tokens and holds about two prefixes (the rest evicted to its store, their
    scores dropped): every answer is what its prompt answers alone, every score is its prompt's
    scored whole, the held bytes keep to the cap, and scoring jobs resume too."""
    rng = np.random.default_rng(seed)
    docs = [ids(700, 90 + seed), ids(500, 95 + seed)]
    cases = []
    for i in range(16):
        doc = docs[rng.integers(2)]
        prompt = doc + ids(int(rng.integers(1, 300)), 1000 * seed + i)
        marks = [(), (len(doc),), tuple(tail(len(prompt), ()))][rng.integers(3)]
        k = int(rng.integers(4)) if i % 2 else None
        max_tokens = int(rng.integers(0 if k is not None else 1, 5))
        cases.append(job(f"j{i}", prompt, max_tokens, boundaries=marks, prompt_logprobs=k))
    with ServeEngine(model, Tok(), batch_size=4, snapshot_min=64) as probe:
        collect(probe.submit(job("probe", docs[0], max_tokens=1)))
        one = probe.stats()["prefix_held_bytes"]
    cap = int(2.5 * one)
    got, held = [], []
    store = tmp_path / "store"
    with ServeEngine(
        model, Tok(), batch_size=4, snapshot_min=64, prefix_bytes=cap, store_dir=store
    ) as engine:
        for wave in (cases[:5], cases[5:6], cases[6:12], cases[12:13], cases[13:]):
            tickets = [engine.submit(j) for j in wave]
            for t in tickets:
                got.append(list(t))
                held.append(engine.stats()["prefix_held_bytes"])
    assert max(held) <= cap
    pairs = zip(cases, got, strict=True)
    scoring = [e[-1].cached_tokens for j, e in pairs if j.prompt_logprobs is not None]
    assert any(scoring) and sum(e[-1].cached_tokens for e in got) > sum(scoring)
    for j, events in zip(cases, got, strict=True):
        assert isinstance(events[-1], Finished), (j.id, events[-1])
        tokens = [e.token for e in events if isinstance(e, Token)]
        assert tokens == (alone(model, j.prompt, j.max_tokens) if j.max_tokens else []), j.id
        if j.prompt_logprobs is not None:
            assert isinstance(events[0], PromptLogprobs), j.id
            assert_same_scores(events[0].logprobs, whole_scores(model, j.prompt, j.prompt_logprobs))


def test_prefix_memory_cap_and_disk(model, tmp_path):
    """Eight distinct 400-token prompts through a cap of two held prefixes: the held bytes stay
    under the cap while they run; the evicted ones are written to the store, and a later prompt
    that continues the first is resumed from disk with the answer it gets from memory."""
    prompts = [ids(400, 50 + i) for i in range(8)]
    with ServeEngine(model, Tok(), batch_size=4) as probe:  # the bytes one prefix holds
        collect(probe.submit(job("probe", prompts[0], max_tokens=1)))
        one = probe.stats()["prefix_held_bytes"]
    cap = int(2.5 * one)
    store = tmp_path / "store"
    with ServeEngine(model, Tok(), batch_size=4, prefix_bytes=cap, store_dir=store) as engine:
        tickets = [engine.submit(job(f"p{i}", p, max_tokens=6)) for i, p in enumerate(prompts)]
        held = []
        for t in tickets:
            for _ in t:
                held.append(engine.stats()["prefix_held_bytes"])
            assert isinstance(_, Finished)
        stats = engine.stats()
        assert max(held) <= cap and stats["prefix_held_bytes"] <= cap
        assert stats["prefix_evictions_total"] >= 6 and stats["prefix_lent_bytes"] == 0
        assert len(list((store / "prefixes").glob("*.safetensors"))) >= 6
        later = prompts[0] + ids(10, 99)
        tokens, fin = collect(engine.submit(job("later", later)))
        assert fin.cached_tokens == 400 and fin.cache_source == "disk"
        assert engine.stats()["prefix_hits_disk_total"] == 1
    with ServeEngine(model, Tok(), batch_size=4) as memory:
        collect(memory.submit(job("first", prompts[0], max_tokens=6)))
        again, fin = collect(memory.submit(job("later", later)))
        assert fin.cache_source == "memory" and again == tokens
    # a new engine on the same store (a restarted server) finds it by the job's boundary
    with ServeEngine(model, Tok(), store_dir=store) as restarted:
        again, fin = collect(restarted.submit(job("later", later, boundaries=(400,))))
        assert fin.cache_source == "disk" and again == tokens
    # ... and with no boundary there, by the lengths of the store's entries: a run's document
    # ends inside its user message, where no chat message ends
    with ServeEngine(model, Tok(), store_dir=store) as another:
        again, fin = collect(another.submit(job("later", later)))
        assert (fin.cache_source, fin.cached_tokens) == ("disk", 400) and again == tokens


def test_interactive_jobs_go_before_a_background_prefill(model):
    """A background job (a batch's line) with a long prompt, then an interactive one: the
    interactive job is admitted and answered while the background prefill is still going (its
    chunks are small and take at most half the engine's time while interactive rows decode),
    and both answer as they do alone."""
    long, short = ids(3000, 80), ids(20, 81)
    with ServeEngine(model, Tok(), prefill_chunk=512, background_chunk=64) as engine:
        alone_long = collect(engine.submit(job("a", long, max_tokens=4)))[0]
        alone_short = collect(engine.submit(job("b", short, max_tokens=8)))[0]
    order = []
    with ServeEngine(model, Tok(), prefill_chunk=512, background_chunk=64) as engine:
        background = engine.submit(job("bg", long, max_tokens=4, background=True))
        deadline = time.monotonic() + 10
        while engine.stats()["prefilling"] < 1 and time.monotonic() < deadline:
            time.sleep(0.002)  # until its prefill is under way (not a fixed guess at when)
        interactive = engine.submit(job("fg", short, max_tokens=8))

        def read(name, ticket):
            got = collect(ticket)
            order.append(name)
            return got

        threads = [
            threading.Thread(target=lambda: results.__setitem__("bg", read("bg", background))),
            threading.Thread(target=lambda: results.__setitem__("fg", read("fg", interactive))),
        ]
        results = {}
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert order == ["fg", "bg"]
    assert results["fg"][0] == alone_short and results["bg"][0] == alone_long
    # the later job's first token came first: no wait for the whole background prefill
    assert results["fg"][1].ttft_s < results["bg"][1].ttft_s


def test_close_writes_the_held_prefixes_to_the_store(model, tmp_path):
    """A server that closes with prefixes held in memory (under its cap: none evicted) writes
    them to the store, so the next one over the same store resumes from disk."""
    store = tmp_path / "store"
    doc = ids(600, 70)
    with ServeEngine(model, Tok(), store_dir=store) as engine:
        first, _ = collect(engine.submit(job("first", doc + ids(8, 71), boundaries=(600,))))
        assert engine.stats()["prefix_evictions_total"] == 0
    assert list((store / "prefixes").glob("*.safetensors"))
    later = doc + ids(8, 71)
    with ServeEngine(model, Tok(), store_dir=store) as restarted:
        again, fin = collect(restarted.submit(job("again", later, boundaries=(600,))))
    assert fin.cache_source == "disk" and fin.cached_tokens >= 600 and again == first


def test_async_iteration_does_not_block_the_loop(model):
    prompts = [ids(30 + i, 200 + i) for i in range(4)]

    async def main() -> tuple[list, int]:
        loop = asyncio.get_running_loop()
        ticks = 0
        done = asyncio.Event()

        async def heartbeat() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        async def client(engine, prompt) -> list[int]:
            tokens = []
            async for event in engine.submit(job("a", prompt), loop):
                if isinstance(event, Token):
                    tokens.append(event.token)
                else:
                    assert isinstance(event, Finished) and event.finish_reason == "length"
            return tokens

        beat = asyncio.create_task(heartbeat())
        with ServeEngine(model, Tok(), batch_size=4) as engine:
            results = await asyncio.gather(*(client(engine, p) for p in prompts))
        done.set()
        await beat
        return results, ticks

    results, ticks = asyncio.run(main())
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == alone(model, prompt)
    assert ticks > 5  # the loop ran while the engine worked


def test_a_failing_job_does_not_stop_the_others(model, monkeypatch):
    step = Prefill.step

    def failing(self):
        if self.total == 77:
            raise RuntimeError("the device is on fire")
        return step(self)

    monkeypatch.setattr(Prefill, "step", failing)
    good = [ids(20, 300 + i) for i in range(3)]
    context = model.config.context_length
    engine = ServeEngine(model, Tok(), batch_size=8)
    bad = [
        engine.submit(job("too-long", (5,) * context)),
        engine.submit(job("bad-id", (5, 300, 6))),
        engine.submit(job("empty", ())),
        engine.submit(job("fails-in-prefill", ids(77, 1))),
    ]
    tickets = [engine.submit(job(f"g{i}", p)) for i, p in enumerate(good)]
    with pytest.raises(JobFailed, match="job bad-id: ValueError: token id 300"):
        engine.check(job("bad-id", (5, 300, 6)))
    engine.check(job("fine", good[0]))
    with engine:
        for ticket, why in zip(bad, ("context", "vocabulary", "no tokens", "on fire"), strict=True):
            tokens, last = collect(ticket)
            assert not tokens and isinstance(last, Failed)
            assert isinstance(last.error, JobFailed) and why in str(last.error)
            assert last.error.job_id == ticket.job.id and ticket.job.id in str(last.error)
        for ticket, prompt in zip(tickets, good, strict=True):
            tokens, last = collect(ticket)
            assert isinstance(last, Finished) and tokens == alone(model, prompt)
        assert engine.stats()["requests_failed_total"] == 4


def test_speculation_reaches_the_groups_with_the_held_prefix_as_context(model, monkeypatch):
    """The engine's Speculation goes to every decoding group; a row forking a held prefix has
    its tokens as context (where the lookup drafter searches), a row forking none has none; the
    draft counts come back in Finished, the usage and the counters."""
    made: list[Batch] = []
    added: list[Request] = []

    class Recording(Batch):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def add(self, request, *args, **kwargs):
            added.append(request)
            return super().add(request, *args, **kwargs)

        def step(self):
            read = super().step()
            for g in read:
                if g.done:  # counts the engine would not give: 2n + 1 drafted, n accepted
                    g.draft_tokens, g.accepted_tokens = 2 * len(g.tokens) + 1, len(g.tokens)
            return read

    monkeypatch.setattr(generate_module, "Batch", Recording)
    doc, short = ids(400, 21), ids(20, 22)
    questions = [ids(5, 23), ids(7, 24)]
    speculation = Speculation("lookup", 3, 2)
    with ServeEngine(model, Tok(), prefill_chunk=512, speculation=speculation) as engine:
        got = [
            collect(engine.submit(job(f"q{i}", doc + q, boundaries=(len(doc),))))
            for i, q in enumerate(questions)
        ]
        got.append(collect(engine.submit(job("short", short))))
        stats = engine.stats()
    assert made and all(b.speculation == speculation for b in made)
    for request, q in zip(added[:2], questions, strict=True):
        assert request.context == doc and request.prompt == q  # the first held it, the next forks
    assert added[-1].context == () and added[-1].prompt == short
    for tokens, fin in got:
        assert isinstance(fin, Finished) and fin.completion_tokens == len(tokens) == 12
        assert (fin.draft_tokens, fin.accepted_tokens) == (25, 12)
        assert usage([fin])["completion_tokens_details"] == {
            "accepted_prediction_tokens": 12,
            "rejected_prediction_tokens": 13,
        }
    assert stats["draft_tokens_total"] == 75 and stats["accepted_tokens_total"] == 36
    undrafted = replace(got[0][1], draft_tokens=0, accepted_tokens=0)
    assert "completion_tokens_details" not in usage([undrafted])
    with ServeEngine(model, Tok()) as engine:  # off unless asked for
        assert engine.speculation == OFF


def test_stop_strings_end_a_row_with_its_text_cut(model):
    prompt = ids(25, 11)
    free = alone(model, prompt, max_tokens=12)
    stop = f"<{free[4]}>"
    cut = "".join(f"<{t}>" for t in free).index(stop)
    with ServeEngine(model, Tok()) as engine:
        tokens, fin = collect(engine.submit(job("s", prompt, stop_strings=(stop,))))
        plain = collect(engine.submit(job("t", prompt)))[1]
    assert fin.finish_reason == "stop" and fin.text == "".join(f"<{t}>" for t in free)[:cut]
    assert tokens == free[: len(tokens)] and len(tokens) <= 5
    assert plain.text is None and plain.finish_reason == "length"
    # a text completion's text continues its prompt's: decoded after it
    with ServeEngine(model, Tok()) as engine:
        text = collect(engine.submit(job("c", prompt, stop_strings=(stop,), continues=True)))[1]
    assert text.text == "".join(f"[{t}]" for t in prompt) + fin.text


def test_close_ends_everything(model):
    engine = ServeEngine(model, Tok(), batch_size=1, max_queue=4)
    engine.start()
    running = engine.submit(job("running", ids(10, 1), max_tokens=10_000))
    assert isinstance(next(iter(running)), Token)
    queued = engine.submit(job("queued", ids(10, 2)))
    engine.close()
    assert not engine._thread.is_alive()
    for ticket in (running, queued):
        last = list(ticket)[-1]
        assert isinstance(last, Failed) and isinstance(last.error, EngineClosed)
    with pytest.raises(EngineClosed):
        engine.submit(job("late", ids(10, 3)))
    never = ServeEngine(model, Tok())
    waiting = never.submit(job("w", ids(10, 4)))
    never.close()  # never started: what waits still ends
    assert isinstance(collect(waiting)[1].error, EngineClosed)


def test_a_snapshot_of_a_fork_continues_as_the_fork(model):
    """`owned` copies a fork (shared keys and its own) into a cache that continues exactly as
    the fork does, and forks as a prefilled cache does; the copy is the one cost of a snapshot
    taken on a fork."""
    doc = model.make_cache()
    prefill(model, ids(700, 1), doc)
    fork = doc.fork(1)
    prefill(model, ids(300, 2), fork)  # 1000 tokens: sparse mode, past the shared keys
    copy = owned(fork, model.config)
    assert copy.offset == fork.offset == 1000
    assert all(getattr(c, "shared", None) is None for c in copy.layers)
    after = ids(40, 3)
    want = prefill(model, after, fork)
    assert mx.abs(prefill(model, after, copy.fork(1)) - want).max().item() < TOL
    assert mx.abs(prefill(model, after, copy) - want).max().item() < TOL


def test_prefix_digests_name_what_the_store_names():
    prompt = ids(500, 4)
    digests = prefix_digests(prompt, [500, 1, 256])
    for n in (1, 256, 500):
        assert digests[n] == PrefixKey.of("m", "f", "t", "float32", prompt[:n]).ids_sha256


def test_rows_grow_past_what_was_reserved(model, monkeypatch):
    """A server's rows reserve `RESERVE_AHEAD` positions, not their whole max_tokens (which may
    be the context): answers longer than that grow their buffers as they go, unchanged."""
    monkeypatch.setattr(engine_module, "RESERVE_AHEAD", 1)
    doc = ids(300, 8)
    prompts = [doc + ids(4 + i, 40 + i) for i in range(3)] + [ids(30, 9)]
    with ServeEngine(model, Tok(), batch_size=4) as engine:
        tickets = [engine.submit(job("g", p, max_tokens=150, boundaries=(300,))) for p in prompts]
        got = [collect(t)[0] for t in tickets]
    doc_cache = prefilled(model, doc)
    for p, tokens in zip(prompts[:3], got[:3], strict=True):
        assert tokens == alone(model, p, max_tokens=150, doc=doc_cache)
    assert got[3] == alone(model, prompts[3], max_tokens=150)


def test_the_gpu_path_runs_on_the_engine_thread(checkpoint, monkeypatch):
    """The compiled decode step (a GPU's, forced here on any device) of a model loaded on this
    thread runs on the engine's: arrays the model keeps outside its parameters are evaluated
    when the engine is made, not left as ops of this thread's stream."""
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    model = load_model(checkpoint, dtype="float32")
    doc = ids(600, 12)
    prompts = [doc + ids(5 + i, 60 + i) for i in range(3)] + [ids(20, 13)]
    with ServeEngine(model, Tok(), batch_size=4) as engine:
        tickets = [engine.submit(job("g", p, boundaries=(600,))) for p in prompts]
        got = [collect(t) for t in tickets]
    doc_cache = prefilled(model, doc)
    for p, (tokens, fin) in zip(prompts[:3], got[:3], strict=True):
        assert isinstance(fin, Finished), fin
        assert tokens == alone(model, p, doc=doc_cache)
    assert got[3][0] == alone(model, prompts[3])


# ---- prefilling together -------------------------------------------------------------------


def test_padded_batches():
    # the bench's 8 questions: one batch, shortest first
    lengths = [44, 45, 42, 37, 44, 46, 44, 41]
    assert padded_batches(lengths, 2048, 4096) == [[3, 7, 2, 0, 4, 6, 1, 5]]
    assert padded_batches([1, 100], 2048, 4096) == [[0], [1]]  # 99 padded positions of 101
    assert padded_batches([1, 10], 2048, 4096) == [[0, 1]]  # 9 ≤ PAD_FREE
    assert padded_batches([100] * 30, 2048, 4096) == [list(range(20)), list(range(20, 30))]
    # a shorter row is never carried across `side` (dense_len less the prefix) by a longer one
    assert padded_batches([10, 20, 30, 31], 2048, 25) == [[0, 1], [2, 3]]
    assert padded_batches([24, 25], 2048, 25) == [[0], [1]]
    assert padded_batches([7], 2048, 25) == [[0]] and padded_batches([], 2048, 25) == []


@pytest.mark.parametrize(
    ("doc_len", "groups"),
    [
        # a dense prefix: rows that stay below dense_len (256), then rows that cross it
        (100, [[1, 17, 63, 64, 65, 150], [156, 200, 300]]),
        # a sparse prefix (InfLLM-v2 from 256 tokens), from one token to past a block; rows of
        # one length (nothing padded) and a prompt alone
        (700, [[1, 5, 63, 64, 65, 130, 333], [30, 30], [40]]),
    ],
)
def test_prefill_forks_is_each_rows_own_prefill(model, doc_len, groups):
    """Prompts of different lengths prefilled as one padded call on forks of a prefix give each
    row what its own prefill gives: the last logits, the cache (positions, keys kept, lightning
    states) and the next decode step; the rows join the prefix's other forks."""
    doc = prefilled(model, ids(doc_len, doc_len))
    for lengths in groups:
        prompts = [ids(n, 1000 + n + i) for i, n in enumerate(lengths)]
        rows = prefill_forks(model, doc, prompts)
        for p, (row, logits) in zip(prompts, rows, strict=True):
            own = doc.fork(1)
            want = prefill(model, p, own)
            assert logits.shape == want.shape
            assert mx.abs(logits - want).max().item() < TOL, len(p)
            assert row.positions == own.positions == [doc_len + len(p)]
            for mine, theirs in zip(row.layers, own.layers, strict=True):
                if isinstance(mine, SparseKVCache):
                    assert mine.keys.lengths == theirs.keys.lengths
                    assert [b.lengths for b in mine.compressed] == [
                        b.lengths for b in theirs.compressed
                    ]
                else:
                    scale = mx.abs(theirs.state).max().item()
                    assert mx.abs(mine.state - theirs.state).max().item() < STATE_REL * scale
            step = mx.array([[int(want.argmax())]], dtype=mx.int32)
            assert mx.abs(model(step, row) - model(step, own)).max().item() < TOL, len(p)
        joined = ModelCache.concat([doc.fork(1), *(row for row, _ in rows)])
        assert joined.rows == 1 + len(prompts)


@pytest.fixture
def batched(monkeypatch):
    """The sizes of the padded prefill calls the engine makes (`prefill_forks`)."""
    sizes: list[int] = []
    real = generate_module.prefill_forks

    def counted(model, prefix, prompts):
        sizes.append(len(prompts))
        return real(model, prefix, prompts)

    monkeypatch.setattr(generate_module, "prefill_forks", counted)
    return sizes


def test_jobs_taken_together_prefill_together_each_as_alone(model, batched):
    """Questions of one held document taken together: the short ones prefill as padded batches
    of similar lengths (1 and 3 tokens, three of about 40, 200 alone), one longer than the
    prefill chunk prefills on its own row; each gets exactly what it gets alone."""
    doc = ids(600, 21)
    own = [1, 40, 3, 200, 41, 45, 700]
    prompts = [doc + ids(n, 300 + n) for n in own]
    engine = ServeEngine(model, Tok(), batch_size=8, prefill_chunk=512)
    first = engine.submit(job("doc", doc + ids(8, 22), boundaries=(600,)))
    jobs = [job(f"q{n}", p, boundaries=(600,)) for n, p in zip(own, prompts, strict=True)]
    tickets = [engine.submit(j) for j in jobs]
    with engine:
        collect(first)
        got = [collect(t) for t in tickets]
        stats = engine.stats()
    doc_cache = prefilled(model, doc)
    for p, (tokens, fin) in zip(prompts, got, strict=True):
        assert isinstance(fin, Finished) and fin.cached_tokens == 600, fin
        assert tokens == alone(model, p, doc=doc_cache), len(p) - 600
    assert sorted(batched) == [1, 2, 3]  # 200 | 1, 3 | 40, 41, 45; 700 on its own row
    assert stats["prefill_tokens_total"] == 608 + sum(own)


def test_rows_on_both_sides_of_dense_len_over_a_dense_prefix(model, batched):
    """A held prefix of 200 tokens (dense, below dense_len 256): questions that end below
    dense_len prefill apart from those that end past it (one padded call would carry the
    shorter across), and each gets what it gets alone; a job alone takes the same padded path,
    as a batch of one."""
    doc = ids(200, 31)
    own = [48, 58, 50, 60, 54]  # 248, 250, 254 | 258, 260
    prompts = [doc + ids(n, 400 + n) for n in own]
    engine = ServeEngine(model, Tok(), batch_size=8, snapshot_min=128)  # the questions: none
    first = engine.submit(job("doc", doc + ids(3, 32), boundaries=(200,)))
    jobs = [job(f"q{n}", p, boundaries=(200,)) for n, p in zip(own, prompts, strict=True)]
    tickets = [engine.submit(j) for j in jobs]
    lone = doc + ids(30, 33)
    with engine:
        collect(first)
        got = [collect(t) for t in tickets]
        together = sorted(batched)
        batched.clear()
        single, _ = collect(engine.submit(job("one", lone, boundaries=(200,))))
    doc_cache = prefilled(model, doc)
    for p, (tokens, fin) in zip(prompts, got, strict=True):
        assert isinstance(fin, Finished) and fin.cached_tokens == 200, fin
        assert tokens == alone(model, p, doc=doc_cache), len(p) - 200
    assert together == [2, 3]
    assert single == alone(model, lone, doc=doc_cache) and batched == [1]


def test_each_prefill_chunk_runs_within_its_jobs_memory_plan(model, monkeypatch):
    """A job's prefill chunks run under MLX's memory limit set from the plan its admission
    checked (`memory.bounded`), and the limit before is restored."""
    from contextlib import contextmanager

    from salabatch.engine import memory

    checked, bounded_plans = [], []
    check, bounded = memory.check, memory.bounded

    @contextmanager
    def recorded(plan):
        bounded_plans.append(plan)
        with bounded(plan) as limit:
            assert mx.get_memory_limit() == limit
            yield limit

    monkeypatch.setattr(memory, "check", lambda p, **kw: checked.append(p) or check(p, **kw))
    monkeypatch.setattr(memory, "bounded", recorded)
    before = mx.get_memory_limit()
    engine = ServeEngine(model, Tok(), batch_size=2, prefill_chunk=512)
    with engine:
        tokens, fin = collect(engine.submit(job("long", ids(1500, 7), max_tokens=4)))
    assert isinstance(fin, Finished) and len(tokens) == 4
    assert len(checked) == 1 and bounded_plans == checked * 3  # 1500 tokens, 512 a chunk
    assert mx.get_memory_limit() == before


def test_a_prompt_past_dense_len_prefilled_in_pieces_answers_as_one_call(tmp_path):
    """A fresh prompt past dense_len prefilled in pieces (a snapshot at a boundary between
    them) ran its first piece's sparse layers dense (planned for the piece): its answer's
    log-probabilities differed from one call's. Now planned for the whole prompt, and a
    prefix held so serves only a prompt on its side of dense_len (SPEC P7). Sparse from 512
    tokens, where a query at 256-511 sees more blocks than it attends."""
    from tests.tiny import SPARSE_AT_512

    path = write_tiny_checkpoint(tmp_path / "m", tiny_config_dict(**SPARSE_AT_512))
    model = load_model(path, dtype="float32")
    prompt = ids(530, 41)

    def alone_logprobs(tokens) -> list[float]:
        request = Request("r", tuple(tokens), GREEDY, 6, logprobs=0)
        g = next(iter(Generator(model, batch_size=1).generate([request])))
        return [lp.logprob for lp in g.logprobs]

    def served(engine, tokens, boundaries=()) -> tuple[list[float], Finished]:
        events = list(engine.submit(job("j", tokens, 6, boundaries=boundaries, logprobs=0)))
        return [e.logprob.logprob for e in events if isinstance(e, Token)], events[-1]

    with ServeEngine(model, Tok(), snapshot_min=256) as engine:
        got, fin = served(engine, prompt, boundaries=(400,))
        assert fin.cached_tokens == 0
        assert got == pytest.approx(alone_logprobs(prompt), abs=1e-4)
        # the prefix held at 400 was computed for a prompt past dense_len: it serves one
        short = prompt[:400] + ids(60, 42)  # 460 tokens: below dense_len, dense throughout
        got, fin = served(engine, short)
        assert fin.cached_tokens == 0 and got == pytest.approx(alone_logprobs(short), abs=1e-4)
        longer = prompt[:400] + ids(150, 43)  # 550: past it, as the held prefix was made
        got, fin = served(engine, longer)
        assert fin.cached_tokens == 400
        assert got == pytest.approx(alone_logprobs(longer), abs=1e-4)
    with ServeEngine(model, Tok(), snapshot_min=64) as engine:
        # a prefix short enough to serve both sides (no query of it attends fewer blocks than
        # it has), then the rest in pieces: one that ends below dense_len ran dense
        served(engine, prompt[:240], boundaries=(200,))
        resumed = prompt[:200] + ids(340, 44)  # 540 tokens, a boundary at 450 below 512
        got, fin = served(engine, resumed, boundaries=(200, 450))
        assert fin.cached_tokens == 200
        assert got == pytest.approx(alone_logprobs(resumed), abs=1e-4)
