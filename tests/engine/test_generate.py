"""Generation: greedy batches equal each request alone (dense and sparse), sampling is
reproducible per (prompt, seed), stop tokens and max_tokens end a row."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.generate import Generator, Request, prefill
from salabatch.engine.load import load_model
from salabatch.engine.sampling import SamplingParams, sample
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("g"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


def ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(3, 256, size=n).tolist())


GREEDY = SamplingParams()


def questions(n=8, max_tokens=24, params=GREEDY):
    lengths = [5, 17, 1, 9, 30, 2, 12, 7][:n]
    return [
        Request(f"q{i}", ids(length, 40 + i), params, max_tokens)
        for i, length in enumerate(lengths)
    ]


def run(model, requests, prefix=None, batch_size=8):
    out = Generator(model, batch_size=batch_size).generate(requests, prefix)
    return {g.request.id: g for g in out}


@pytest.mark.parametrize("doc_len", [150, 600], ids=["dense", "sparse"])
def test_greedy_batch_over_shared_prefix_equals_each_alone(model, doc_len):
    doc = model.make_cache()
    prefill(model, ids(doc_len, 1), doc)
    reqs = questions()
    together = run(model, reqs, doc, batch_size=8)
    small = run(model, reqs, doc, batch_size=3)  # rows leave and join while others decode
    for r in reqs:
        alone_cache = model.make_cache()
        prefill(model, ids(doc_len, 1), alone_cache)
        alone = run(model, [r], alone_cache, batch_size=1)[r.id]
        assert together[r.id].tokens == alone.tokens, r.id
        assert small[r.id].tokens == alone.tokens, r.id
        assert together[r.id].cached_tokens == doc_len
        assert len(alone.tokens) == 24 and alone.finish_reason == "length"


def test_unrelated_prompts_batch_equals_each_alone(model):
    reqs = [Request(f"d{i}", ids(n, n)) for i, n in enumerate((30, 300, 7, 270))]
    reqs = [Request(r.id, r.prompt, max_tokens=10) for r in reqs]
    together = run(model, reqs, batch_size=4)
    for r in reqs:
        assert together[r.id].tokens == run(model, [r], batch_size=1)[r.id].tokens


def test_same_seed_same_sample_whatever_the_batch(model):
    hot = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    reqs = questions(params=hot, max_tokens=16)
    a = run(model, reqs, batch_size=8)
    b = run(model, reqs[3:4], batch_size=1)
    c = run(model, list(reversed(reqs)), batch_size=2)
    assert a["q3"].tokens == b["q3"].tokens == c["q3"].tokens
    other_seed = Request("q3", reqs[3].prompt, SamplingParams(1.0, 0.9, 50, seed=8), 16)
    assert run(model, [other_seed])["q3"].tokens != a["q3"].tokens


def test_stop_tokens_and_max_tokens(model):
    free = run(model, [Request("a", ids(20, 3), max_tokens=12)])["a"]
    stop_at = free.tokens[5]
    stopped = run(model, [Request("a", ids(20, 3), max_tokens=12, stop=frozenset({stop_at}))])["a"]
    first = free.tokens.index(stop_at)
    assert stopped.tokens == free.tokens[:first] and stopped.finish_reason == "stop"
    one = run(model, [Request("a", ids(20, 3), max_tokens=1)])["a"]
    assert one.tokens == free.tokens[:1] and one.finish_reason == "length"


def test_sampling_rules():
    logits = mx.array([[0.0, 5.0, 4.0, -1.0, 4.5]])
    assert sample(logits, [SamplingParams()], [0], [[]]) == [1]
    # top_k = 1 is greedy whatever the temperature
    assert sample(logits, [SamplingParams(temperature=5.0, top_k=1)], [3], [[]]) == [1]
    # top_p keeps the smallest set reaching p: with p tiny only the argmax remains
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)], [9], [[]]) == [1]
    # a strong repetition penalty moves greedy off a token already generated
    assert sample(logits, [SamplingParams(repetition_penalty=10.0)], [1], [[1]]) == [4]
    draws = {
        sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0], [[]])[0] for s in range(40)
    }
    assert draws <= {0, 1, 2, 3, 4} and len(draws) > 1
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_timings_are_recorded(model):
    g = run(model, [Request("a", ids(50, 2), max_tokens=8)])["a"]
    assert g.prompt_tokens == 50 and g.completion_tokens == 8
    assert 0 < g.prefill_s <= g.ttft_s and g.decode_s > 0 and g.decode_tok_s > 0
