"""A document's prefix cache, from the cheapest source: this run's memory, the store on disk,
or a prefill — resumed from the last snapshot when an earlier run was killed mid-document.

A store that cannot be read or written costs no answer: it warns and misses, or stores nothing,
and the prefill's live cache answers the document's questions all the same."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from salabatch.engine.cache import ModelCache
from salabatch.engine.generate import prefill
from salabatch.engine.model import Model
from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore


@dataclass
class Prefix:
    """A document's prefix: its prefilled cache, and where it came from this time."""

    cache: ModelCache
    source: str  # "memory" | "disk" | "none" (prefilled now)
    prefill_s: float = 0.0  # time spent prefilling in this run
    resumed_from: int = 0  # tokens a snapshot already held


class DocumentCaches:
    """Keeps the last document's prefix in memory, until another is asked for, and the rest in
    the store."""

    def __init__(
        self,
        model: Model,
        store: PrefixStore | None,
        *,
        chunk: int = 2048,
        snapshot_every: int = 0,
    ) -> None:
        self.model, self.store = model, store
        self.chunk, self.snapshot_every = chunk, snapshot_every
        self._last: tuple[str, ModelCache] | None = None

    def keep_only(self, key: PrefixKey | None) -> None:
        """Lets go of the last document's prefix unless it is `key`'s: before a memory check
        for other work (another document, or a pool that holds none), which must see that
        memory free, as its plan counts it."""
        if self._last and (key is None or self._last[0] != key.digest):
            self._last = None

    def get(
        self,
        key: PrefixKey,
        ids: Sequence[int],
        progress: Callable[[int, int], None] | None = None,
    ) -> Prefix:
        if self._last and self._last[0] == key.digest:
            return Prefix(self._last[1], "memory")
        self.keep_only(key)  # no plan counts the last document's cache beside this one's
        cache = self.store.load(key, self.model.config) if self.store else None
        found = Prefix(cache, "disk") if cache is not None else self._prefill(key, ids, progress)
        self._last = (key.digest, found.cache)
        return found

    def _prefill(self, key, ids, progress) -> Prefix:
        start = time.perf_counter()
        cache = self.store.load_snapshot(key, self.model.config) if self.store else None
        resumed = 0 if cache is None else cache.offset
        if cache is None:
            cache = self.model.make_cache()
            cache.plan_prefill(len(ids))
        every = self.snapshot_every if self.store else 0
        last_snapshot = resumed

        def after_chunk(done: int, _total: int) -> None:
            nonlocal last_snapshot
            at = resumed + done
            if every and at < len(ids) and at // every > last_snapshot // every:
                self.store.save_snapshot(key, cache)
                last_snapshot = at
            if progress:
                progress(at, len(ids))

        if resumed < len(ids):
            prefill(self.model, ids[resumed:], cache, self.chunk, after_chunk)
        if self.store:
            self.store.save(key, cache)  # in place of its snapshots
            self.store.drop_snapshots(key)  # where the save could not: they are no use now
        return Prefix(cache, "none", time.perf_counter() - start, resumed)
