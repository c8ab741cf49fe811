"""Choosing the next token: greedy, or temperature with top-k / top-p, and a repetition penalty.

Every row has its own settings and its own random stream, keyed by (seed, step) only: the same
prompt and seed give the same text whatever else is in the batch or when the row joined it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads seeds so (seed, step) keys differ


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (top_k / top_p are then irrelevant)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability ≥ top_p
    top_k: int = 0  # keep the k most likely tokens; 0: all
    repetition_penalty: float = 1.0  # > 1 discourages tokens the answer already contains
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"invalid sampling settings: {self}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0: {self}")


def step_key(seed: int, step: int) -> mx.array:
    """The random key of token `step` of a row with this seed."""
    return mx.random.key((seed * _GOLDEN + step) % (1 << 64))


def sample(
    logits: mx.array,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    generated: Sequence[Sequence[int]],
) -> list[int]:
    """logits [B, V] → one token per row. `steps[b]` counts the row's tokens so far and
    `generated[b]` holds them (the repetition penalty reads the answer, not the document)."""
    logits = logits.astype(mx.float32)
    if all(p.temperature == 0 and p.repetition_penalty == 1 for p in params):
        return mx.argmax(logits, axis=-1).tolist()  # the common case: one op for the batch
    return [_sample_row(logits[b], p, steps[b], generated[b]) for b, p in enumerate(params)]


def _sample_row(logits: mx.array, p: SamplingParams, step: int, generated: Sequence[int]) -> int:
    if p.repetition_penalty != 1 and generated:
        seen = mx.array(sorted(set(generated)))
        old = logits[seen]
        logits[seen] = mx.where(old > 0, old / p.repetition_penalty, old * p.repetition_penalty)
    if p.temperature == 0:
        return mx.argmax(logits).item()
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[0]:
        kth = mx.topk(logits, p.top_k).min()
        logits = mx.where(logits < kth, -mx.inf, logits)
    if p.top_p < 1:
        order = mx.argsort(-logits)
        probs = mx.softmax(logits[order])
        # keep a token if the mass before it is below top_p (the most likely is always kept)
        before = mx.cumsum(probs) - probs
        keep = mx.zeros(logits.shape, dtype=mx.bool_)
        keep[order] = before < p.top_p
        logits = mx.where(keep, logits, -mx.inf)
    return mx.random.categorical(logits, key=step_key(p.seed, step)).item()
