"""Answers chosen among given choices by their likelihood (a job question's `choices:`).

Each choice is scored as the whole answer: its tokens, then the answer's end token, after the
row's prompt; the sum of their log-probabilities is the choice's (what lm-eval-harness's
multiple choice computes). So every choice comes with a probability (the softmax of those sums
over the choices), and the answer is the most likely one, or, sampling, one drawn by them: one
forward pass over the choices, no decoding. A choice is scored as the tokenizer spells it in
context (`choice_ids`); one it cannot spell on its own is left to constrained decoding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from salabatch.engine.cache import ModelCache
from salabatch.engine.model import Model
from salabatch.engine.sampling import TokenLogprob, read_logprobs, token_logprobs


def choice_ids(tok, choice: str) -> list[int] | None:
    """The tokens of `choice` as an answer's text (after the prompt's line breaks), whose bytes
    are exactly the choice's: the choice encoded on its own, or after "\\n\\n" less that
    prefix's tokens (a SentencePiece tokenizer prepends a space to a text's first word, never
    mid-text); None where neither spells it."""
    want = choice.encode()
    lead = tok.encode("\n\n", special=False)
    whole = tok.encode("\n\n" + choice, special=False)
    candidates = [tok.encode(choice, special=False)]
    if whole[: len(lead)] == lead:
        candidates.append(whole[len(lead) :])
    for ids in candidates:
        if ids and b"".join(tok.token_bytes(t) for t in ids) == want:
            return ids
    return None


def choice_scores(
    model: Model,
    base: ModelCache,
    head: Sequence[int],
    choices: Sequence[Sequence[int]],
    top: int = 0,
) -> list[list[TokenLogprob]]:
    """Each choice's tokens scored after the prompt: `base` a one-row cache of its start (a
    document prefix; it stays as it is), `head` its tokens after that (at least one), `choices`
    each choice's tokens, its end token included. → per choice, each of its tokens' log-
    probability with its `top` most likely alternatives. One call over len(choices) forks of
    `base`, each row head + its choice, right-padded (padding only follows a row's tokens)."""
    if not head or not all(choices):
        raise ValueError("choice_scores needs a head and non-empty choices")
    rows = [[*head, *c] for c in choices]
    n, T = len(rows), max(len(r) for r in rows)
    ids = mx.array([r + [r[-1]] * (T - len(r)) for r in rows], dtype=mx.int32)  # [n, T]
    h = model.hidden(ids, base.fork(n))  # [n, T, hidden]
    first = len(head) - 1  # the position whose logits give a choice's first token
    out = []
    for b, c in enumerate(choices):
        logits = model.logits(h[b, first : first + len(c)])  # [len(c), vocab]
        scored = token_logprobs(logits, mx.array(list(c), dtype=mx.int32), top)
        out.append(
            [read_logprobs(r, t, top) for r, t in zip(np.asarray(scored).tolist(), c, strict=True)]
        )
    return out


def probabilities(logprobs: Sequence[float]) -> list[float]:
    """The choices' probabilities among themselves: softmax of their log-probabilities."""
    most = max(logprobs)
    weights = [math.exp(v - most) for v in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def pick(logprobs: Sequence[float], temperature: float, seed: int) -> int:
    """The chosen choice's index: the most likely (the first of equals) at temperature 0, else
    one drawn with `seed` from the softmax of logprobs / temperature."""
    if temperature <= 0:
        return max(range(len(logprobs)), key=lambda i: (logprobs[i], -i))
    weights = probabilities([v / temperature for v in logprobs])
    return int(np.random.default_rng(seed).choice(len(weights), p=weights))
