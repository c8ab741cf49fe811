"""Speculative decoding: draft a few tokens cheaply, verify them with one pass of the full model.

A verify pass feeds each row its newest token and its drafts, k + 1 positions, and reads the
full model's choice at every one; a row keeps the drafts up to the first that disagrees, plus
the model's own token after them (so a pass always yields at least the token a plain step
would). Everything the rejected tokens wrote is taken back exactly (`ModelCache.rollback`): the
lightning states are replayed over the kept tokens with the decode step's own arithmetic, the
sparse layers' keys, values and compressed chunks are cut, the positions set back. Greedy rows
therefore get the tokens plain greedy decoding gives. Rows with a temperature and certain drafts
(lookup's) draw at every position what plain sampling draws there, with its (seed, step) keys,
and keep a draft while the draw is the draft: the same text as plain sampling, whatever the
batch or the drafts. Rows drafted by `layers` with a temperature, whose drafts are draws from
the draft model's q, accept a draft d with probability min(1, p(d)/q(d)) and, at the first
rejection, draw from the normalised residual max(0, p − q): the distribution of their text is
plain sampling's, its draws not.

Drafters:
* `lookup` — the row's document, prompt and answer so far: where the answer's last two tokens
  occurred before (the longest match backwards among their latest occurrences), what followed
  them there. Free to run; answers copied from a document (names, amounts, clauses) accept
  long runs. Where no row has a draft, plain (pipelined) steps until one has.
* `layers` — the model's first N layers, its final norm and head, on the model's own cache for
  those layers (rolled back after drafting): k small passes per verify.
* `auto` — `lookup`, used only while it pays: each row drafts while its drafts are accepted,
  and the batch runs verify passes while their measured tokens per second beat plain steps',
  otherwise plain (pipelined) steps, probing again after a back-off.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx
import numpy as np

from salabatch.engine.sampling import SamplingParams, draw, step_keys, truncated

DRAFTS = ("off", "lookup", "layers", "auto")
Draft = Literal["off", "lookup", "layers", "auto"]


@dataclass(frozen=True)
class Speculation:
    """How a batch drafts: `off`; `lookup` (what followed the answer's latest tokens in the
    row's document and prompt); `layers` (the model's first `layers` layers and its head);
    `auto` (lookup where its measured acceptance pays, per row). `tokens`: drafts per pass."""

    draft: Draft = "auto"
    tokens: int = 4
    layers: int = 8

    def __post_init__(self) -> None:
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}")
        if self.tokens < 1 or self.layers < 1:
            raise ValueError(f"draft tokens and layers must be ≥ 1: {self}")


OFF = Speculation("off")

# The lookup drafter matches the answer's last MATCH tokens, then extends the match backwards
# over at most LOOKBACK tokens to prefer the occurrence that agrees longest; it weighs the
# CANDIDATES latest occurrences. Without one, at an answer's first token (which has nothing
# of the answer before it to match), it matches that token alone.
MATCH, LOOKBACK, CANDIDATES = 2, 16, 16
VOTES = 1024  # a lone token's places weighed (spread over the document)
WINDOW = 32  # tokens before a place compared with the prompt


class Lookup:
    """Prompt-lookup drafting over a row's context (its document: indexed once per document,
    shared by its rows) followed by its prompt and answer (indexed as they grow). A document's
    index lives from its first row's `prepare` to its last row's `release`: a long-lived batch
    (the server's) sees a new context with every request."""

    def __init__(self) -> None:
        self._contexts: dict[int, ContextIndex] = {}  # by the context tuple's id
        self._rows: dict[int, int] = {}  # rows prepared and not released, by the same id

    def propose(self, row: RowText, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the row's last tokens where they occurred before:
        the latest occurrences of its last MATCH tokens, the one agreeing longest backwards
        first; without any, and only at the answer's first token, that token alone, where the
        document's words around it are most the prompt's (`ContextIndex.nearest`: the first
        token of an answer has nothing before it to match, but the question says where in the
        document it is). Later, an answer whose last MATCH tokens are nowhere before has left
        the document's words: a lone token's place is a guess that rarely holds (13 such
        passes kept 3 drafts on the demo questions), so it drafts nothing."""
        if limit < 1:
            return []
        index = self._context(row.context)
        ctx = index.tokens
        row.extend_index()
        n = len(ctx) + len(row.own)

        def at(i: int) -> int:
            return ctx[i] if i < len(ctx) else row.own[i - len(ctx)]

        fewest = 1 if len(row.own) - row.prompt <= 1 else min(2, MATCH)
        for size in range(min(MATCH, n), fewest - 1, -1):
            key = tuple(at(i) for i in range(n - size, n))
            mine = row.index.get(key, [])
            if size == 1:  # a lone token: where the document speaks of what the prompt asks
                best = index.nearest(key[0], row.asked, VOTES)
                if best < 0:
                    best = _longest_agreeing(mine[-CANDIDATES:][::-1], at, n)
            else:  # the latest of the occurrences agreeing longest backwards
                theirs = index.ends(key, CANDIDATES)
                best = _longest_agreeing(mine[-CANDIDATES:][::-1] + theirs[::-1], at, n)
            if best >= 0:
                out: list[int] = []  # a match reaching the end continues into its own draft
                for i in range(best, best + limit):
                    out.append(at(i) if i < n else out[i - n])
                return out
        return []

    def prepare(self, row: RowText) -> None:
        """Indexes a row's document (once per document) and prompt: when it joins, with its
        prefill, rather than in its first step. `release` it when it leaves."""
        self._context(row.context)
        key = id(row.context)
        self._rows[key] = self._rows.get(key, 0) + 1
        row.extend_index()

    def release(self, context: tuple[int, ...]) -> None:
        """A prepared row of `context` left: the index goes with the last such row."""
        key = id(context)
        self._rows[key] -= 1
        if not self._rows[key]:
            del self._rows[key], self._contexts[key]

    def _context(self, context: tuple[int, ...]) -> ContextIndex:
        """The context's index, made once per context object (it keeps the tuple alive, so
        the id stays its own)."""
        if (hit := self._contexts.get(id(context))) is None:
            hit = self._contexts[id(context)] = ContextIndex(context)
        return hit


class ContextIndex:
    """A document's 1..MATCH-grams → the positions after them, as sorted arrays (built with
    one sort per size, 16 bytes a position and size; a 1M-token document in well under a
    second), searched by bisection."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        ids = np.asarray(tokens, dtype=np.int64)
        self.base = int(ids.max()) + 1 if len(ids) else 1  # base**MATCH fits in int64
        self._ids = ids
        self._weight = np.log((len(ids) + 1) / (np.bincount(ids) + 1)) if len(ids) else ids
        self._levels = []  # per size: (the n-grams as numbers, sorted; the positions after)
        for size in range(1, MATCH + 1):
            count = max(len(ids) - size + 1, 0)
            keys = ids[:count].copy()
            for j in range(1, size):
                keys = keys * self.base + ids[j : j + count]
            order = np.argsort(keys, kind="stable")  # equal keys stay in position order
            self._levels.append((keys[order], order + size))

    def ends(self, gram: tuple[int, ...], latest: int) -> list[int]:
        """The positions after the `latest` last occurrences of `gram`, in position order."""
        if any(t >= self.base for t in gram):
            return []
        key = 0
        for t in gram:
            key = key * self.base + t
        keys, ends = self._levels[len(gram) - 1]
        lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
        return ends[max(lo, hi - latest) : hi].tolist()

    def nearest(self, token: int, asked: np.ndarray, most: int) -> int:
        """Of the places after `token` in the document (at most `most`, spread over it), the
        one whose WINDOW tokens before share most with `asked` (the prompt's tokens), each
        shared token weighted by its rarity in the document (log of the document's length over
        its count); -1 if the token never occurs, or if no place stands out: the best must
        share more than every other by at least a token found once in the document. (Between
        places alike, the guess failed as often as not: on the demo and free-form questions
        this rule dropped 7 lone-token drafts, all failed, and none that was accepted; the
        gain, ~2 % by a replay of the drafts, is under the 2-core CPU's noise.)"""
        if token >= self.base or not len(asked):
            return -1
        keys, ends = self._levels[0]
        lo, hi = np.searchsorted(keys, token, "left"), np.searchsorted(keys, token, "right")
        places = ends[lo:hi]
        places = places[places < len(self._ids)]  # a continuation to copy
        if not len(places):
            return -1
        if len(places) > most:
            places = places[np.linspace(0, len(places) - 1, most).astype(np.int64)]
        window = places[:, None] - 1 - np.arange(1, WINDOW + 1)  # [places, WINDOW]
        seen = self._ids[np.maximum(window, 0)]
        wanted = np.zeros(self.base, dtype=bool)  # the prompt's tokens, as a table to look up
        wanted[asked[asked < self.base]] = True
        shared = wanted[seen] & (window >= 0)
        score = (shared * self._weight[seen]).sum(axis=1)
        if len(score) > 1:
            runner_up, best = np.partition(score, -2)[-2:]
            if best - runner_up < np.log((len(self._ids) + 1) / 2):  # a once-seen token's weight
                return -1
        return int(places[int(np.argmax(score))])


def _longest_agreeing(ends: list[int], at, n: int) -> int:
    """Of the places `ends` (positions after an occurrence of the text's last tokens, latest
    first), the first of those agreeing longest with the text before them; -1 if none."""
    best, best_len = -1, -1
    for end in ends:
        if end >= n:
            continue
        length = 0
        while length < LOOKBACK and end > length and at(end - length - 1) == at(n - length - 1):
            length += 1
        if length > best_len:
            best, best_len = end, length
    return best


@dataclass
class RowText:
    """A row's text as the lookup drafter reads it: its context, then `own` (its prompt and the
    answer so far), with `own`'s 1..MATCH-grams indexed by the position after them."""

    context: tuple[int, ...]
    own: list[int]
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    asked: np.ndarray = field(init=False)  # the prompt's distinct tokens
    prompt: int = field(init=False)  # how many of `own` are the prompt (the rest: the answer)

    def __post_init__(self) -> None:
        self.asked = np.unique(np.asarray(self.own, dtype=np.int64))
        self.prompt = len(self.own)

    _indexed: int = 0  # own positions whose preceding n-grams are indexed

    def extend_index(self) -> None:
        offset = len(self.context)
        for end in range(max(self._indexed, 1), len(self.own) + 1):
            for size in range(1, min(MATCH, end) + 1):
                self.index.setdefault(tuple(self.own[end - size : end]), []).append(offset + end)
        self._indexed = len(self.own) + 1


class Layers:
    """Drafting with the model's first `n` layers, its final norm and head, over the model's
    cache for those layers (the other layers' caches are not touched; all are rolled back)."""

    def __init__(self, model, n: int) -> None:
        layers = len(model.layers)
        self.model, self.n = model, max(1, min(n, layers - 1))

    def propose(self, cache, last: mx.array, params: Sequence[SamplingParams], steps, limit: int):
        """`limit` drafts per row from its newest tokens last [B] → (drafts [B, limit] int32,
        the draft distributions [B, limit, V] of rows with a temperature, else None)."""
        point = cache.checkpoint(record=False)
        hot = any(p.temperature > 0 for p in params)
        tokens, dists = [], []
        feed = last
        for i in range(limit):
            logits = self._logits(feed[:, None], cache).astype(mx.float32)  # [B, V]
            if hot:
                t = truncated(logits, params)
                keys = step_keys([p.seed ^ _DRAFT_SEED for p in params], [s + i for s in steps])
                drawn = draw(t, keys)
                greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
                hot_rows = mx.array([p.temperature > 0 for p in params])
                feed = mx.where(hot_rows, drawn, greedy)
                dists.append(mx.softmax(t, axis=-1))
            else:
                feed = mx.argmax(logits, axis=-1).astype(mx.int32)
            tokens.append(feed)
        drafts = mx.stack(tokens, axis=1)
        q = mx.stack(dists, axis=1) if hot else None
        mx.eval(drafts, *([] if q is None else [q]))
        cache.rollback(point, [0] * len(params))
        return drafts, q

    def _logits(self, ids: mx.array, cache) -> mx.array:
        model = self.model
        offset = cache.advance(*ids.shape)
        h = model.model.embed_tokens(ids) * model.model.scale_emb
        for layer, layer_cache in zip(model.layers[: self.n], cache, strict=False):
            h = layer(h, layer_cache, offset)
        return model.logits(model.model.norm(h))[:, -1]


_DRAFT_SEED = 0x5DEECE66D  # a row's draws for drafting, acceptance and residuals: streams of
_ACCEPT_SEED = 0x2545F491  # its own, apart from its plain sampling's (seed, step)
_RESIDUAL_SEED = 0x9E3779B9


@dataclass
class Verdict:
    """A verify pass's outcome for one row: how many drafts it keeps, and the token after them
    (the model's own), which is drawn and not yet read."""

    accepted: int
    next_token: int


def verify(
    logits: mx.array,
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    first: mx.array | None,
    q: mx.array | None = None,
) -> list[Verdict]:
    """The rows' verdicts from the full model's logits [B, T, V] over (newest token, drafts):
    `first` [B] is the token plain sampling draws from position 0 (penalties included; a row
    without drafts takes it), None where that is the argmax (every row plainly greedy);
    `steps[b]` the row's tokens drawn so far; q [B, T - 1, V] the draft distributions of a
    `layers` drafter for rows with a temperature (None: the drafts are certain, as lookup's,
    q(d) = 1)."""
    B, T, _ = logits.shape
    greedy = mx.argmax(logits, axis=-1)  # [B, T]
    hot = [b for b in range(B) if drafts[b] and params[b].temperature > 0]
    arrays = [greedy] if first is None else [greedy, first]
    if hot:
        accept, residual, plain = _rejection(logits, drafts, params, steps, hot, q)
        arrays += [accept, residual, plain]
    mx.eval(*arrays)
    greedy_l = greedy.tolist()
    first_l = [y[0] for y in greedy_l] if first is None else first.tolist()
    if hot:
        accept_l, residual_l, plain_l = accept.tolist(), residual.tolist(), plain.tolist()
    out = []
    for b in range(B):
        d = list(drafts[b])
        if not d:
            out.append(Verdict(0, first_l[b]))
        elif b in hot:
            h = hot.index(b)
            n = 0
            while n < len(d) and accept_l[h][n]:
                n += 1
            out.append(Verdict(n, plain_l[h][n] if n == len(d) else residual_l[h][n]))
        else:
            y = greedy_l[b]
            n = 0
            while n < len(d) and d[n] == y[n]:
                n += 1
            out.append(Verdict(n, y[n]))
    return out


def _rejection(logits, drafts, params, steps, hot: list[int], q):
    """For the rows `hot` (with drafts and a temperature), at every position i: whether draft
    i + 1 is accepted, the token taken where it is not, and a plain draw from p (the bonus token
    after all drafts) → three [len(hot), T] arrays. Certain drafts (q None): accepted while
    plain sampling's own draw is the draft, that draw taken where it is not — for a draft of
    q(d) = 1 the rule below accepts with p(d) and then draws from p without d, so this is the
    same distribution, and moreover plain sampling's text. Else u < p(d)/q(d), and a draw from
    the residual max(0, p − q) normalised."""
    B, T, V = logits.shape
    shape = (len(hot), T)
    rows = mx.array(hot)
    p_params = [params[b] for b in hot for _ in range(T)]
    flat = truncated(logits[rows].reshape(-1, V).astype(mx.float32), p_params)  # [H·T, V]
    padded = [list(drafts[b]) + [0] * (T - len(drafts[b])) for b in hot]
    d = mx.array(padded, dtype=mx.int32).reshape(-1, 1)  # [H·T, 1] draft i + 1 at position i
    seeds = [params[b].seed for b in hot for _ in range(T)]
    at = [steps[b] + i for b in hot for i in range(T)]
    plain = draw(flat, step_keys(seeds, at))  # [H·T]: what plain sampling draws there
    if q is None:
        plain = plain.reshape(shape)
        return plain == d.reshape(shape), plain, plain
    p = mx.softmax(flat, axis=-1)
    p_d = mx.take_along_axis(p, d, axis=-1)[:, 0]
    qh = mx.pad(q[rows][:, : T - 1], [(0, 0), (0, 1), (0, 0)])  # [H, T, V]: none after the last
    q_full = qh.reshape(-1, V)
    q_d = mx.take_along_axis(q_full, d, axis=-1)[:, 0]
    u = mx.vmap(lambda key: mx.random.uniform(key=key))(
        step_keys([s ^ _ACCEPT_SEED for s in seeds], at)
    )
    accept = u < p_d / mx.maximum(q_d, 1e-30)
    left = mx.maximum(p - q_full, 0.0)
    residual = draw(mx.log(left), step_keys([s ^ _RESIDUAL_SEED for s in seeds], at))
    return accept.reshape(shape), residual.reshape(shape), plain.reshape(shape)


class Policy:
    """When a batch speculates, and how far: fixed for `lookup` and `layers` (every step a pass
    of `tokens` drafts), adaptive for `auto`, which must never cost much where drafting does
    not pay.

    `auto` keeps its own draft length, 0 (plain, pipelined steps) to `tokens`. It starts plain
    (measuring a plain step's time at this row count), then probes with `tokens` drafts per
    row. After each pass it compares the tokens per second of its passes (a moving average)
    with plain steps': ahead by GROW, one draft more; behind (or its passes accept next to
    nothing, FUTILE, which never pays whatever a noisy clock says), one less, and at 0 plain
    steps for a back-off that doubles each time (BACKOFF up to MAX_BACKOFF) before the next
    probe; a probe that is behind backs off at once. Every REMEASURE passes it runs WARMUP
    plain steps again, so the comparison is with plain steps of now (not of a cold start).
    A probe drafts the full length because a pass costs little more for more drafts (on a GPU
    it reads the weights once whatever its length; on the 2-core CPU at batch 1, 5 positions
    cost ~1.25× 2) while the answers worth drafting for, copied from the document, are short:
    a probe at one draft growing by one a pass spends most of such an answer growing; and a
    failed probe backs off at once, so where nothing pays it costs one pass a back-off. (On
    the demo questions at batch 1 on the 2-core CPU the two probes were within the machine's
    noise: 1.28× and 1.29× plain decoding in one 12-round A/B.) A probe that finds nothing to
    draft (`undrafted`) backs off the same way, until a row joins or the drafter finds a draft
    after a token a plain step read (`draftable`). Per row: a row drafts while
    the share of its drafts accepted (a moving average) stays at least ROW_FLOOR, and on every
    PROBE-th pass otherwise."""

    ROW_FLOOR, PROBE, GROW, BACKOFF, MAX_BACKOFF, WARMUP, REMEASURE = 0.3, 8, 1.05, 8, 256, 3, 24
    FUTILE = 0.1  # drafts accepted per row and pass (moving average) under which passes stop

    def __init__(self, speculation: Speculation) -> None:
        self.adaptive = speculation.draft == "auto"
        self.most = speculation.tokens
        self.tokens = 0 if self.adaptive else self.most  # drafts per row in the next pass
        self._plain: dict[int, float] = {}  # rows → seconds per plain step (moving average)
        self._rate: float | None = None  # tokens per second of the passes at this length
        self._gained = 0.0  # drafts accepted per row and pass (moving average)
        self._wait, self._resume = self.WARMUP, self.most  # plain steps, then passes of `_resume`
        self._probing = True  # the passes after the wait are a probe (not a remeasure's)
        self._backoff = self.BACKOFF
        self._passes = 0
        self._last_plain: float | None = None
        self._idle = False  # resting after a step that found nothing to draft (`undrafted`)
        self._lookup = speculation.draft == "lookup"
        self._probe = False  # the pass running is a probe

    def speculate(self) -> bool:
        """Whether this step is a verify pass (else a plain step)."""
        if self.tokens:
            return True
        if self._wait > 0:
            self._wait -= 1
            return False
        self.tokens, self._rate, self._idle = self._resume, None, False
        self._probe, self._probing = self._probing, False
        return True

    def plain_step(self, rows: int, now: float) -> None:
        """A plain (pipelined) step over `rows` rows ended at `now` (perf_counter): its time is
        the interval since the last one's end (the first after other work is not timed)."""
        if self._last_plain is not None:
            _average(self._plain, rows, now - self._last_plain)
        self._last_plain = now

    def undrafted(self) -> None:
        """A step that read first but found no draft in any row ran as a plain step, not
        pipelined. `lookup` then runs plain (pipelined) steps until the drafter finds a draft
        after a token they read (`awaits_draft`, `draftable`) or a row joins: a step that reads
        before it drafts leaves the device idle while the host drafts and builds, so each step
        without a draft cost ~1.2 pipelined ones on the 2-core CPU at batch 1. `auto` backs off
        (plain steps, twice as many each time) until then. Before, answers that never repeat
        their document (the bench's random one) ran every step unpipelined: 0.91× plain
        decoding at batch 8."""
        self._last_plain = None
        if self.adaptive:
            self._idle = True
            self._back_off()
        elif self._lookup:  # plain steps until `draftable`
            self._idle = True
            self._pause(sys.maxsize, self.most)

    @property
    def awaits_draft(self) -> bool:
        """Plain steps run because no row had a draft: the batch asks its drafter after each."""
        return self._idle

    def draftable(self) -> None:
        """A row has a draft after its newest token: drafting resumes at the next step."""
        if self._idle:
            self._wait, self._idle = 0, False

    def joined(self) -> None:
        """Rows joined the batch: where it rests because no row had anything to draft, it asks
        again at the next step (a new answer's first token may find its place)."""
        self.draftable()

    def verify_pass(self, rows: int, tokens: int, seconds: float) -> None:
        """A verify pass over `rows` rows gave `tokens` tokens in `seconds`."""
        self._last_plain = None
        if not self.adaptive:
            return
        rate, gained = tokens / max(seconds, 1e-9), (tokens - rows) / rows
        if self._rate is None:
            self._rate, self._gained = rate, gained
        else:
            self._rate = 0.5 * self._rate + 0.5 * rate
            self._gained = 0.5 * self._gained + 0.5 * gained
        self._passes += 1
        probe, self._probe = self._probe, False
        plain = self._plain_seconds(rows)
        if plain is None or self._passes % self.REMEASURE == 0:  # plain steps of now first
            self._pause(self.WARMUP, self.tokens)
        elif self._gained >= self.FUTILE and self._rate * plain >= self.GROW * rows:
            self.tokens = min(self.tokens + 1, self.most)  # (a plain step: `rows` tokens)
            self._backoff = self.BACKOFF
        elif self._gained < self.FUTILE or self._rate * plain < rows:
            self._rate = None
            if self.tokens > 1 and not probe:
                self.tokens -= 1
            else:
                self._back_off()

    def _back_off(self) -> None:
        """Plain steps for the back-off, doubled for the next time, then a probe."""
        self._pause(self._backoff, self.most)
        self._probing = True
        self._backoff = min(2 * self._backoff, self.MAX_BACKOFF)

    def _pause(self, steps: int, then: int) -> None:
        """Plain steps for `steps` steps (one more: the first is not timed), then passes of
        `then` drafts."""
        self.tokens, self._wait, self._resume = 0, steps + 1, then

    def _plain_seconds(self, rows: int) -> float | None:
        """A plain step's time at this row count, or at the nearest one measured."""
        if not self._plain:
            return None
        return self._plain[min(self._plain, key=lambda r: (abs(r - rows), r))]

    def drafts_for(self, stats: RowStats) -> bool:
        """Whether a row drafts in this pass."""
        if not self.adaptive or stats.rate >= self.ROW_FLOOR:
            return True
        stats.skipped += 1
        return stats.skipped % self.PROBE == 0


@dataclass
class RowStats:
    rate: float = 1.0  # moving average of the share of its drafts accepted
    skipped: int = 0

    def passed(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.rate = 0.6 * self.rate + 0.4 * accepted / drafted


def _average(table: dict[int, float], key: int, value: float) -> None:
    """A moving average per key; a sample over twice the average (a stall of the machine)
    counts as twice the average."""
    old = table.get(key)
    table[key] = value if old is None else 0.7 * old + 0.3 * min(value, 2 * old)
