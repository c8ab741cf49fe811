"""Choosing the next token: greedy, or temperature with top-k / top-p / min-p, and penalties on
tokens the answer already holds (repetition: HF's, scaling; presence and frequency: OpenAI's,
subtracting).

Every row has its own settings and its own random stream, keyed by (seed, step) only: the same
prompt and seed give the same text whatever else is in the batch or when the row joined it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads seeds so (seed, step) keys differ


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (top_k / top_p / min_p are then irrelevant)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability ≥ top_p
    top_k: int = 0  # keep the k most likely tokens; 0: all
    repetition_penalty: float = 1.0  # > 1 discourages tokens the answer already contains
    seed: int = 0
    min_p: float = 0.0  # keep tokens at least min_p × the most likely one's probability; 0: all
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # × how often it was generated, subtracted from its logit

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"invalid sampling settings: {self}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0: {self}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1]: {self}")
        if not (math.isfinite(self.presence_penalty) and math.isfinite(self.frequency_penalty)):
            raise ValueError(f"presence_penalty and frequency_penalty must be finite: {self}")

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the logits as they are: greedy with no penalty."""
        return (
            self.temperature == 0
            and self.repetition_penalty == 1
            and self.presence_penalty == 0
            and self.frequency_penalty == 0
        )


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
    `generated[b]` holds them (the penalties read the answer, not the document)."""
    logits = logits.astype(mx.float32)
    if all(p.plain_greedy for p in params):
        return mx.argmax(logits, axis=-1).tolist()  # the common case: one op for the batch
    return [_sample_row(logits[b], p, steps[b], generated[b]) for b, p in enumerate(params)]


def _sample_row(logits: mx.array, p: SamplingParams, step: int, generated: Sequence[int]) -> int:
    logits = _penalized(logits, p, generated)
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
    if p.min_p > 0:
        # probability ≥ min_p × the top probability ⇔ logit ≥ top logit + log(min_p)
        logits = mx.where(logits < logits.max() + math.log(p.min_p), -mx.inf, logits)
    return mx.random.categorical(logits, key=step_key(p.seed, step)).item()


def _penalized(logits: mx.array, p: SamplingParams, generated: Sequence[int]) -> mx.array:
    """logits [V] with the repetition, presence and frequency penalties of `generated`."""
    if not generated or (
        p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
    ):
        return logits
    counts = Counter(generated)
    seen = mx.array(list(counts))
    old = logits[seen]
    new = mx.where(old > 0, old / p.repetition_penalty, old * p.repetition_penalty)
    new = new - p.presence_penalty - p.frequency_penalty * mx.array(list(counts.values()))
    logits[seen] = new
    return logits
