"""Answers chosen among given choices by their likelihood (a job question's `choices:`).

Each choice is scored as the whole answer: its tokens, then the answer's end token, after the
row's prompt; the sum of their log-probabilities is the choice's (what lm-eval-harness's
multiple choice computes). So every choice comes with a probability (the softmax of those sums
over the choices), and the answer is the most likely one, or, sampling, one drawn by them,
with no decoding: each question's prompt is run once, then its choices' tokens after it
(`choice_scores`). A choice is scored as the tokenizer spells it in context (`choice_ids`); one
it cannot spell on its own is left to constrained decoding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from salabatch.engine import memory
from salabatch.engine.cache import ModelCache
from salabatch.engine.generate import Prefill, prefill, prefill_forks
from salabatch.engine.grammar import answer_end
from salabatch.engine.model import Model
from salabatch.engine.sampling import TokenLogprob, read_logprobs, seed_word, token_logprobs
from salabatch.errors import GenerationError


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


def spelled_choices(tok, choices: Sequence[str]) -> list[list[int]]:
    """Each choice as a whole answer's tokens: its `choice_ids`, then the answer's end token
    (`grammar.answer_end`, where a constrained answer ends too). GenerationError naming the
    first choice the vocabulary cannot spell on its own."""
    end, out = answer_end(tok), []
    for choice in choices:
        ids = choice_ids(tok, choice)
        if ids is None:
            raise GenerationError(
                f"the vocabulary cannot spell {choice!r} on its own", field="choices"
            )
        out.append([*ids, end])
    return out


def choice_scores(
    model: Model,
    base: ModelCache,
    asks: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
    top: int = 0,
    rows: int = 8,
    chunk: int | None = None,
) -> list[list[list[TokenLogprob]]]:
    """The choices of questions over one prompt start, scored: `base` a one-row cache of it (a
    document prefix; it stays as it is); `asks` each question's (head: its tokens after
    `base`, at least one; choices: each one's tokens, its end token included). → per question,
    per choice, each of its tokens' log-probability with its `top` most likely alternatives.

    Each head is prefilled once, `rows` heads to a padded call on forks of `base`
    (`prefill_forks`): its last logits give its choices' first tokens; each choice's other
    tokens then run on a copy of its head's row, `rows` choices to a padded call. A call's
    rows are each on its own side of dense_len, padding included, and it feeds at most `chunk`
    tokens, padding included (a prefill chunk: what a memory plan counts a call to take): a
    longer head or choice goes alone, chunk by chunk (`_calls`, `_prefilled`, `_tails`)."""
    if not all(head and all(cs) for head, cs in asks):
        raise ValueError("choice_scores needs a head and non-empty choices for each question")
    out: list[list] = [[None] * len(cs) for _, cs in asks]
    dense_len = model.config.sparse.dense_len
    for group in _calls([(base.offset, len(head)) for head, _ in asks], rows, dense_len, chunk):
        heads = _prefilled(model, base, [asks[a][0] for a in group], chunk)
        tails = []  # (question, choice, its head's row) of the choices longer than one token
        for a, (row, logits) in zip(group, heads, strict=True):
            cs = asks[a][1]
            firsts = mx.array([c[0] for c in cs], dtype=mx.int32)
            scored = np.asarray(token_logprobs(mx.stack([logits] * len(cs)), firsts, top))
            for j, c in enumerate(cs):
                out[a][j] = [read_logprobs(scored[j].tolist(), c[0], top)]
                if len(c) > 1:
                    tails.append((a, j, row))
        # a tail runs from its head's end for its choice's tokens but the last
        spans = [(base.offset + len(asks[a][0]), len(asks[a][1][j]) - 1) for a, j, _ in tails]
        for part in _calls(spans, rows, dense_len, chunk):
            cache = ModelCache.concat([tails[t][2].select([0]) for t in part])  # a copy each
            feed = [asks[tails[t][0]][1][tails[t][1]] for t in part]
            scored = _tails(model, cache, feed, top, chunk)
            for t, c, got in zip(part, feed, scored, strict=True):
                a, j, _ = tails[t]
                rest = zip(got.tolist(), c[1:], strict=True)
                out[a][j] += [read_logprobs(x, tok, top) for x, tok in rest]
    return out


def _tails(
    model: Model, cache: ModelCache, feed: list[Sequence[int]], top: int, chunk: int | None
) -> list[np.ndarray]:
    """Choices after their heads, one on each row of `cache`, run for their tokens but the
    last → per choice, the rows of `token_logprobs` of its tokens after the first. One call
    right-padded to the longest, the head run over `memory.score_rows` positions at a time (a
    choice's whole length at once took its length × vocab floats five times over); a lone
    choice longer than `chunk` fed chunk by chunk, planned to its end (`_prefilled`'s rule)."""
    if chunk is not None and len(feed) == 1 and len(feed[0]) - 1 > chunk:
        c = feed[0]
        run = Prefill(model, c[:-1], cache, chunk, score=top, planned=cache.offset + len(c) - 1)
        while not run.finished:
            run.step()
        last = token_logprobs(run.logits()[None], mx.array(c[-1:], dtype=mx.int32), top)
        return [np.concatenate([run.score_rows(), np.asarray(last)])]
    T = max(len(c) - 1 for c in feed)
    ids = mx.array([c[:-1] + [c[-2]] * (T - len(c) + 1) for c in feed], dtype=mx.int32)
    h = model.hidden(ids, cache)  # [n, T, hidden]: position i gives token i + 1
    step, out = memory.score_rows(model.config), []
    for b, c in enumerate(feed):
        n = len(c) - 1
        targets = mx.array(c[1:], dtype=mx.int32)
        parts = [
            token_logprobs(model.logits(h[b, i : min(i + step, n)]), targets[i : i + step], top)
            for i in range(0, n, step)
        ]
        out.append(np.concatenate([np.asarray(x) for x in parts]))
    return out


def _prefilled(
    model: Model, base: ModelCache, heads: list[Sequence[int]], chunk: int | None
) -> list[tuple[ModelCache, mx.array]]:
    """`prefill_forks` of `heads`; a lone head longer than `chunk` prefilled chunk by chunk on
    a fork of `base` instead, planned to its end, so that its chunks decide dense or sparse as
    its one call would (SPEC P7)."""
    if chunk is None or len(heads) > 1 or len(heads[0]) <= chunk:
        return prefill_forks(model, base, heads)
    row = base.fork(1)
    logits = prefill(model, heads[0], row, chunk, planned=base.offset + len(heads[0]))
    return [(row, logits)]


def _calls(
    spans: Sequence[tuple[int, int]], rows: int, dense_len: int, cap: int | None = None
) -> list[list[int]]:
    """The rows of `spans` in padded calls of at most `rows`, in order. Row i runs from
    `spans[i]` = (start, length), padded to its call's longest: a call feeds its rows times
    that, at most `cap` tokens (None: no bound) unless it is one row. The model decides a
    row's mode from its padded end (SPEC P7), so a row that ends below dense_len shares a call
    only with rows that end below it, and only where the padding takes none of them to it; the
    others go together."""
    calls: dict[bool, list[list[int]]] = {True: [], False: []}  # by: the row ends below it
    for i, (start, n) in enumerate(spans):
        dense = start + n < dense_len
        same = calls[dense]
        call = [*same[-1], i] if same else [i]
        T = max(spans[j][1] for j in call)
        crosses = dense and max(spans[j][0] for j in call) + T >= dense_len
        if len(call) > rows or crosses or (cap is not None and len(call) * T > cap):
            call = [i]
        if len(call) == 1:
            same.append(call)
        else:
            same[-1] = call
    return calls[True] + calls[False]


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
    return int(np.random.default_rng(seed_word(seed)).choice(len(weights), p=weights))
