"""Generation: chunked prefill, and batched decoding of many requests with a shared prefix.

A `Generator` keeps up to `batch_size` rows decoding together. Each request is prefilled on its
own (its lightning states depend on exactly its tokens), then joins the running batch; a finished
row leaves at once and a waiting request takes its place. With a `prefix` (a prefilled document)
every row continues a fork of it, so the document's sparse-layer keys are stored once.

A row ends at a stop token, at `max_tokens`, or, given a detokenizer, as soon as its decoded
text contains one of its stop strings (the text is then cut before it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from salabatch.engine.cache import ModelCache
from salabatch.engine.decode import decode
from salabatch.engine.model import Model
from salabatch.engine.sampling import SamplingParams, penalized, sample_tokens

if TYPE_CHECKING:
    from salabatch.engine.detokenizer import StreamingDetokenizer


def prefill(
    model: Model,
    ids: Sequence[int],
    cache: ModelCache,
    chunk: int = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> mx.array:
    """Feeds `ids` into a one-row cache in chunks; returns the last position's logits [vocab].

    On a fresh cache the whole length is planned first, so every chunk runs the sparse layers
    as one call over all of `ids` would. `progress(done, total)` is called after each chunk.
    """
    if not ids:
        raise ValueError("prefill needs at least one token")
    if cache.positions is None:
        cache.plan_prefill(len(ids))
    tokens = mx.array(list(ids), dtype=mx.int32)[None]
    for start in range(0, len(ids), chunk):
        h = model.hidden(tokens[:, start : start + chunk], cache)
        last = h[:, -1:]
        mx.eval(last, *cache.arrays())  # bounds the graph and memory to one chunk
        if progress:
            progress(min(start + chunk, len(ids)), len(ids))
    return model.logits(last)[0, 0]


@dataclass(frozen=True)
class Request:
    id: str
    prompt: tuple[int, ...]  # the row's own tokens, after any document prompt
    params: SamplingParams = SamplingParams()
    max_tokens: int = 256
    stop: frozenset[int] = frozenset()  # stop token ids
    stop_strings: tuple[str, ...] = ()  # needs a Generator with a detokenizer

    def __post_init__(self) -> None:
        if not all(self.stop_strings):
            raise ValueError(f"request {self.id}: a stop string must not be empty")


@dataclass
class Generation:
    """A request's answer: its tokens (without the stop token) and where the time went."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" once finished
    # With stop strings: the decoded text, cut before the stop string that ended it (the tokens
    # are all those generated). Without: None, decode `tokens`.
    text: str | None = None
    cached_tokens: int = 0  # prefix tokens it reused
    prefill_s: float = 0.0  # its own prompt's prefill
    ttft_s: float = 0.0  # from its admission to its first token
    decode_s: float = 0.0  # from its first token to its last
    batch_size: int = 1  # most rows decoding together while it ran
    last_token: int | None = None  # the newest token read (a stop token is not in `tokens`)
    _detok: StreamingDetokenizer | None = field(default=None, repr=False, compare=False)
    _scanned: int = field(default=0, repr=False, compare=False)  # text searched for stop strings
    _admitted: float = field(default=0.0, repr=False, compare=False)
    _first_at: float = field(default=0.0, repr=False, compare=False)
    _sampled: int = field(default=0, repr=False, compare=False)  # tokens drawn, read or not

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tok_s(self) -> float:
        steps = len(self.tokens) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class Generator:
    """Continuous batching of requests, optionally over one shared prefix. `detokenizer` makes
    a fresh streaming decoder (e.g. `Tokenizer.detokenizer`): requests with stop strings need
    one, and only they use it.

    Steps are pipelined: step n+1 is built and queued (`mx.async_eval`) before the tokens of
    step n are read, so the host's work overlaps the device's; sampling runs on the device and
    the only read per step is the batch's tokens. A row that stops is dropped after the step
    already queued for it, whose token is discarded."""

    def __init__(
        self,
        model: Model,
        *,
        batch_size: int = 8,
        prefill_chunk: int = 2048,
        on_token: Callable[[Request, int], None] | None = None,
        detokenizer: Callable[[], StreamingDetokenizer] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be ≥ 1")
        self.model = model
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.on_token = on_token
        self.detokenizer = detokenizer

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
        rows: list[Generation] = []
        batch: ModelCache | None = None
        feed: mx.array | None = None  # [rows] each row's newest token: drawn, not yet read
        counts: mx.array | None = None  # [rows, vocab] tokens drawn per row (penalties)
        while waiting or rows:
            joined = []
            while waiting and len(rows) + len(joined) < self.batch_size:
                joined.append(self._admit(waiting.popleft(), prefix))
            if joined:
                rows += [g for g, _, _ in joined]
                caches = [c for _, c, _ in joined]
                batch = ModelCache.concat(caches if batch is None else [batch, *caches])
                first = [t for _, _, t in joined]
                feed = mx.concatenate(first if feed is None else [feed, *first])
                if counts is not None or penalized([g.request.params for g in rows]):
                    counts = self._counts(counts, rows, len(joined), first)
                batch.reserve(self._room(rows, prefix))
            for g in rows:
                g.batch_size = max(g.batch_size, len(rows))
            logits = decode(self.model, feed, batch)
            params = [g.request.params for g in rows]
            drawn = sample_tokens(logits, params, [g._sampled for g in rows], counts)
            for g in rows:
                g._sampled += 1
            if counts is not None:
                counts = counts.at[mx.arange(len(rows)), drawn].add(1)
            mx.async_eval(drawn, *batch.arrays(), *([] if counts is None else [counts]))
            read = feed.tolist()  # the tokens the queued step is fed: all that is read per step
            now = time.perf_counter()
            keep = []
            for b, (g, token) in enumerate(zip(rows, read, strict=True)):
                self._read(g, token, now)
                yield g
                if not g.done:
                    keep.append(b)
            if len(keep) < len(rows):
                rows = [rows[b] for b in keep]
                batch = batch.select(keep) if keep else None
                at = mx.array(keep, dtype=mx.int32)
                drawn = drawn[at] if keep else None
                counts = counts[at] if counts is not None and keep else None
            feed = drawn

    def _admit(
        self, request: Request, prefix: ModelCache | None
    ) -> tuple[Generation, ModelCache, mx.array]:
        """Prefills the request on its own row; → its Generation, its cache and its first
        token [1], drawn on the device (read with the batch's next tokens)."""
        if request.stop_strings and self.detokenizer is None:
            raise ValueError(f"request {request.id}: stop strings need a Generator detokenizer")
        start = time.perf_counter()
        cache = self.model.make_cache() if prefix is None else prefix.fork(1)
        logits = prefill(self.model, request.prompt, cache, self.prefill_chunk)
        g = Generation(request, cached_tokens=0 if prefix is None else prefix.offset)
        if request.stop_strings:
            g._detok = self.detokenizer()
        g.prefill_s = time.perf_counter() - start
        g._admitted = start
        first = sample_tokens(logits[None], [request.params], [0])
        g._sampled = 1
        return g, cache, first

    def _room(self, rows: list[Generation], prefix: ModelCache | None) -> int:
        """Own positions the batch's rows may reach: each its prompt and answer, after a fork's
        tail of the document (under two level-2 strides). A bound that does not depend on the
        tail, so the batches of every document asked the same questions share buffer shapes
        (one compiled trace)."""
        tail = 0 if prefix is None else 2 * self.model.config.sparse.compression[1][1]
        return tail + max(len(g.request.prompt) + g.request.max_tokens for g in rows) + 1

    def _counts(
        self, counts: mx.array | None, rows: list[Generation], joined: int, first: list[mx.array]
    ) -> mx.array:
        """Token counts of the rows after `joined` new ones (each holding its first token); rows
        that had none start from zero (they had no penalty, so nothing read them)."""
        vocab = self.model.config.vocab_size
        old = len(rows) - joined
        if counts is None:
            counts = mx.zeros((old, vocab), dtype=mx.int32)
        new = mx.zeros((joined, vocab), dtype=mx.int32)
        new = new.at[mx.arange(joined), mx.concatenate(first)].add(1)
        return mx.concatenate([counts, new])

    def _read(self, g: Generation, token: int, now: float) -> None:
        """A token read back for row g: the first sets its time to first token."""
        if not g.tokens and g.last_token is None:
            g.ttft_s = now - g._admitted
            g._first_at = now
        g.last_token = token
        if token in g.request.stop:
            self._finish(g, "stop", now)
            return
        g.tokens.append(token)
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
        g.decode_s = now - g._first_at
        if g._detok is not None:
            if cut is None:
                g._detok.finalize()
            g.text = g._detok.text[:cut]
            g._detok = None


def _stop_string_at(g: Generation) -> int | None:
    """Where the first stop string starts in the row's text, if one has appeared; only the text
    new since the last call (and the stop strings' length before it) is searched."""
    text, stops = g._detok.text, g.request.stop_strings
    start = max(0, g._scanned - max(map(len, stops)) + 1)
    g._scanned = len(text)
    found = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None
