"""Sampling on crafted logits: greedy, temperature with top-k / top-p / min-p, and the
repetition (scaling) and presence / frequency (OpenAI's, subtracting) penalties."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from salabatch.engine.sampling import SamplingParams, sample, step_keys, truncated

LOGITS = mx.array([[0.0, 5.0, 4.0, -1.0, 4.5]])


def pick(params: SamplingParams, generated=(), step: int = 0, logits=LOGITS) -> int:
    return sample(logits, [params], [step], [list(generated)])[0]


def draws(params: SamplingParams, logits, seeds=range(200)) -> set[int]:
    return {pick(SamplingParams(**{**params.__dict__, "seed": s}), logits=logits) for s in seeds}


def test_sampling_rules():
    assert pick(SamplingParams()) == 1
    # top_k = 1 is greedy whatever the temperature
    assert pick(SamplingParams(temperature=5.0, top_k=1), step=3) == 1
    # top_p keeps the smallest set reaching p: with p tiny only the argmax remains
    assert pick(SamplingParams(temperature=1.0, top_p=1e-6), step=9) == 1
    # a strong repetition penalty moves greedy off a token already generated
    assert pick(SamplingParams(repetition_penalty=10.0), [1], step=1) == 4
    seeded = {pick(SamplingParams(temperature=1.0, seed=s)) for s in range(40)}
    assert seeded <= {0, 1, 2, 3, 4} and len(seeded) > 1
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_presence_and_frequency_penalties_subtract_from_the_logits():
    # token 1 leads token 4 by 0.5: greedy moves off it exactly when the penalty passes 0.5
    assert pick(SamplingParams(presence_penalty=0.49), [1, 1, 1]) == 1
    assert pick(SamplingParams(presence_penalty=0.51), [1, 1, 1]) == 4  # once, however often
    assert pick(SamplingParams(frequency_penalty=0.2), [1, 1]) == 1  # 0.4
    assert pick(SamplingParams(frequency_penalty=0.2), [1, 1, 1]) == 4  # 0.6: × the count
    assert pick(SamplingParams(presence_penalty=0.35, frequency_penalty=0.1), [1, 0, 1]) == 4
    assert pick(SamplingParams(presence_penalty=0.35, frequency_penalty=0.1), [1]) == 1
    # negative: generated tokens are favoured; only generated tokens count
    assert pick(SamplingParams(presence_penalty=-0.6), [4]) == 4
    assert pick(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)) == 1
    # before top_k: the penalized token drops out of the top 1
    assert pick(SamplingParams(temperature=1.0, top_k=1, presence_penalty=1.0), [1]) == 4


def test_min_p_keeps_tokens_near_the_most_likely():
    logits = mx.array([[2.0, 1.9, 0.0, -1.0]])  # probability / top: 1, 0.90, 0.14, 0.05
    hot = SamplingParams(temperature=1.0)
    assert draws(hot, logits) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, min_p=0.1), logits) == {0, 1, 2}
    assert draws(SamplingParams(temperature=1.0, min_p=0.5), logits) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, min_p=1.0), logits) == {0}
    # on the tempered distribution: at temperature 0.1 token 1 is e^-1 ≈ 0.37 of the top
    assert draws(SamplingParams(temperature=0.1, min_p=0.4), logits) == {0}
    assert draws(SamplingParams(temperature=0.1, min_p=0.3), logits) == {0, 1}
    # greedy ignores it
    assert pick(SamplingParams(min_p=0.9), logits=logits) == 0


def test_rows_keep_their_own_settings_and_seed_in_a_batch():
    rows = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=5, min_p=0.05),
        SamplingParams(presence_penalty=1.0),
        SamplingParams(temperature=0.8, seed=9, frequency_penalty=0.5, top_k=3),
    ]
    generated = [[1], [1, 4], [1], [2, 2]]
    logits = mx.concatenate([LOGITS] * len(rows))
    together = sample(logits, rows, [3, 4, 5, 6], generated)
    alone = [pick(p, g, step) for p, g, step in zip(rows, generated, [3, 4, 5, 6], strict=True)]
    assert together == alone
    assert together[0] == 1 and together[2] == 4  # greedy rows: plain, and penalized


def test_every_integer_seed_has_its_own_draws():
    """Seeds were taken modulo 2^64: -1 drew as 2^64 - 1 and 2^64 as 0. Seeds in [0, 2^64)
    draw as they always did."""
    seeds = [0, 1, 2**64 - 1, 2**64, -1, -(2**64), 2**64 + 1, 10**30]
    keys = step_keys(seeds, [0] * len(seeds)).tolist()
    assert len({tuple(k) for k in keys}) == len(seeds)
    assert keys[1] == [0x9E3779B9, 0x7F4A7C15]  # 1 · φ: as before
    logits = mx.array([[0.0] * 64])
    draws = {s: sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0], [[]]) for s in seeds}
    assert draws[-1] != draws[2**64 - 1] or draws[0] != draws[2**64]


@pytest.mark.parametrize(
    "bad",
    [
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"presence_penalty": math.inf},
        {"frequency_penalty": math.nan},
        {"repetition_penalty": 0},
        {"top_k": -1},
        {"temperature": -1},
    ],
)
def test_invalid_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_only_plain_greedy_takes_the_batch_argmax():
    assert SamplingParams().plain_greedy and SamplingParams(min_p=0.5, top_k=3).plain_greedy
    for changed in ({"temperature": 0.1}, {"presence_penalty": 0.1}, {"frequency_penalty": -1}):
        assert not SamplingParams(**changed).plain_greedy


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-46, 5e-324])
def test_a_temperature_near_zero_is_greedy_not_nan(temperature):
    # logit / temperature overflowed float32 (or the temperature rounded to 0): the softmax was
    # NaN and every draw token 0
    logits = mx.array([[1.0, 3.0, 12.0, -2.0]])
    hot = SamplingParams(temperature=temperature)
    assert draws(hot, logits, seeds=range(20)) == {2}
    kept = mx.softmax(truncated(logits, [hot]), axis=-1)[0].tolist()
    assert kept == [0.0, 0.0, 1.0, 0.0]


def test_top_p_1_keeps_every_token():
    """A float32 running sum reaches 1 before the tail of a wide vocabulary: top_p 1 (the
    default) made ~22,000 of 73,448 tokens impossible to draw."""
    logits = mx.random.normal((2, 73_448), key=mx.random.key(0)) * 3
    kept = truncated(logits, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)])
    assert not bool(mx.any(mx.isinf(kept)))
    cut = truncated(logits, [SamplingParams(temperature=1.0, top_p=0.999999)])
    assert bool(mx.any(mx.isinf(cut)))  # just under 1: the tail goes, as asked


@pytest.mark.parametrize("top_p", [1e-44, 1e-46, 5e-324])
def test_a_top_p_under_float32s_range_keeps_the_top_token(top_p):
    # rounded to 0, it kept nothing, and the edge read index -1 (the smallest logit): all kept
    flat = mx.array([[1.0, 1.2, 1.5, 0.9]])
    hot = SamplingParams(temperature=1.0, top_p=top_p)
    assert draws(hot, flat, seeds=range(20)) == {2}
    assert mx.isinf(truncated(flat, [hot])).tolist() == [[True, True, False, True]]
