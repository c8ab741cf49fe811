"""Held prefixes: prefilled prompt prefixes the server resumes later prompts from, in memory
under a byte cap, the least recently used written to the prefix store on disk.

A held prefix is a one-row cache without shared keys holding exactly the tokens it is keyed by:
the sha256 of their ids, as `PrefixKey` hashes a stored prefix, so the disk tier is `salabatch
run`'s store (a document a run prefilled is found by the server: `match` tries the lengths of
the store's entries; a run looks up its own boundaries only). It
is never continued: a job forks it (`ModelCache.fork(1)`: the sparse layers' keys shared, not
copied; the lightning states and a tail of under 128 keys copied, a constant size) and prefills
the rest of its prompt on the fork. All forks of one held prefix share one `SharedKeys`, so
their rows decode in one batch.

A fork cannot be forked again nor saved, so a snapshot taken on a fork (a job that resumed from
a held prefix, then prefilled past one of its boundaries) must own its keys: `owned` copies the
fork's shared keys and its own into one new cache. That is one copy of the prefix, paid when the
snapshot is saved; a hit never copies more than the fork's constant part.

Where a prompt's boundaries mark no point a later prompt shares, `SeenPrompts` finds one: the
longest prefix it has in common with a recent prompt, to a multiple of 64 ids. The second of
several prompts that share a document and differ after it snapshots there, and the others resume.

Memory: `cap` bounds the bytes of the prefixes held (`held_bytes`). Past it the least recently
used are evicted: written to the store (when there is one and it does not hold them yet), then
dropped. A prefix evicted while running rows still read it stays matchable (`lent`) until the
last of them ends, so a new job over it forks the same keys rather than loading a second copy;
its memory is the rows' (`lent_bytes`), freed with them.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from salabatch.engine.cache import FORMAT_VERSION, ModelCache
from salabatch.engine.config import ModelConfig
from salabatch.engine.sparse_cache import SparseKVCache
from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore

# `SeenPrompts`: where prompts agree is found to a multiple of SEEN_BLOCK ids; the prefixes of
# about 4M ids of recent prompts are remembered (~15 MB of digests)
SEEN_BLOCK = 64
SEEN_MOST = 1 << 16


def prefix_digests(ids: Sequence[int], lengths: Iterable[int]) -> dict[int, str]:
    """sha256 hex of ids[:n] for every n in `lengths` (as `PrefixKey.of` hashes a prompt: 4
    little-endian bytes per id), in one pass over the ids."""
    data = np.asarray(ids, dtype="<u4")
    h, at, out = hashlib.sha256(), 0, {}
    for n in sorted(set(lengths)):
        h.update(data[at:n].tobytes())
        at = n
        out[n] = h.copy().hexdigest()
    return out


def owned(cache: ModelCache, cfg: ModelConfig) -> ModelCache:
    """A one-row cache that holds all of its keys: a fork's shared keys and its own, copied once
    into new buffers (evaluated here), with the lightning states as they are. What a snapshot
    taken on a fork holds, since a fork can be neither forked nor saved."""
    if cache.rows != 1:
        raise ValueError(f"a snapshot is of one row, this cache has {cache.rows}")
    arrays: dict[str, mx.array] = {}
    for i, c in enumerate(cache.layers):
        if isinstance(c, SparseKVCache) and c.shared is not None:
            c.settle()
            s, n = c.shared, c.keys.lengths[0]
            own = [c.keys.data[:, :, :n], c.values.data[:, :, :n]]
            arrays[f"layers.{i}.keys"] = mx.concatenate([s.keys[:, :, : s.start], own[0]], axis=2)
            arrays[f"layers.{i}.values"] = mx.concatenate(
                [s.values[:, :, : s.start], own[1]], axis=2
            )
            for level, buf in enumerate(c.compressed):
                mine = buf.data[:, :, : buf.lengths[0]]
                arrays[f"layers.{i}.chunks{level}"] = mx.concatenate(
                    [s.chunk_view(level), mine], axis=2
                )
        else:
            arrays |= {f"layers.{i}.{name}": a for name, a in c.to_state().items()}
    meta = {
        "format_version": str(FORMAT_VERSION),
        "layer_kinds": json.dumps([c.kind for c in cache.layers]),
        "position": str(cache.offset),
        "prefill_len": str(cache.prefill_len),
    }
    copy = ModelCache.from_state(arrays, meta, cfg)
    mx.eval(*copy.arrays())
    return copy


class SeenPrompts:
    """Where recent prompts agree: the sha256 of every prompt's first k·`block` ids (as
    `prefix_digests` hashes them), for the last `most` such prefixes seen. A prompt that starts
    as an earlier one did, up to a point its own boundaries do not mark (a document in the user
    message before a long question, say), learns that point from `agreed`, and the engine
    snapshots there: the prompts after it that start the same way resume from it. Used by the
    engine thread only."""

    def __init__(self, block: int = SEEN_BLOCK, most: int = SEEN_MOST) -> None:
        self.block, self.most = block, most
        self._seen: OrderedDict[str, None] = OrderedDict()  # least recently seen first

    def agreed(self, ids: Sequence[int]) -> int:
        """The longest multiple of `block` below len(ids) at which `ids` starts as a prompt
        seen before did (0: none); then `ids`'s own prefixes are seen."""
        lengths = range(self.block, len(ids), self.block)
        digests = prefix_digests(ids, lengths)
        found = max((n for n in lengths if digests[n] in self._seen), default=0)
        for n in lengths:
            self._seen[digests[n]] = None
            self._seen.move_to_end(digests[n])
        while len(self._seen) > self.most:
            self._seen.popitem(last=False)
        return found


@dataclass(eq=False)
class Held:
    """One held prefix: `tokens` ids whose sha256 is `sha`, their one-row `cache`, and the
    logits [vocab] of its last position where known (a prefix prefilled here; not one read from
    disk), so that a prompt it holds whole can draw its first token without a prefill.
    `scores`: where a job that scored its prompt held it, its tokens' scores after the first
    ([tokens − 1, 1 + 2k] rows of `token_logprobs`, k alternatives each), so that a later
    scoring job resumes from it (the disk holds no scores)."""

    sha: str
    tokens: int
    cache: ModelCache
    logits: mx.array | None
    scores: np.ndarray | None = None
    users: int = 0  # running jobs whose rows fork it
    stored: bool = False  # the store holds it already (it was read from there, or written)

    @property
    def nbytes(self) -> int:
        extra = [x.nbytes for x in (self.logits, self.scores) if x is not None]
        return self.cache.nbytes + sum(extra)

    def scored(self, top: int) -> bool:
        """Whether a job scoring its prompt with `top` alternatives can resume from it: its
        scores hold as many, and its logits score the next token."""
        return (
            self.scores is not None
            and self.logits is not None
            and (self.scores.shape[1] - 1) // 2 >= top
        )


class HeldPrefixes:
    """The held prefixes of one model: `match` finds the longest a prompt starts with (memory,
    then the store), `hold` keeps a new one, `release` ends a job's use of the one it forked.
    `key(sha, tokens)` names a prefix in the store (model and tokenizer fingerprints, dtype).
    Used by the engine thread only."""

    def __init__(
        self,
        cap: int,
        cfg: ModelConfig,
        store: PrefixStore | None = None,
        key: Callable[[str, int], PrefixKey] | None = None,
    ) -> None:
        if store is not None and key is None:
            raise ValueError("a store needs a key function")
        self.cap, self.cfg, self.store, self.key = cap, cfg, store, key
        self.held: OrderedDict[str, Held] = OrderedDict()  # least recently used first
        self.lent: dict[str, Held] = {}  # evicted while rows read them
        self.held_bytes = 0
        self.hits_memory = self.hits_disk = self.misses = self.evictions = 0

    @property
    def lent_bytes(self) -> int:
        return sum(h.nbytes for h in self.lent.values())

    def match(
        self, ids: Sequence[int], boundaries: Iterable[int] = (), scored: int | None = None
    ) -> tuple[Held | None, str]:
        """The longest held prefix of `ids` (acquired: `release` it when its job ends) and
        where it came from: "memory", "disk" or "none" (no prefix, None). Lengths tried: those
        of the prefixes held, `boundaries` (the prompt's message ends) and those of the store's
        entries (this engine's, and another process's: a run's documents, which end inside
        their user message). A prefix as long as `ids` itself serves only with its logits (held
        in memory since its prefill). `scored`: for a job that scores its prompt with that many
        alternatives, only prefixes held with such scores (`Held.scored`: memory only)."""
        n = len(ids)
        mine = {h.tokens for h in (*self.held.values(), *self.lent.values())}
        store = self.store if scored is None else None
        stored = store.prefix_lengths() if store else frozenset()  # its own too
        on_disk = {t for t in (*boundaries, *stored) if 0 < t < n}
        lengths = {t for t in mine | on_disk | {n} if 0 < t <= n}
        digests = prefix_digests(ids, lengths)
        found = None
        for t in sorted(lengths, reverse=True):
            h = self.held.get(digests[t]) or self.lent.get(digests[t])
            if h is None or (t == n and h.logits is None) or not self._serves(h.cache, t, n):
                continue
            if scored is None or h.scored(scored):
                found = h
                break
        if store is not None:
            shortest = 0 if found is None else found.tokens
            for t in sorted((t for t in on_disk if shortest < t < n), reverse=True):
                key = self.key(digests[t], t)
                if not store.has(key):
                    continue
                cache = store.load(key, self.cfg)
                if cache is not None and self._serves(cache, t, n):
                    self.hits_disk += 1
                    return self.hold(digests[t], t, cache, None, use=True, stored=True), "disk"
        if found is None:
            self.misses += 1
            return None, "none"
        self.hits_memory += 1
        self._acquire(found)
        return found, "memory"

    def _serves(self, cache: ModelCache, tokens: int, n: int) -> bool:
        """Whether a prefix of `tokens` (its `cache`, prefilled for a prompt of
        `cache.prefill_len`) holds what one call over a prompt of `n` tokens computes over
        them: its sparse layers ran as that call runs them (dense below dense_len, InfLLM-v2
        from there, for the whole prompt: SPEC P7), or no position of it has more blocks than
        a query selects (the two modes agree)."""
        dense_len = self.cfg.sparse.dense_len
        sparse_then = max(cache.prefill_len, tokens) >= dense_len  # how it was computed
        sparse_now = n >= dense_len  # how the prompt's one call computes it
        return sparse_then == sparse_now or not self.cfg.splits_modes(tokens, dense_len)

    def hold(
        self,
        sha: str,
        tokens: int,
        cache: ModelCache,
        logits: mx.array | None,
        *,
        use: bool = False,
        stored: bool = False,
        scores: np.ndarray | None = None,
    ) -> Held:
        """Keeps `cache` (one row, no shared keys: never continue it after) as the prefix of
        `tokens` ids hashing to `sha`; `use`: acquired for the caller's job; `stored`: the store
        holds it already; `scores`: its tokens' (`Held.scores`). Evicts down to the cap. The
        prefix held already under `sha`, if one is, is kept instead, given these logits and
        scores where it lacks them (or holds fewer alternatives)."""
        held = self.held.get(sha) or self.lent.get(sha)
        if held is None:
            held = Held(sha, tokens, cache, logits, scores, stored=stored)
            self.held[sha] = held
            self.held_bytes += held.nbytes
        else:
            before = held.nbytes
            if held.logits is None:
                held.logits = logits
            if scores is not None and not held.scored((scores.shape[1] - 1) // 2):
                held.scores = scores
            if sha in self.held:
                self.held_bytes += held.nbytes - before
                self.held.move_to_end(sha)
        if use:
            held.users += 1
        self._evict()
        return held

    def release(self, held: Held) -> None:
        """A job that forked `held` ended; a lent prefix with no reader left is dropped."""
        held.users -= 1
        if held.users == 0 and self.lent.get(held.sha) is held:
            del self.lent[held.sha]

    def _acquire(self, held: Held) -> None:
        held.users += 1
        if held.sha in self.held:
            self.held.move_to_end(held.sha)

    def flush(self) -> int:
        """Writes every held prefix the store lacks (a server or chat closing, so the next one
        finds them); → how many were written. Most recently used first: a store over its
        budget keeps those."""
        if self.store is None:
            return 0
        written = 0
        for sha, held in reversed([*self.held.items(), *self.lent.items()]):
            if held.stored:
                continue
            key = self.key(sha, held.tokens)
            self.store.save(key, held.cache)  # a store that cannot be written warns once
            held.stored = self.store.has(key)
            written += held.stored
        return written

    def _evict(self) -> None:
        """Least recently used first, until the held bytes are within the cap."""
        while self.held_bytes > self.cap and self.held:
            sha, held = self.held.popitem(last=False)
            self.held_bytes -= held.nbytes
            self.evictions += 1
            if self.store is not None and not held.stored:
                key = self.key(sha, held.tokens)
                self.store.save(key, held.cache)  # a store that cannot be written warns once
                held.stored = self.store.has(key)
            if held.users > 0:
                self.lent[sha] = held
