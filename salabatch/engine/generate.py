"""Generation: chunked prefill, and batched decoding of many requests with a shared prefix.

A `Generator` keeps up to `batch_size` rows decoding together. Each request is prefilled on its
own (its lightning states depend on exactly its tokens), then joins the running batch; a finished
row leaves at once and a waiting request takes its place. With a `prefix` (a prefilled document)
every row continues a fork of it, so the document's sparse-layer keys are stored once.

The loop is made of two steppable parts that the server (`salabatch.serve.engine`) drives itself,
between whose steps jobs arrive and leave: `Prefill` (a prompt, one chunk per step; with
`score`, each of its tokens' log-probability too) and `Batch` (rows decoding together, one token
per step; rows join, stop or are cancelled between steps). `prefill_forks` prefills short
prompts on forks of one prefix in one padded call (the server's questions of a held document,
`engine.choose`'s).
With `speculation` (salabatch.engine.speculative), a step may instead be a verify pass over
drafted tokens, from which each row reads its accepted drafts and the model's next token.

A row ends at a stop token, at `max_tokens`, or, given a detokenizer, as soon as its decoded
text contains one of its stop strings (the text is then cut before it). A request with
`logprobs` gets each token's log-probability and its most likely alternatives
(`Generation.logprobs`); one with a `grammar` draws every token among those its grammar allows
(`salabatch.engine.grammar`), and its batch's steps read the rows' newest tokens before they
draw the next (the mask needs them); one whose params have a `logit_bias` draws from its
biased logits. In each case its batch takes plain steps, no drafts, while it runs.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from salabatch.engine import memory
from salabatch.engine.cache import ModelCache
from salabatch.engine.config import ModelConfig
from salabatch.engine.decode import decode
from salabatch.engine.grammar import Grammar, allowed_tokens
from salabatch.engine.kernels.attention import on_gpu
from salabatch.engine.model import Model
from salabatch.engine.sampling import (
    TOP_LOGPROBS,
    SamplingParams,
    TokenLogprob,
    logit_biases,
    penalized,
    read_logprobs,
    read_rows,
    sample_tokens,
    token_logprobs,
)
from salabatch.engine.speculative import (
    OFF,
    Layers,
    Lookup,
    Policy,
    RowStats,
    RowText,
    Speculation,
    verify,
)
from salabatch.errors import GenerationError

if TYPE_CHECKING:
    from outlines_core import Guide

    from salabatch.engine.detokenizer import StreamingDetokenizer


def answer_room(
    config: ModelConfig, prompt_tokens: int, max_tokens: int, *, field: str = "prompt"
) -> int:
    """The tokens a row may generate after a prompt of `prompt_tokens`: `max_tokens`, cut where
    the model's context (`ModelConfig.context_length`) ends. GenerationError naming `field` if the
    prompt leaves no room for one token. The rule every surface applies (API, CLI, server)."""
    context = config.context_length
    if prompt_tokens >= context:
        raise GenerationError(
            f"the prompt has {prompt_tokens} tokens, the model's context holds {context} "
            "(with room for one generated token)",
            field=field,
        )
    return min(max_tokens, context - prompt_tokens)


def prefill(
    model: Model,
    ids: Sequence[int],
    cache: ModelCache,
    chunk: int = 2048,
    progress: Callable[[int, int], None] | None = None,
    planned: int | None = None,
) -> mx.array:
    """Feeds `ids` into a one-row cache in chunks; returns the last position's logits [vocab].

    On a fresh cache the whole length is planned first, so every chunk runs the sparse layers
    as one call over all of `ids` would (`planned`: over a prompt of that many tokens that
    `ids` begin, see `Prefill`). `progress(done, total)` is called after each chunk.
    """
    feed = Prefill(model, ids, cache, chunk, planned=planned)
    while not feed.finished:
        done = feed.step()
        if progress:
            progress(done, len(ids))
    return feed.logits()


class Prefill:
    """`prefill` one chunk per `step()`, for a caller that does other work between chunks (the
    server decodes its running rows while a long prompt is fed). The same calls as `prefill`.

    `score`: None, or each fed token after the first is scored as the chunks go: its
    log-probability given the tokens before it, with its `score` most likely alternatives
    (`scores()`: a prompt's logprobs, or a document's perplexity). The head runs over
    `memory.SCORE_ELEMENTS` logits at a time, and only the rows read back stay. `before`: the
    logits [vocab] of the position before the first id (a prompt resumed from a held prefix:
    the prefix's last), so the first id is scored too. `planned`: the whole prompt's length
    where `ids` is only a piece of it (prefilled in pieces, snapshots between, or resumed from
    a held prefix): the cache is planned for it, so that the sparse layers decide as one call
    over the whole prompt would (`ModelCache.plan_prefill`)."""

    def __init__(
        self,
        model: Model,
        ids: Sequence[int],
        cache: ModelCache,
        chunk: int = 2048,
        score: int | None = None,
        before: mx.array | None = None,
        planned: int | None = None,
    ):
        if not ids:
            raise ValueError("prefill needs at least one token")
        if score is not None and not 0 <= score <= TOP_LOGPROBS:
            raise ValueError(f"score must be in [0, {TOP_LOGPROBS}], got {score}")
        if before is not None and score is None:
            raise ValueError("before= scores the first id: it needs score=")
        if cache.positions is None:
            cache.plan_prefill(max(planned or 0, len(ids)))
        elif planned is not None:  # the rest of a prompt, resumed from a prefix of it
            cache.plan_prefill(planned)
        self.model, self.cache, self.chunk, self.score = model, cache, chunk, score
        self.tokens = mx.array(list(ids), dtype=mx.int32)[None]  # [1, T]
        self.total, self.done = len(ids), 0
        self._last: mx.array | None = None  # [1, 1, hidden] the last position fed
        self._scored: list[mx.array] = []  # [n, 1 + 2k] rows of `token_logprobs`, in order
        if before is not None:
            self._scored.append(token_logprobs(before[None], self.tokens[0, :1], score))

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    def step(self) -> int:
        """Feeds the next chunk; → the tokens fed so far."""
        start = self.done
        # On a GPU each layer is queued as soon as it is built: the device runs it while the host
        # builds the next (a chunk's graph takes it ~20-40 ms, ~4 % of the chunk otherwise).
        ids = self.tokens[:, start : start + self.chunk]
        h = self.model.hidden(ids, self.cache, queue=on_gpu())
        self._last = h[:, -1:]
        scored = [] if self.score is None else self._scores_of(h[0], start)
        # bounds the graph and memory to one chunk
        mx.eval(self._last, *scored, *self.cache.arrays())
        self._scored += scored
        self.done = min(start + self.chunk, self.total)
        return self.done

    def _scores_of(self, h: mx.array, start: int) -> list[mx.array]:
        """The chunk's positions from `start` ([n, hidden]) scored against the tokens after
        them (the prompt's last position has none), `memory.SCORE_ELEMENTS` logits at a time."""
        targets = self.tokens[0, start + 1 : start + 1 + h.shape[0]]
        h = h[: targets.shape[0]]
        rows = memory.score_rows(self.model.config)
        return [
            token_logprobs(self.model.logits(h[a : a + rows]), targets[a : a + rows], self.score)
            for a in range(0, targets.shape[0], rows)
        ]

    def logits(self) -> mx.array:
        """The last position's logits [vocab], once finished."""
        if not self.finished:
            raise ValueError(f"prefill at {self.done} of {self.total} tokens")
        return self.model.logits(self._last)[0, 0]

    def score_rows(self) -> np.ndarray:
        """Once finished, with `score`: [n, 1 + 2k] float32, the rows of `token_logprobs` for
        each token after the first (and the first too, with `before`), in order."""
        if self.score is None or not self.finished:
            raise ValueError("scores need a finished Prefill made with score=")
        if not self._scored:
            return np.zeros((0, 1 + 2 * self.score), np.float32)
        return np.concatenate([np.asarray(x) for x in self._scored])

    def scores(self) -> list[TokenLogprob]:
        """Once finished, with `score`: the log-probability of each token after the first (the
        first too, with `before`), given those before it, with its `score` most likely
        alternatives."""
        rows = self.score_rows()
        ids = self.tokens[0, self.total - len(rows) :].tolist() if len(rows) else []
        return read_rows(rows, ids, self.score)


def prefill_forks(
    model, prefix: ModelCache, prompts: Sequence[Sequence[int]]
) -> list[tuple[ModelCache, mx.array]]:
    """Each of `prompts` (own tokens, at least one each) prefilled on its own fork of the
    one-row `prefix`, all in one call right-padded to the longest: → per prompt, its one-row
    cache (a fork of `prefix`, joinable with its other forks) and its last position's logits
    [vocab]. Each row keeps exactly its own tokens (`ModelCache.checkpoint` records a padded
    call, `rollback` cuts every row to its length): `generate.prefill` of each on
    `prefix.fork(1)`, within float rounding, when all prompts lie on one side of dense_len
    (a padded call decides for its longest row); exactly that for one prompt."""
    lengths = [len(p) for p in prompts]
    n, T = len(prompts), max(lengths)
    padded = min(lengths) < T  # else nothing to cut: a plain call (a prompt alone: its prefill)
    cache = prefix.fork(n)
    point = cache.checkpoint(record=True, stepwise=False) if padded else None
    # [n, T]: padded with each row's last token (any id will do: the rollback drops them)
    ids = mx.array([[*p, *[p[-1]] * (T - len(p))] for p in prompts], dtype=mx.int32)
    h = model.hidden(ids, cache)  # [n, T, hidden]
    last = h[mx.arange(n), mx.array([m - 1 for m in lengths])]  # [n, hidden]
    logits = model.logits(last)  # [n, vocab]
    if padded:
        cache.rollback(point, lengths)
    rows = [cache] if n == 1 else [cache.select([b]) for b in range(n)]
    mx.eval(logits, *(a for row in rows for a in row.arrays()))
    return [(row, logits[b]) for b, row in enumerate(rows)]


@dataclass(frozen=True)
class Request:
    id: str
    prompt: tuple[int, ...]  # the row's own tokens, after any document prompt
    params: SamplingParams = SamplingParams()
    max_tokens: int = 256
    stop: frozenset[int] = frozenset()  # stop token ids
    stop_strings: tuple[str, ...] = ()  # needs a Generator with a detokenizer
    # The tokens before `prompt` that the row continues (its document), where the `lookup`
    # drafter looks for what came next; the prompt and answer are searched too.
    context: tuple[int, ...] = field(default=(), repr=False, compare=False)
    # The tokens whose text the answer's continues (a text completion's prompt): its text is
    # decoded after them (`StreamingDetokenizer`'s `after`), a leading space included; none: a
    # chat answer, decoded alone.
    after: tuple[int, ...] = field(default=(), repr=False, compare=False)
    # None: no log-probabilities; k: each token's, with its k most likely alternatives' (0-20)
    logprobs: int | None = None
    grammar: Grammar | None = field(default=None, repr=False, compare=False)  # what it must match

    def __post_init__(self) -> None:
        if not all(self.stop_strings):
            raise ValueError(f"request {self.id}: a stop string must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= TOP_LOGPROBS:
            raise ValueError(
                f"request {self.id}: logprobs must be in [0, {TOP_LOGPROBS}], got {self.logprobs}"
            )


@dataclass
class Generation:
    """A request's answer: its tokens (without the stop token) and where the time went."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" once finished
    # With stop strings: the decoded text, cut before the stop string that ended it (the tokens
    # are all those generated). Without: None, decode `tokens`.
    text: str | None = None
    cached_tokens: int = 0  # prefix tokens it reused
    prefill_s: float = 0.0  # its own prompt's prefill
    ttft_s: float = 0.0  # from its admission to its first token
    decode_s: float = 0.0  # from its first token to its last
    batch_size: int = 1  # most rows decoding together while it ran
    draft_tokens: int = 0  # tokens drafted for it (speculative decoding)
    accepted_tokens: int = 0  # of those, accepted by the full model
    last_token: int | None = None  # the newest token read (a stop token is not in `tokens`)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `tokens`, when asked for
    _detok: StreamingDetokenizer | None = field(default=None, repr=False, compare=False)
    _scanned: int = field(default=0, repr=False, compare=False)  # text searched for stop strings
    _admitted: float = field(default=0.0, repr=False, compare=False)
    _first_at: float = field(default=0.0, repr=False, compare=False)
    _sampled: int = field(default=0, repr=False, compare=False)  # tokens drawn, read or not
    _text: RowText | None = field(default=None, repr=False, compare=False)  # lookup drafting
    _stats: RowStats = field(default_factory=RowStats, repr=False, compare=False)
    _guide: Guide | None = field(default=None, repr=False, compare=False)  # its grammar's state

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def first_token_at(self) -> float:
        """When its first token was read (`time.perf_counter`); 0.0 before."""
        return self._first_at

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first (decode_s starts at it); None for an answer of
        fewer than two tokens, which has no rate."""
        steps = len(self.tokens) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else None


class Generator:
    """Continuous batching of requests, optionally over one shared prefix. `detokenizer` makes
    a fresh streaming decoder of a request's text, called with its `after=` (e.g.
    `Tokenizer.detokenizer`): requests with stop strings need one, and only they use it.
    `reserve_ahead`: as `Batch`'s (None: each row's whole answer is reserved when it joins).

    Each request is prefilled on its own row, then joins a `Batch` (the decoding loop, one step
    at a time), which keeps up to `batch_size` rows; a finished row leaves and a waiting request
    takes its place."""

    def __init__(
        self,
        model: Model,
        *,
        batch_size: int = 8,
        prefill_chunk: int = 2048,
        on_token: Callable[[Request, int], None] | None = None,
        detokenizer: Callable[..., StreamingDetokenizer] | None = None,
        speculation: Speculation = OFF,
        reserve_ahead: int | None = None,
        on_prefill: Callable[[Request, int, int], None] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be ≥ 1")
        self.model = model
        self.reserve_ahead = reserve_ahead
        self.on_prefill = on_prefill
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.on_token = on_token
        self.detokenizer = detokenizer
        self.speculation = speculation

    def generate(
        self, requests: Iterable[Request], prefix: ModelCache | None = None
    ) -> Iterator[Generation]:
        """Yields each request's Generation as it finishes (not in request order)."""
        return (g for g in self.stream(requests, prefix) if g.done)

    def stream(
        self, requests: Iterable[Request], prefix: ModelCache | None = None
    ) -> Iterator[Generation]:
        """Yields a request's Generation each time it reads a token (`last_token`), the last
        time finished (`done`)."""
        waiting = deque(requests)
        batch = Batch(
            self.model,
            forked=prefix is not None,
            on_token=self.on_token,
            detokenizer=self.detokenizer,
            reserve_ahead=self.reserve_ahead,
            speculation=self.speculation,
        )
        while waiting or batch:
            while waiting and len(batch) < self.batch_size:
                self._admit(batch, waiting.popleft(), prefix)
            yield from batch.step()

    def _admit(self, batch: Batch, request: Request, prefix: ModelCache | None) -> Generation:
        """Prefills the request on its own row (a fork of `prefix`, or a fresh cache), which
        joins `batch` at its next step."""
        batch.check(request)
        start = time.perf_counter()
        cache = self.model.make_cache() if prefix is None else prefix.fork(1)
        progress = None
        if self.on_prefill is not None:
            progress = functools.partial(self.on_prefill, request)
        logits = prefill(self.model, request.prompt, cache, self.prefill_chunk, progress)
        cached = 0 if prefix is None else prefix.offset
        return batch.add(request, cache, logits, cached_tokens=cached, admitted=start)


class Batch:
    """Rows decoding together, one `step()` at a time: the decoding loop of `Generator.stream`,
    for callers that decide between steps who joins (the server). A row joins at the next step
    (`add`) and leaves in the step it reads its stop token, its `max_tokens`-th token or its
    stop string; `cancel` drops it at the next step.

    The rows' caches must be joinable (`ModelCache.concat`): all forks of one prefix, made at
    one length (`forked`), or none holding shared keys. Buffers are reserved for each row's
    whole prompt and answer when rows join (few shapes: one compiled trace per batch), or, with
    `reserve_ahead`, for that many positions past the longest row (a server, whose max_tokens
    may be the whole context): the steps grow them as the answers do.

    Steps are pipelined: step n+1 is built and queued (`mx.async_eval`) before the tokens of
    step n are read, so the host's work overlaps the device's; sampling runs on the device and
    the only read per step is the batch's tokens. A row that stops is dropped after the step
    already queued for it, whose token is discarded. Speculating (`speculation`, with its
    `Policy` deciding per step), a step reads the tokens first, drafts after them and verifies
    the drafts in one pass, which is not pipelined. Neither is a step of a batch holding a row
    with a grammar: its mask needs the row's newest token, read before the next is drawn."""

    def __init__(
        self,
        model: Model,
        *,
        forked: bool,
        on_token: Callable[[Request, int], None] | None = None,
        detokenizer: Callable[..., StreamingDetokenizer] | None = None,
        reserve_ahead: int | None = None,
        speculation: Speculation = OFF,
    ) -> None:
        self.model, self.forked, self.reserve_ahead = model, forked, reserve_ahead
        self.speculation = speculation
        self._lookup = Lookup() if speculation.draft in ("lookup", "auto") else None
        self._layers = Layers(model, speculation.layers) if speculation.draft == "layers" else None
        self._policy = Policy(speculation)
        self.on_token, self.detokenizer = on_token, detokenizer
        self.rows: list[Generation] = []
        self.cache: ModelCache | None = None
        self._joining: list[tuple[Generation, ModelCache, mx.array, mx.array | None]] = []
        self._feed: mx.array | None = None  # [rows] each row's newest token: drawn, not yet read
        # [rows, width] `token_logprobs` of `_feed`, while a row asks for them (zeros in the rows
        # that do not)
        self._feed_lp: mx.array | None = None
        self._known: list[int] | None = None  # `_feed`'s values where the host has them (a pass's)
        self._counts: mx.array | None = None  # [rows, vocab] tokens drawn per row (penalties)
        # the rows' `logit_biases` [rows, vocab], with the rows' logit_bias it was made of
        self._bias: tuple[tuple, mx.array | None] = ((), None)

    def __len__(self) -> int:
        """Rows decoding and rows joining at the next step."""
        return len(self.rows) + len(self._joining)

    def check(self, request: Request) -> None:
        """ValueError if this batch cannot run `request` (stop strings without a detokenizer,
        a logit_bias token outside the vocabulary)."""
        if request.stop_strings and self.detokenizer is None:
            raise ValueError(f"request {request.id}: stop strings need a Generator detokenizer")
        vocab = self.model.config.vocab_size
        if any(t >= vocab for t, _ in request.params.logit_bias):
            raise ValueError(f"request {request.id}: a logit_bias token is past the vocabulary")

    def add(
        self,
        request: Request,
        cache: ModelCache,
        logits: mx.array,
        *,
        cached_tokens: int = 0,
        admitted: float,
    ) -> Generation:
        """A prefilled row joins at the next step: its one-row `cache` and its prompt's last
        `logits` [vocab], from which its first token is drawn here, on the device (read with the
        batch's next tokens). `admitted`: when its prefill started (perf_counter)."""
        self.check(request)
        g = Generation(request, cached_tokens=cached_tokens)
        if request.stop_strings:
            g._detok = self.detokenizer(after=request.after)
        g.prefill_s = time.perf_counter() - admitted
        g._admitted = admitted
        allowed = None
        if request.grammar is not None:
            g._guide = request.grammar.guide()
            allowed = allowed_tokens([(g._guide, request.grammar)], logits.shape[-1])
        bias = logit_biases([request.params], logits.shape[-1])
        first = sample_tokens(logits[None], [request.params], [0], allowed=allowed, bias=bias)
        lp = None if request.logprobs is None else token_logprobs(logits[None], first)
        g._sampled = 1
        if self._lookup is not None:
            self._lookup.prepare(_row_text(g))
        self._joining.append((g, cache, first, lp))
        return g

    def cancel(self, g: Generation) -> None:
        """Ends row g ("cancelled") and drops it at the next step; a no-op once it finished."""
        if not g.done:
            self._finish(g, "cancelled", time.perf_counter())

    def step(self) -> list[Generation]:
        """One decode step of every row: → the rows that read a token in it (each its newest
        token in `last_token`, `done` once finished). Rows joining are prefilled already."""
        if any(g.done for g in self.rows):  # cancelled since the last step
            self._keep([b for b, g in enumerate(self.rows) if not g.done])
        if self._joining:
            self._join()
        rows = self.rows
        if not rows:
            return []
        for g in rows:
            g.batch_size = max(g.batch_size, len(rows))
        guided = any(g._guide is not None for g in rows)
        biased = any(g.request.params.logit_bias for g in rows)
        plain_only = guided or biased or self._wants_lp()
        if self.speculation.draft != "off" and self._policy.speculate() and not plain_only:
            return self._speculative_step()
        self._policy.plain_step(len(rows), time.perf_counter())
        if guided:  # a row's mask needs its newest token: read first, drop the rows it ended
            self._read_fed(rows)
            self._drop_done()
            if not self.rows:
                return rows
        live = self.rows
        logits = decode(self.model, self._feed, self.cache)
        params = [g.request.params for g in live]
        guides = [None if g._guide is None else (g._guide, g.request.grammar) for g in live]
        allowed = allowed_tokens(guides, logits.shape[-1]) if guided else None
        steps = [g._sampled for g in live]
        drawn = sample_tokens(logits, params, steps, self._counts, allowed, self._biases(live))
        for g in live:
            g._sampled += 1
        if self._counts is not None:
            self._counts = self._counts.at[mx.arange(len(live)), drawn].add(1)
        lp = token_logprobs(logits, drawn) if self._wants_lp() else None
        extra = [a for a in (self._counts, lp) if a is not None]
        mx.async_eval(drawn, *self.cache.arrays(), *extra)
        if not guided:
            self._read_fed(rows)  # the tokens the queued step is fed: all that is read per step
        self._feed, self._feed_lp, self._known = drawn, lp, None
        if self._policy.awaits_draft and self._draftable(live):
            self._policy.draftable()
        self._drop_done()
        return rows

    def _read_fed(self, rows: list[Generation]) -> None:
        """Reads the rows' newest tokens (`_feed`, with their log-probabilities where asked)."""
        read = self._fed()
        read_lp = [None] * len(rows) if self._feed_lp is None else self._feed_lp.tolist()
        now = time.perf_counter()
        for g, token, lp in zip(rows, read, read_lp, strict=True):
            self._read(g, token, now, lp)

    def _drop_done(self) -> None:
        keep = [b for b, g in enumerate(self.rows) if not g.done]
        if len(keep) < len(self.rows):
            self._keep(keep)

    # -- speculative decoding (salabatch.engine.speculative) -----------------------------------
    def _speculative_step(self) -> list[Generation]:
        """Reads the rows' newest tokens, drafts after them and verifies the drafts in one pass
        of the model (`speculative.verify`); every row reads its accepted drafts, and the
        model's token after them is drawn for the next step. Without a draft in any row, a plain
        step. Not pipelined: the drafts need the tokens read."""
        began = time.perf_counter()
        rows = self.rows
        newest = self._fed()
        read = time.perf_counter()  # (a row's first token is read here, as a plain step reads it)
        for g, token in zip(rows, newest, strict=True):
            self._read(g, token, read)
        alive = [b for b, g in enumerate(rows) if not g.done]
        if len(alive) < len(rows):
            self._keep(alive)
        if not self.rows:
            return rows
        newest = [newest[b] for b in alive]
        live = self.rows
        drafts, q = self._drafts(live)
        params = [g.request.params for g in live]
        steps = [g._sampled for g in live]
        counts = self._counts
        if not any(drafts):  # a plain step, its token read at the next
            logits = decode(self.model, self._feed, self.cache)
            self._drawn(live, [[]] * len(live), sample_tokens(logits, params, steps, counts), False)
            self._policy.undrafted()
            return rows
        T = 1 + max(map(len, drafts))
        ids = [[t, *d] + [t] * (T - 1 - len(d)) for t, d in zip(newest, drafts, strict=True)]
        point = self.cache.checkpoint()
        logits = self.model(mx.array(ids, dtype=mx.int32), self.cache, queue=True)  # [B, T, V]
        plain = all(p.plain_greedy for p in params)  # position 0's token: its argmax
        first = None if plain else sample_tokens(logits[:, 0], params, steps, counts)
        verdicts = verify(logits, drafts, params, steps, first, q)
        self.cache.rollback(point, [v.accepted + 1 for v in verdicts])
        now = time.perf_counter()
        produced = 0
        for g, d, v in zip(live, drafts, verdicts, strict=True):
            g.draft_tokens += len(d)
            g._stats.passed(len(d), v.accepted)
            answered = len(g.tokens)
            for token in d[: v.accepted]:
                if not g.done:
                    self._read(g, token, now)
            # accepted: the drafts in its answer (not a stop token, nor those after its stop)
            g.accepted_tokens += len(g.tokens) - answered
            produced += len(g.tokens) - answered + (not g.done)
        self._policy.verify_pass(len(live), produced, now - began)
        kept = [d[: v.accepted] for d, v in zip(drafts, verdicts, strict=True)]
        known = [v.next_token for v in verdicts]
        self._drawn(live, kept, mx.array(known, dtype=mx.int32), True, known)
        return rows

    def _fed(self) -> list[int]:
        """The rows' newest tokens, `_feed`: the host's copy where a pass read them."""
        return self._known if self._known is not None else self._feed.tolist()

    def _biases(self, rows: list[Generation]) -> mx.array | None:
        """The rows' `logit_biases`, made again only when the rows' biases change."""
        key = tuple(g.request.params.logit_bias for g in rows)
        if self._bias[0] != key:
            params = [g.request.params for g in rows]
            self._bias = (key, logit_biases(params, self.model.config.vocab_size))
        return self._bias[1]

    def _wants_lp(self) -> bool:
        """Whether a row asks for log-probabilities (the batch then takes plain steps)."""
        return any(g.request.logprobs is not None for g in self.rows)

    def _drafts(self, rows: list[Generation]) -> tuple[list[list[int]], mx.array | None]:
        """Each row's drafts (`_draft_room`; none for a row that `auto` rests), with the `layers`
        drafter also the draft distributions of rows with a temperature."""
        limits = [
            n if n and self._policy.drafts_for(g._stats) else 0
            for g, n in zip(rows, self._draft_room(rows, self._policy.tokens), strict=True)
        ]
        limit = max(limits)
        if not limit:
            return [[] for _ in rows], None
        if self._layers is not None:
            params = [g.request.params for g in rows]
            drafted, q = self._layers.propose(
                self.cache, self._feed, params, [g._sampled for g in rows], limit
            )
            return [d[:n] for d, n in zip(drafted.tolist(), limits, strict=True)], q
        drafts = [self._lookup.propose(_row_text(g), n) for g, n in zip(rows, limits, strict=True)]
        return drafts, None

    def _draft_room(self, rows: list[Generation], k: int) -> list[int]:
        """Drafts each row may have: at most k, its room to max_tokens, none with penalties, and
        what keeps the pass on one side of dense_len (its queries then attend together; a
        query's sequence reaching dense_len attends sparsely: SPEC P7)."""
        dense_len = self.model.config.sparse.dense_len
        # every row is fed the pass's length, so its side of dense_len bounds every row's drafts:
        # a dense row's last query, at p + drafts, keeps its sequence below dense_len
        side = min(dense_len - 2 - p if p + 1 < dense_len else k for p in self.cache.positions)
        return [
            0
            if penalized([g.request.params])
            else max(0, min(k, side, g.request.max_tokens - len(g.tokens) - 1))
            for g in rows
        ]

    def _draftable(self, rows: list[Generation]) -> bool:
        """Whether the lookup drafter finds a draft after some row's newest token read (and the
        row has room for it): when a batch running plain steps because it found none drafts
        again."""
        room = self._draft_room(rows, self.speculation.tokens)
        return any(
            n and not g.done and self._lookup.propose(_row_text(g), 1)
            for g, n in zip(rows, room, strict=True)
        )

    def _drawn(
        self,
        rows: list[Generation],
        kept: list[list[int]],
        drawn: mx.array,
        passed: bool,
        known: list[int] | None = None,
    ) -> None:
        """After a step (`passed`: a verify pass) that read `kept[b]` more tokens of row b and
        drew `drawn` [B] (read at the next step; `known`: its values, where a pass read them):
        the rows' random steps and token counts move on."""
        for g, d in zip(rows, kept, strict=True):
            g._sampled += len(d) + 1
        if self._counts is not None:
            at = [(b, t) for b, d in enumerate(kept) for t in d]
            if at:
                b, t = zip(*at, strict=True)
                self._counts = self._counts.at[mx.array(b), mx.array(t)].add(1)
            self._counts = self._counts.at[mx.arange(len(rows)), drawn].add(1)
        self._feed, self._feed_lp, self._known = drawn, None, known
        counts = [] if self._counts is None else [self._counts]
        if passed:  # its rollback is queued with the next pass's layers, overlapping their build
            if counts:  # (its tokens the host has: nothing to wait for)
                mx.async_eval(*counts)
        else:
            mx.async_eval(drawn, *self.cache.arrays(), *counts)
        keep = [b for b, g in enumerate(rows) if not g.done]
        if len(keep) < len(rows):
            self._keep(keep)

    def _join(self) -> None:
        """The rows added since the last step join, but those cancelled since: never read."""
        joined = [j for j in self._joining if not j[0].done]
        for g, _, _, _ in self._joining:
            if g.done and self._lookup is not None:
                self._lookup.release(g.request.context)  # prepared when it was added
        self._joining = []
        if not joined:
            return
        old = len(self.rows)
        self.rows = self.rows + [g for g, _, _, _ in joined]
        caches = [c for _, c, _, _ in joined]
        self.cache = ModelCache.concat(caches if self.cache is None else [self.cache, *caches])
        first = [t for _, _, t, _ in joined]
        self._feed = mx.concatenate(first if self._feed is None else [self._feed, *first])
        self._known = None
        if self._wants_lp():
            self._feed_lp = self._joined_lp(old, [lp for _, _, _, lp in joined])
        if self._counts is not None or penalized([g.request.params for g in self.rows]):
            self._counts = self._grown_counts(len(joined), first)
        self._policy.joined()
        room = self._room()
        if self.reserve_ahead is not None:
            room = min(room, self.cache.own_length() + self.reserve_ahead)
        self.cache.reserve(room)

    def _joined_lp(self, old: int, joined: list[mx.array | None]) -> mx.array:
        """`_feed_lp` of the rows after `joined` new ones (their first tokens' `token_logprobs`,
        None where not asked for): zeros for the rows that have none (nothing reads them)."""
        width = 1 + 2 * min(TOP_LOGPROBS, self.model.config.vocab_size)
        if self._feed_lp is not None:
            parts = [self._feed_lp]
        else:
            parts = [mx.zeros((old, width), dtype=mx.float32)] if old else []
        for lp in joined:
            parts.append(mx.zeros((1, width), dtype=mx.float32) if lp is None else lp)
        return mx.concatenate(parts)

    def _keep(self, keep: list[int]) -> None:
        """Keeps only these rows (their cache, newest tokens and counts); the others' documents
        leave the lookup drafter with their last row."""
        if self._lookup is not None:
            kept = set(keep)
            for b, g in enumerate(self.rows):
                if b not in kept:
                    self._lookup.release(g.request.context)
        self.rows = [self.rows[b] for b in keep]
        if not keep:
            self.cache = self._feed = self._feed_lp = self._counts = self._known = None
            return
        self.cache = self.cache.select(keep)
        at = mx.array(keep, dtype=mx.int32)
        self._feed = self._feed[at]
        if self._feed_lp is not None:
            self._feed_lp = self._feed_lp[at] if self._wants_lp() else None
        if self._known is not None:
            self._known = [self._known[b] for b in keep]
        if self._counts is not None:
            self._counts = self._counts[at]

    def _room(self) -> int:
        """Own positions the batch's rows may reach: each its prompt and answer, after a fork's
        tail of the document (under two level-2 strides). A bound that does not depend on the
        tail, so the batches of every document asked the same questions share buffer shapes
        (one compiled trace)."""
        tail = 2 * self.model.config.sparse.compression[1][1] if self.forked else 0
        return tail + max(len(g.request.prompt) + g.request.max_tokens for g in self.rows) + 1

    def _grown_counts(self, joined: int, first: list[mx.array]) -> mx.array:
        """Token counts of the rows after `joined` new ones (each holding its first token); rows
        that had none start from zero (they had no penalty, so nothing read them)."""
        vocab = self.model.config.vocab_size
        old = len(self.rows) - joined
        counts = self._counts
        if counts is None:
            counts = mx.zeros((old, vocab), dtype=mx.int32)
        new = mx.zeros((joined, vocab), dtype=mx.int32)
        new = new.at[mx.arange(joined), mx.concatenate(first)].add(1)
        return mx.concatenate([counts, new])

    def _read(self, g: Generation, token: int, now: float, lp: list[float] | None = None) -> None:
        """A token read back for row g (`lp`: its `token_logprobs` row, read with it, where the
        row asks for them): the first sets its time to first token."""
        if not g.tokens and g.last_token is None:
            g.ttft_s = now - g._admitted
            g._first_at = now
        g.last_token = token
        grammar = g.request.grammar
        if token in g.request.stop or (grammar is not None and token == grammar.end):
            self._finish(g, "stop", now)  # a grammar's end: its pattern is complete
            return
        g.tokens.append(token)
        if g._guide is not None:
            g._guide.advance(token, return_tokens=False)
        if g.request.logprobs is not None:
            g.logprobs.append(read_logprobs(lp, token, g.request.logprobs))
        if self.on_token:
            self.on_token(g.request, token)
        if g._detok is not None:
            g._detok.add_token(token)
            if (cut := _stop_string_at(g)) is not None:
                self._finish(g, "stop", now, cut)
                return
        if len(g.tokens) >= g.request.max_tokens:
            self._finish(g, "length", now)

    @staticmethod
    def _finish(g: Generation, reason: str, now: float, cut: int | None = None) -> None:
        g.finish_reason = reason
        g.decode_s = now - g._first_at if g._first_at else 0.0
        if g._detok is not None:
            if cut is None:
                g._detok.finalize()
            g.text = g._detok.text[:cut]
            g._detok = None


def _row_text(g: Generation) -> RowText:
    """Row g's text as the lookup drafter reads it, up to its newest token read."""
    if g._text is None:
        g._text = RowText(g.request.context, list(g.request.prompt))
    g._text.own[len(g.request.prompt) :] = g.tokens
    return g._text


def _stop_string_at(g: Generation) -> int | None:
    """Where the first stop string starts in the row's text, if one has appeared; only the text
    new since the last call (and the stop strings' length before it) is searched."""
    text, stops = g._detok.text, g.request.stop_strings
    start = max(0, g._scanned - max(map(len, stops)) + 1)
    g._scanned = len(text)
    found = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None
