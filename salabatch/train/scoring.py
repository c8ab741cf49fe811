"""What training scores: samples padded into a `Batch`, the logits at their answer tokens, the
loss on those, and the held-out evaluation (loss, exact match, token accuracy, by kind)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from salabatch.engine.model import Model
from salabatch.train.data import Encoded


@dataclass(frozen=True)
class Batch:
    """inputs [B, T] (right-padded prompts + targets minus the last token); at [B, A] the
    positions whose next token is a target token, targets [B, A] those tokens, mask [B, A]
    (1 where a row has that many target tokens), turn [B, A] which answer of its row each
    target token belongs to (numpy; -1 on padding)."""

    inputs: mx.array
    at: mx.array
    targets: mx.array
    mask: mx.array
    turn: np.ndarray

    @property
    def tokens(self) -> int:
        return self.inputs.size


def make_batch(encoded: Sequence[Encoded], pad_id: int) -> Batch:
    T = max(len(e.ids) for e in encoded) - 1
    spans = [[p for start, stop in e.targets for p in range(start, stop)] for e in encoded]
    A = max(len(s) for s in spans)
    inputs = np.full((len(encoded), T), pad_id, np.int32)
    at = np.zeros((len(encoded), A), np.int32)
    targets = np.zeros((len(encoded), A), np.int32)
    mask = np.zeros((len(encoded), A), np.float32)
    turn = np.full((len(encoded), A), -1, np.int32)
    for b, (e, positions) in enumerate(zip(encoded, spans, strict=True)):
        n = len(positions)
        inputs[b, : len(e.ids) - 1] = e.ids[:-1]
        at[b, :n] = np.array(positions) - 1
        targets[b, :n] = [e.ids[p] for p in positions]
        mask[b, :n] = 1.0
        turn[b, :n] = [t for t, (start, stop) in enumerate(e.targets) for _ in range(start, stop)]
    return Batch(*(mx.array(x) for x in (inputs, at, targets, mask)), turn)


def answer_logits(model: Model, batch: Batch) -> mx.array:
    """Logits [B, A, vocab] at the target positions (the head runs on those only)."""
    h = model.hidden(batch.inputs)  # [B, T, hidden]
    return model.logits(mx.take_along_axis(h, batch.at[..., None], axis=1))


def loss_fn(model: Model, batch: Batch) -> mx.array:
    """Mean cross-entropy over the target tokens of the batch."""
    ce = nn.losses.cross_entropy(answer_logits(model, batch), batch.targets)  # [B, A]
    return (ce * batch.mask).sum() / batch.mask.sum()


def evaluate(model: Model, batches: Sequence[Batch] | dict[str, Sequence[Batch]]) -> dict:
    """Loss, exact-match share, answer share and target-token accuracy: a row is right when
    every target token is the argmax after the true prefix, i.e. exactly when greedy decoding
    produces the answer and then stops (every answer, for a row with several turns); an answer
    is right when its own tokens are (`eval_answers`: the share of answers, of all turns,
    right: a row of three turns with one wrong scores 0 in exact, 2/3 here). Batches given by kind
    are scored together and, where there are several kinds, each kind on its own too
    (`eval_exact_needle`, …)."""
    sets = batches if isinstance(batches, dict) else {"": batches}
    counts = {kind: _counts(model, kind_batches) for kind, kind_batches in sets.items()}
    record = _scores([sum(c) for c in zip(*counts.values(), strict=True)], "")
    if len(sets) > 1:
        for kind, c in counts.items():
            record |= _scores(c, f"_{kind}")
    return record


def _counts(model: Model, batches: Sequence[Batch]) -> list[float]:
    """Summed loss, batches, rows right, rows, answers right, answers, target tokens right,
    target tokens."""
    loss, right, rows, answers_right, answers, tokens_right, tokens = 0.0, 0, 0, 0, 0, 0, 0
    for batch in batches:
        logits = answer_logits(model, batch)
        ce = nn.losses.cross_entropy(logits, batch.targets)
        correct = (logits.argmax(-1) == batch.targets) * batch.mask  # [B, A]
        hit = (correct + (1 - batch.mask)).min(-1)  # [B]: 1 where every target is right
        mx.eval(ce, correct, hit)
        loss += float((ce * batch.mask).sum() / batch.mask.sum())
        right += int(hit.sum())
        rows += hit.size
        got = np.array(correct)
        for row, turns in zip(got, batch.turn, strict=True):
            for t in np.unique(turns[turns >= 0]):
                answers_right += int(row[turns == t].all())
                answers += 1
        tokens_right += int(correct.sum())
        tokens += int(batch.mask.sum())
    return [loss, len(batches), right, rows, answers_right, answers, tokens_right, tokens]


def _scores(counts: list[float], suffix: str) -> dict:
    loss, n, right, rows, answers_right, answers, tokens_right, tokens = counts
    return {
        f"eval_loss{suffix}": loss / n,
        f"eval_exact{suffix}": right / rows,
        f"eval_answers{suffix}": answers_right / answers,
        f"eval_token_acc{suffix}": tokens_right / tokens,
    }
