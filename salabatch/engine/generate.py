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
from salabatch.engine.model import Model
from salabatch.engine.sampling import SamplingParams, sample

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
    """A finished request: its tokens (without the stop token) and where the time went."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" | "length"
    # With stop strings: the decoded text, cut before the stop string that ended it (the tokens
    # are all those generated). Without: None, decode `tokens`.
    text: str | None = None
    cached_tokens: int = 0  # prefix tokens it reused
    prefill_s: float = 0.0  # its own prompt's prefill
    ttft_s: float = 0.0  # from its admission to its first token
    decode_s: float = 0.0  # from its first token to its last
    batch_size: int = 1  # most rows decoding together while it ran
    _detok: StreamingDetokenizer | None = field(default=None, repr=False, compare=False)
    _scanned: int = field(default=0, repr=False, compare=False)  # text searched for stop strings

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
    one, and only they use it."""

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
        waiting = deque(requests)
        rows: list[Generation] = []
        first_token_at: list[float] = []
        batch: ModelCache | None = None
        while waiting or rows:
            while waiting and len(rows) < self.batch_size:
                joined, cache = self._admit(waiting.popleft(), prefix)
                if self._finished(joined):
                    yield joined
                    continue
                rows.append(joined)
                first_token_at.append(time.perf_counter())
                batch = cache if batch is None else ModelCache.concat([batch, cache])
            if not rows:
                continue
            for g in rows:
                g.batch_size = max(g.batch_size, len(rows))
            ids = mx.array([[g.tokens[-1]] for g in rows], dtype=mx.int32)
            logits = self.model(ids, batch)[:, -1]
            mx.eval(logits, *batch.arrays())
            chosen = sample(
                logits,
                [g.request.params for g in rows],
                [len(g.tokens) for g in rows],
                [g.tokens for g in rows],
            )
            now = time.perf_counter()
            keep = []
            for b, (g, token) in enumerate(zip(rows, chosen, strict=True)):
                self._add(g, token)
                if self._finished(g):
                    g.decode_s = now - first_token_at[b]
                    yield g
                else:
                    keep.append(b)
            if len(keep) < len(rows):
                rows = [rows[b] for b in keep]
                first_token_at = [first_token_at[b] for b in keep]
                batch = batch.select(keep) if keep else None

    def _admit(self, request: Request, prefix: ModelCache | None) -> tuple[Generation, ModelCache]:
        """Prefills the request on its own row and samples its first token."""
        if request.stop_strings and self.detokenizer is None:
            raise ValueError(f"request {request.id}: stop strings need a Generator detokenizer")
        start = time.perf_counter()
        cache = self.model.make_cache() if prefix is None else prefix.fork(1)
        logits = prefill(self.model, request.prompt, cache, self.prefill_chunk)
        g = Generation(request, cached_tokens=0 if prefix is None else prefix.offset)
        if request.stop_strings:
            g._detok = self.detokenizer()
        g.prefill_s = time.perf_counter() - start
        self._add(g, sample(logits[None], [request.params], [0], [[]])[0])
        g.ttft_s = time.perf_counter() - start
        return g, cache

    def _add(self, g: Generation, token: int) -> None:
        if token in g.request.stop:
            self._finish(g, "stop")
            return
        g.tokens.append(token)
        if self.on_token:
            self.on_token(g.request, token)
        if g._detok is not None:
            g._detok.add_token(token)
            if (cut := _stop_string_at(g)) is not None:
                self._finish(g, "stop", cut)
                return
        if len(g.tokens) >= g.request.max_tokens:
            self._finish(g, "length")

    @staticmethod
    def _finish(g: Generation, reason: str, cut: int | None = None) -> None:
        g.finish_reason = reason
        if g._detok is not None:
            if cut is None:
                g._detok.finalize()
            g.text = g._detok.text[:cut]
            g._detok = None

    @staticmethod
    def _finished(g: Generation) -> bool:
        return g.finish_reason == "stop" or len(g.tokens) >= g.request.max_tokens


def _stop_string_at(g: Generation) -> int | None:
    """Where the first stop string starts in the row's text, if one has appeared; only the text
    new since the last call (and the stop strings' length before it) is searched."""
    text, stops = g._detok.text, g.request.stop_strings
    start = max(0, g._scanned - max(map(len, stops)) + 1)
    g._scanned = len(text)
    found = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None
