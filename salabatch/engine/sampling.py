"""Choosing the next token: greedy, or temperature with top-k / top-p / min-p, and penalties on
tokens the answer already holds (repetition: HF's scaling; presence and frequency: OpenAI's,
subtracting). All three count the answer's tokens only: HF's and mlx-lm's repetition penalty
counts the prompt's too, which would put each row's prompt (a whole document) in its counts.

Every row has its own settings and its own random stream, keyed by (seed, step) only: the same
prompt and seed give the same text whatever else is in the batch or when the row joined it.

Log-probabilities (`token_logprobs`, for a row that asks for them): of the model's own
distribution, softmax of the logits in float32, before penalties, temperature and truncation (as
OpenAI's and vLLM's are), so they do not depend on how the token was chosen.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from salabatch.errors import GenerationError

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads seeds so (seed, step) keys differ
# The smallest temperature divided by: float32's smallest normal number. A smaller one (valid:
# any finite temperature ≥ 0 is) would round to 0, or to a denormal a GPU flushes to 0.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
TOP_LOGPROBS = 20  # most likely alternatives a row may ask the log-probabilities of (OpenAI's)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (top_k / top_p / min_p are then irrelevant)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability ≥ top_p
    top_k: int = 0  # keep the k most likely tokens; 0: all
    repetition_penalty: float = 1.0  # > 1 discourages tokens the answer (not the prompt) holds
    seed: int = 0
    min_p: float = 0.0  # keep tokens at least min_p × the most likely one's probability; 0: all
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # × how often it was generated, subtracted from its logit
    # (token id, bias in [-100, 100]) pairs added to those tokens' logits before anything else
    # (OpenAI's logit_bias: -100 bans a token, +100 all but forces it)
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        """GenerationError naming the first setting of the wrong type or out of range (the
        type first: a comparison with a string or None would raise a bare TypeError)."""

        def real(name: str, ok, expected: str) -> None:
            value = getattr(self, name)
            numeric = not isinstance(value, bool) and isinstance(value, numbers.Real)
            if not (numeric and ok(value)):  # NaN fails every `ok`
                raise GenerationError(f"must be {expected}, got {value!r}", field=name)

        real("temperature", lambda t: 0 <= t < math.inf, "a finite number ≥ 0")
        real("top_p", lambda p: 0 < p <= 1, "a number in (0, 1]")
        real("repetition_penalty", lambda r: 0 < r < math.inf, "a finite number > 0")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise GenerationError(f"must be an integer, got {value!r}", field=name)
        real("top_k", lambda k: k >= 0, "an integer ≥ 0 (0: all tokens)")
        real("min_p", lambda p: 0 <= p <= 1, "a number in [0, 1]")
        real("presence_penalty", math.isfinite, "a finite number")
        real("frequency_penalty", math.isfinite, "a finite number")
        for pair in self.logit_bias:
            ok = isinstance(pair, tuple) and len(pair) == 2
            token, bias = pair if ok else (None, None)
            ok = ok and isinstance(token, numbers.Integral) and not isinstance(token, bool)
            ok = ok and token >= 0 and isinstance(bias, numbers.Real)
            if not (ok and not isinstance(bias, bool) and -100 <= bias <= 100):
                raise GenerationError(
                    f"must be (token id ≥ 0, bias in [-100, 100]) pairs, got {pair!r}",
                    field="logit_bias",
                )
        # as Python numbers: NumPy's (np.float32, np.int64) pass the checks above, but MLX
        # refuses them in an array and int64 arithmetic overflows in the seeds' mixing
        reals = ("temperature", "top_p", "repetition_penalty", "min_p")
        for name in (*reals, "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("top_k", "seed"):
            object.__setattr__(self, name, int(getattr(self, name)))
        pairs = tuple((int(t), float(b)) for t, b in self.logit_bias)
        object.__setattr__(self, "logit_bias", pairs)

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the logits as they are: greedy with no penalty."""
        return (
            self.temperature == 0
            and self.repetition_penalty == 1
            and self.presence_penalty == 0
            and self.frequency_penalty == 0
        )


def seed_word(seed: int) -> int:
    """A seed as the 64 bits its draws start from: itself from 0 to 2^64 - 1, any other
    integer (a negative one, a larger one) a digest of it, so that no two seeds share their
    draws (modulo 2^64, -1 and 2^64 - 1 were one seed)."""
    if 0 <= seed < 1 << 64:
        return seed
    return int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=8).digest(), "little")


def step_keys(seeds: Sequence[int], steps: Sequence[int]) -> mx.array:
    """The random keys [B, 2] uint32 of token steps[b] of a row with seed seeds[b]: what
    `mx.random.key((seed_word(seed) · φ + step) mod 2^64)` makes, built on the host in one
    array."""
    words = [(seed_word(s) * _GOLDEN + t) % (1 << 64) for s, t in zip(seeds, steps, strict=True)]
    return mx.array(np.array([[w >> 32, w & 0xFFFFFFFF] for w in words], dtype=np.uint32))


def sample_tokens(
    logits: mx.array,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    counts: mx.array | None = None,
    allowed: mx.array | None = None,
    bias: mx.array | None = None,
) -> mx.array:
    """logits [B, V] → the next token of every row, [B] int32, on the device: the batch's
    settings are arrays, so no row reads anything back. `steps[b]` counts the row's tokens so
    far (its random key); counts [B, V] how often each token is in its answer (the penalties
    read it; None when no row has one); allowed [B, V] bool the tokens a row may take
    (`grammar.allowed_tokens`; None: all), the others' logits -inf before anything else; bias
    [B, V] the rows' `logit_bias` (`logit_biases`; None when no row has one), added first.

    Per row: penalties, then greedy, or temperature, top-k, top-p (on the top-k), min-p and a
    draw. Top-k and top-p keep every token at least as likely as the last one kept (ties at the
    edge stay in)."""
    logits = logits.astype(mx.float32)
    if bias is not None:
        logits = logits + bias
    if allowed is not None:
        logits = mx.where(allowed, logits, -mx.inf)
    if all(p.plain_greedy for p in params):
        return mx.argmax(logits, axis=-1).astype(mx.int32)  # the common case: one op

    def column(values, dtype=mx.float32) -> mx.array:
        return mx.array(list(values), dtype=dtype)[:, None]  # [B, 1]

    if counts is not None:
        seen = counts > 0
        rep = column(p.repetition_penalty for p in params)
        scaled = mx.where(logits > 0, logits / rep, logits * rep)
        penalty = column(p.presence_penalty for p in params) + column(
            p.frequency_penalty for p in params
        ) * counts.astype(mx.float32)
        logits = mx.where(seen, scaled - penalty, logits)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all(p.temperature == 0 for p in params):
        return greedy
    drawn = draw(truncated(logits, params), step_keys([p.seed for p in params], steps))
    hot = column((p.temperature > 0 for p in params), mx.bool_)[:, 0]
    return mx.where(hot, drawn, greedy)


def logit_biases(params: Sequence[SamplingParams], vocab: int) -> mx.array | None:
    """[B, vocab] float32: each row's `logit_bias` as a dense row (what `sample_tokens` adds),
    or None when no row has one. ValueError for a token outside the vocabulary."""
    if not any(p.logit_bias for p in params):
        return None
    dense = np.zeros((len(params), vocab), dtype=np.float32)
    for b, p in enumerate(params):
        for token, value in p.logit_bias:
            if token >= vocab:
                raise ValueError(f"logit_bias names token {token}, past the vocabulary ({vocab})")
            dense[b, token] += value
    return mx.array(dense)


def truncated(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """The logits [B, V] (float32, penalties applied) a row with temperature draws from: less
    the row's largest, divided by its temperature, -inf outside its top-k, top-p and min-p
    (what `sample_tokens` draws from; a row at temperature 0 is divided by 1).

    The largest logit is taken off first so it stays 0 however small the temperature: the
    others then fall to -inf at worst, where dividing first overflows to inf (and the softmax
    to NaN) once logit / temperature passes float32's range (temperature ≲ 1e-38)."""

    def column(values, dtype=mx.float32) -> mx.array:
        return mx.array(list(values), dtype=dtype)[:, None]  # [B, 1]

    temperature = column(
        max(p.temperature, MIN_TEMPERATURE) if p.temperature else 1.0 for p in params
    )
    logits = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    V = logits.shape[-1]
    ranked = -mx.sort(-logits, axis=-1)  # [B, V] descending
    top_k = column((p.top_k if 0 < p.top_k < V else V for p in params), mx.int32)
    rank = mx.arange(V)
    in_k = rank < top_k
    probs = mx.softmax(mx.where(in_k, ranked, -mx.inf), axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
    # top_p 1 keeps every token: a float32 running sum reaches 1 before the last ones
    top_p = column(p.top_p if p.top_p < 1 else math.inf for p in params)
    kept = (in_k & (before < top_p)).sum(axis=-1, keepdims=True)
    kept = mx.maximum(
        kept, 1
    )  # a top_p under float32's smallest denormal rounds to 0: keep the top
    edge = mx.take_along_axis(ranked, kept - 1, axis=-1)  # the last token kept, [B, 1]
    floor = column(math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params)
    edge = mx.maximum(edge, ranked[:, :1] + floor)
    return mx.where(logits >= edge, logits, -mx.inf)


def draw(logits: mx.array, keys: mx.array) -> mx.array:
    """One token per row from softmax(logits [B, V]), row b with its key keys[b] → [B] int32."""
    drawn = mx.vmap(lambda row, key: mx.random.categorical(row, key=key))(logits, keys)
    return drawn.astype(mx.int32)


def token_counts(generated: Sequence[Sequence[int]], vocab: int) -> mx.array:
    """[B, vocab] int32: how often each token is in each row's answer."""
    counts = np.zeros((len(generated), vocab), dtype=np.int32)
    for b, tokens in enumerate(generated):
        np.add.at(counts[b], np.asarray(tokens, dtype=np.int64), 1)
    return mx.array(counts)


def penalized(params: Sequence[SamplingParams]) -> bool:
    """Whether any row's sampling reads its answer's token counts."""
    return any(
        p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params
    )


def sample(
    logits: mx.array,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    generated: Sequence[Sequence[int]],
) -> list[int]:
    """`sample_tokens` with the answers so far as token lists, read back: one token per row."""
    counts = token_counts(generated, logits.shape[-1]) if penalized(params) else None
    return sample_tokens(logits, params, steps, counts).tolist()


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, and the `top` most likely tokens' (id, logprob),
    most likely first (`token_logprobs`)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: mx.array, tokens: mx.array, top: int = TOP_LOGPROBS) -> mx.array:
    """logits [B, V] and each row's chosen token [B] → [B, 1 + 2k] float32, on the device: the
    token's log-probability under softmax(logits), then the k = min(top, V) most likely tokens'
    ids (as floats: exact below 2^24) and their log-probabilities, most likely first. One array
    per step, read with the tokens (`read_logprobs`)."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens.astype(mx.int32)[:, None], axis=-1)
    k = min(top, lp.shape[-1])
    if k == 0:
        return chosen
    best = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
    top_lp = mx.take_along_axis(lp, best, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    best = mx.take_along_axis(best, order, axis=-1)
    top_lp = mx.take_along_axis(top_lp, order, axis=-1)
    return mx.concatenate([chosen, best.astype(mx.float32), top_lp], axis=-1)


def read_rows(rows: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Rows of `token_logprobs` read back ([n, 1 + 2k]), for `tokens` (n), each with its `top`
    most likely tokens (at most k)."""
    return [read_logprobs(r, t, top) for r, t in zip(rows.tolist(), tokens, strict=True)]


def narrow_rows(rows: np.ndarray, top: int) -> np.ndarray:
    """Rows of `token_logprobs` ([n, 1 + 2k], read back) with only their `top` ≤ k most likely
    tokens: [n, 1 + 2·top], as `token_logprobs` with `top` gives them."""
    k = (rows.shape[1] - 1) // 2
    if not 0 <= top <= k:
        raise ValueError(f"rows hold {k} alternatives, not {top}")
    return np.concatenate([rows[:, : 1 + top], rows[:, 1 + k : 1 + k + top]], axis=1)


def read_logprobs(row: Sequence[float], token: int, top: int) -> TokenLogprob:
    """A row of `token_logprobs`, read back, for `token`, with its `top` most likely tokens."""
    k = (len(row) - 1) // 2
    ids, lps = row[1 : 1 + k], row[1 + k :]
    alternatives = tuple((int(i), float(v)) for i, v in zip(ids[:top], lps[:top], strict=True))
    return TokenLogprob(int(token), float(row[0]), alternatives)
