"""The cache of one sparse (InfLLM-v2) layer, for a batch of rows that may hold shared keys.

Row b's sequence is `shared` (positions [0, start), stored once for all rows) followed by its own
positions in `keys`/`values` ([B, Hk, capacity, d], row b filled to `keys.lengths[b]`). `start`
is a multiple of the block, so each block lies wholly in one part; a compressed chunk is either
the shared document's or one the row computed from its own keys (all at or after `start`).
`KVView` is what attention reads. The block and the compression levels are `SparseConfig`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from salabatch.engine.config import SPARSE, ModelConfig, SparseConfig
from salabatch.engine.kernels.sparse_attention import KVView


def capacity(tokens: int) -> int:
    """Buffer room for `tokens` positions: a multiple of 128 (whole blocks and level-2 strides)
    up to 1024, then geometric in quarter steps (1280, 1536, 1792, 2048, 2560, ...). Buffer
    shapes are what a compiled decode step is traced for, so they take few values: documents of
    similar lengths share one shape, and at most 25 % of a long buffer is spare."""
    if tokens <= 1024:
        return max(128, -(-tokens // 128) * 128)
    quarter = 1 << (tokens.bit_length() - 3)
    return -(-tokens // quarter) * quarter


class RowBuffer:
    """[B, Hk, capacity, d] storage where row b holds `lengths[b]` entries. An entry is one
    position (keys, values) or one compressed chunk every `stride` positions; a chunk buffer
    keeps one spare entry past its chunks, which a decode step writes when no chunk completes."""

    def __init__(
        self, data: mx.array | None = None, lengths: Sequence[int] = (), stride: int = 1
    ) -> None:
        self.data = data
        self.lengths = list(lengths)
        self.stride = stride

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def room(self, tokens: int) -> int:
        """Entries for `tokens` positions."""
        return capacity(tokens) // self.stride + (self.stride > 1)

    def reserve(self, tokens: int, like: mx.array, dtype: mx.Dtype | None = None) -> None:
        """Grows (never shrinks) to `room(tokens)` entries; a new buffer is [B, Hk, ·, d] as
        `like`, in `dtype` (default like's)."""
        cap = 0 if self.data is None else self.data.shape[2]
        want = self.room(tokens)
        if want <= cap:
            return
        ref = like if self.data is None else self.data
        B, Hk, _, d = ref.shape
        grown = mx.zeros((B, Hk, want, d), dtype or ref.dtype if self.data is None else ref.dtype)
        if cap:
            grown[..., :cap, :] = self.data
        self.data = grown

    def _reserve(self, like: mx.array, end: int) -> None:
        self.reserve(end * self.stride, like)

    def append(self, x: mx.array) -> None:
        """Adds x [B, Hk, T, d]: T positions to every row, each at its own length."""
        if not self.lengths:
            self.lengths = [0] * x.shape[0]
        T = x.shape[2]
        self._reserve(x, max(self.lengths) + T)
        if len(set(self.lengths)) == 1:
            n = self.lengths[0]
            self._write((..., slice(n, n + T), slice(None)), x)
        else:  # each row at its own length: one scatter of [B, T] positions
            rows = mx.arange(len(self.lengths))[:, None]
            at = mx.array(self.lengths)[:, None] + mx.arange(T)
            self.data[rows, :, at] = x.swapaxes(1, 2)  # indexed [B, T, Hk, d]
        self.lengths = [n + T for n in self.lengths]

    def append_rows(self, parts: Sequence[mx.array | None]) -> None:
        """Adds parts[b] [1, Hk, t_b, d] to row b (None: nothing)."""
        sized = [p for p in parts if p is not None and p.shape[2]]
        if not sized:
            return
        ends = [
            n + (0 if p is None else p.shape[2]) for n, p in zip(self.lengths, parts, strict=True)
        ]
        self._reserve(sized[0], max(ends))
        for b, p in enumerate(parts):
            if p is not None and p.shape[2]:
                self._write((slice(b, b + 1), slice(None), slice(self.lengths[b], ends[b])), p)
        self.lengths = ends

    def _write(self, where: tuple, x: mx.array) -> None:
        """data[where] = x, data kept row-contiguous. A write of the whole buffer (a prompt of
        exactly its capacity) makes x itself the buffer, as MLX's slice update returns the
        update then: a strided view where x is (keys [B, T, Hk, d] transposed to [B, Hk, T, d]),
        which the native CPU decode step cannot read in place (a fork's shared keys, at every
        step), so it is copied, once."""
        self.data[where] = x
        if x.shape == self.data.shape:
            self.data = mx.contiguous(self.data)

    def view(self, length: int | None = None) -> mx.array:
        """Positions [0, length) of every row (default: the longest row's length)."""
        return self.data[..., : max(self.lengths, default=0) if length is None else length, :]

    def select(self, rows: Sequence[int]) -> RowBuffer:
        data = None if self.data is None else self.data[mx.array(list(rows))]
        return RowBuffer(data, [self.lengths[b] for b in rows], self.stride)

    @staticmethod
    def concat(buffers: Sequence[RowBuffer]) -> RowBuffer:
        """Rows of all buffers, in order; capacities are padded to the largest."""
        lengths = [n for buf in buffers for n in buf.lengths]
        stride = buffers[0].stride
        filled = [buf for buf in buffers if buf.data is not None]
        if not filled:
            return RowBuffer(None, lengths, stride)
        cap = max(buf.data.shape[2] for buf in filled)
        ref = filled[0].data
        parts = []
        for buf in buffers:
            data = buf.data
            if data is None:
                data = mx.zeros((buf.rows, ref.shape[1], cap, ref.shape[3]), ref.dtype)
            elif data.shape[2] < cap:
                data = mx.pad(data, [(0, 0), (0, 0), (0, cap - data.shape[2]), (0, 0)])
            parts.append(data)
        return RowBuffer(mx.concatenate(parts, axis=0), lengths, stride)

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.nbytes


@dataclass(frozen=True)
class SharedKeys:
    """The shared keys of forked rows: positions [0, start) common to all rows (start a multiple
    of the block): the document's key/value buffers [1, Hk, capacity ≥ start, d], read only up
    to `start` and never copied, and, per compression level, the document's chunk buffers
    [1, Hk, capacity, d] of which the first `counts[level]` chunks (those wholly inside the
    document) are shared. Whole buffers, so their shapes are the document's capacities."""

    keys: mx.array
    values: mx.array
    start: int
    chunks: tuple[mx.array, ...]
    counts: tuple[int, ...]

    def chunk_view(self, level: int) -> mx.array:
        """The shared chunks of one level, [1, Hk, counts[level], d]."""
        return self.chunks[level][:, :, : self.counts[level]]

    @property
    def nbytes(self) -> int:
        held = 2 * self.keys.nbytes * self.start // self.keys.shape[2]
        return held + sum(
            a.nbytes * n // a.shape[2] for a, n in zip(self.chunks, self.counts, strict=True)
        )


class SparseKVCache:
    """One sparse layer: un-rotated keys/values and their compressed keys, shared part + rows.

    Compressed keys are kept for every complete chunk of each level of `sparse.compression`
    (level 1: mean of 32 keys every 16, level 2: 128 every 64), summed in float32 and stored in
    the keys' dtype (as HF's mean pooling of bf16 keys gives bf16). They are extended on
    every append from the new keys only, so a decode step never recompresses the history
    (SPEC §4.4). Keys, values and chunks grow together (`reserve`): their capacities are one
    function of the tokens held, planned for a whole prompt at once.

    Batches: `fork` turns a one-row cache (a prefilled document) into rows over one
    `SharedKeys`; `select` and `concat` keep or join rows. A batch reads its shared keys from one
    set of arrays (the kernels take a single shared part for all rows), so rows can be joined
    only when they hold the same `SharedKeys` object, or none. `fork` keeps that true over
    time: it builds the shared keys once per length of the document and gives that object to every
    fork made at that length (the Generator forks the document once per admitted request).
    """

    kind = SPARSE  # the layer kind it caches (config.SPARSE), also its name in a saved cache

    def __init__(self, sparse: SparseConfig, shared: SharedKeys | None = None) -> None:
        self.sparse = sparse
        self.shared = shared
        self.keys, self.values = RowBuffer(), RowBuffer()
        self.compressed = tuple(RowBuffer(stride=stride) for _, stride in sparse.compression)
        self.prefill_len = 0  # planned prompt length (ModelCache.plan_prefill)
        self.trace: list[mx.array] | None = None  # set to a list to record block selections
        self.stepwise = False  # queries attend one at a time, as decode steps (a verify pass)
        self._forked: tuple[int, SharedKeys] | None = None  # (length, shared keys) given to forks

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> SparseKVCache:
        return cls(cfg.sparse)

    @property
    def start(self) -> int:
        return 0 if self.shared is None else self.shared.start

    @property
    def lengths(self) -> list[int]:
        """Tokens in each row's sequence."""
        return [self.start + n for n in self.keys.lengths]

    @property
    def length(self) -> int:
        """Tokens in the sequence when every row has the same number (else an error)."""
        lengths = set(self.lengths)
        if len(lengths) != 1:
            raise ValueError(f"rows have different lengths: {sorted(lengths)}")
        return lengths.pop()

    def shared_chunks(self, level: int) -> int:
        return 0 if self.shared is None else self.shared.counts[level]

    def reserve(self, tokens: int, like: mx.array) -> None:
        """Room for `tokens` own positions per row in the keys, values and chunk buffers (like:
        a key array [B, Hk, ·, d] giving the rows, heads, width and dtype)."""
        self.keys.reserve(tokens, like)
        self.values.reserve(tokens, like)
        for buf in self.compressed:
            buf.reserve(tokens, like)

    def append(self, k: mx.array, v: mx.array) -> None:
        """Adds k, v [B, Hk, T, d] to every row, then compresses the chunks they complete.
        A planned prompt (`prefill_len`) reserves its whole length at its first chunk."""
        if not self.keys.lengths:
            for buf in (self.keys, self.values, *self.compressed):
                buf.lengths = [0] * k.shape[0]
        end = max(max(self.lengths) + k.shape[2], self.prefill_len)
        self.reserve(end - self.start, k)
        self.keys.append(k)
        self.values.append(v)
        for level, (size, stride) in enumerate(self.sparse.compression):
            self._compress(level, size, stride)

    def _compress(self, level: int, size: int, stride: int) -> None:
        buf, base, start = self.compressed[level], self.shared_chunks(level), self.start
        have = [base + n for n in buf.lengths]
        total = [max(0, (n - size) // stride + 1) for n in self.lengths]
        if all(t <= h for t, h in zip(total, have, strict=True)):
            return

        def means(rows: slice, first: int, last: int) -> mx.array:
            # chunk j = mean(k[stride·j : stride·j + size]), size = 2·stride: sum stride-groups
            span = self.keys.data[rows, :, stride * first - start : stride * (last + 1) - start]
            groups = span.astype(mx.float32).reshape(*span.shape[:2], last - first + 1, stride, -1)
            sums = groups.sum(axis=3)
            return ((sums[:, :, :-1] + sums[:, :, 1:]) / size).astype(span.dtype)

        if len(set(have)) == 1 and len(set(total)) == 1:
            buf.append(means(slice(None), have[0], total[0]))
        else:
            buf.append_rows(
                [
                    means(slice(b, b + 1), h, t) if t > h else None
                    for b, (h, t) in enumerate(zip(have, total, strict=True))
                ]
            )

    def truncate(self, lengths: Sequence[int]) -> None:
        """Keeps each row's first lengths[b] own positions (≤ what it holds) and the compressed
        chunks wholly inside them: the later entries are left as spare room."""
        if any(n > h for n, h in zip(lengths, self.keys.lengths, strict=True)):
            raise ValueError(f"cannot keep {list(lengths)} of {self.keys.lengths} positions")
        self.keys.lengths, self.values.lengths = list(lengths), list(lengths)
        self.stepwise = False
        for level, (size, stride) in enumerate(self.sparse.compression):
            buf, base = self.compressed[level], self.shared_chunks(level)
            whole = [max(0, (self.start + n - size) // stride + 1) - base for n in lengths]
            buf.lengths = [min(h, w) for h, w in zip(buf.lengths, whole, strict=True)]

    def kv_view(self, ahead: int = 0) -> KVView:
        """Keys/values as attention reads them: whole buffers (capacities are multiples of the
        block), valid up to each row's length (but its last `ahead` positions)."""
        shared = self.shared
        return KVView(
            None if shared is None else shared.keys,
            None if shared is None else shared.values,
            self.start,
            self.keys.data,
            self.values.data,
            tuple(n - ahead for n in self.lengths),
        )

    def chunk_parts(self, level: int, whole: bool = False) -> tuple[mx.array, ...]:
        """Compressed keys of one level: (shared [1, Hk, n, d],) + (rows [B, Hk, m, d],); with
        `whole`, the rows' whole buffer (chunks past a row's count hold anything)."""
        self.settle()
        buf = self.compressed[level]
        rows = buf.data if whole else buf.view()
        return (rows,) if self.shared is None else (self.shared.chunk_view(level), rows)

    def arrays(self) -> list[mx.array]:
        """The arrays of its rows (the shared keys are the document's)."""
        return [b.data for b in (self.keys, self.values, *self.compressed) if b.data is not None]

    # -- the compiled decode step (salabatch.engine.decode) ------------------------------------
    def step_arrays(self) -> tuple[mx.array, mx.array]:
        """The rows' buffers a decode step reads and rewrites: keys, values [B, Hk, R, d]. It
        sums the rows' compressed keys afresh from their keys; the chunk buffers catch up at
        the next `settle` (any append, fork, save or read of the chunks)."""
        return self.keys.data, self.values.data

    def shared_arrays(self) -> tuple[mx.array, ...]:
        """The shared keys a decode step reads: keys, values [1, Hk, S, d], then each level's
        chunk buffer; () without shared keys."""
        shared = self.shared
        return () if shared is None else (shared.keys, shared.values, *shared.chunks)

    def stepped(self, arrays: Sequence[mx.array]) -> None:
        """Takes a decode step's rewritten keys and values: one more position in every row."""
        self.keys.data, self.values.data = arrays
        self.keys.lengths = [n + 1 for n in self.keys.lengths]
        self.values.lengths = list(self.keys.lengths)

    def settle(self) -> None:
        """Compresses the chunks that decode steps completed (a no-op when none did)."""
        if self.keys.data is not None:
            for level, (size, stride) in enumerate(self.sparse.compression):
                self._compress(level, size, stride)

    # -- batches -------------------------------------------------------------------------------
    def fork(self, n: int) -> SparseKVCache:
        """n rows continuing this one-row cache, over its `SharedKeys`: its positions up to
        the last whole level-2 chunk's start (stored once, a view of this cache's buffers), the
        rest (< 128 keys) copied per row.

        Every fork made while this cache holds the same number of tokens gets the same
        `SharedKeys` object, so forks made one at a time can be concatenated; after an append,
        forks get new shared keys and cannot join rows forked before it.
        """
        if self.shared is not None or self.keys.rows != 1:
            raise ValueError("only a one-row cache without shared keys can be forked")
        self.settle()
        length = self.length
        counts = tuple(buf.lengths[0] for buf in self.compressed)
        # the level-2 stride is the block: 64 · N2 is block aligned and ≤ every row's own chunk
        start = self.sparse.compression[1][1] * counts[1]
        if self._forked is None or self._forked[0] != length:
            chunks = tuple(buf.data for buf in self.compressed)
            shared = SharedKeys(self.keys.data, self.values.data, start, chunks, counts)
            self._forked = (length, shared)
        out = SparseKVCache(self.sparse, self._forked[1])
        keys, values = (
            mx.repeat(b.data[:, :, start:length], n, axis=0) for b in (self.keys, self.values)
        )
        for buf in (out.keys, out.values, *out.compressed):
            buf.lengths = [0] * n
        out.reserve(length - start, keys)
        out.keys.append(keys)
        out.values.append(values)
        return out

    def select(self, rows: Sequence[int]) -> SparseKVCache:
        """These rows, in this order, over the same shared keys (so they can join its other
        forks again)."""
        out = SparseKVCache(self.sparse, self.shared)
        out.keys, out.values = self.keys.select(rows), self.values.select(rows)
        out.compressed = tuple(buf.select(rows) for buf in self.compressed)
        return out

    @staticmethod
    def concat(caches: Sequence[SparseKVCache]) -> SparseKVCache:
        """All rows of `caches`, in order. They must hold the same `SharedKeys` object (forks
        of one document at one length, and selections and concatenations of those) or none (each
        row its own whole sequence); rows may be at different lengths."""
        shared = caches[0].shared
        if any(c.shared is not shared for c in caches):
            raise ValueError("rows of one batch must hold the same shared keys")
        out = SparseKVCache(caches[0].sparse, shared)
        out.keys = RowBuffer.concat([c.keys for c in caches])
        out.values = RowBuffer.concat([c.values for c in caches])
        out.compressed = tuple(
            RowBuffer.concat([c.compressed[i] for c in caches]) for i in range(len(out.compressed))
        )
        return out

    # -- serialization -------------------------------------------------------------------------
    def to_state(self, since: int = 0) -> dict[str, mx.array]:
        """The arrays of a one-row cache without shared keys, cut to their lengths:
        `keys`, `values` [1, Hk, n, d] and `chunks{level}` [1, Hk, N_level, d]; with `since`,
        those of the tokens from position `since` on (the chunks completed since)."""
        if self.shared is not None or self.keys.rows != 1:
            raise ValueError("only a one-row cache without shared keys can be saved")
        self.settle()
        n = self.keys.lengths[0]
        keys, values = self.keys.data[:, :, since:n], self.values.data[:, :, since:n]
        state = {"keys": keys, "values": values}
        for level, buf in enumerate(self.compressed):
            first = chunk_count(self.sparse.compression[level], since)
            state[f"chunks{level}"] = buf.data[:, :, first : buf.lengths[0]]
        return state

    @staticmethod
    def joined(parts: Sequence[dict[str, mx.array]]) -> dict[str, mx.array]:
        """The state of consecutive parts (`to_state(since=)` each): each array's rows in
        order."""
        return {name: mx.concatenate([p[name] for p in parts], axis=2) for name in parts[-1]}

    @classmethod
    def from_state(
        cls, state: dict[str, mx.array], position: int, cfg: ModelConfig
    ) -> SparseKVCache:
        """The inverse of `to_state` for a sequence of `position` tokens: KeyError for a missing
        array, ValueError for one of the wrong size. The buffers get the capacities a live
        cache of this length has (forks read the keys as a table of blocks)."""
        cache = cls(cfg.sparse)
        keys, values = state["keys"], state["values"]
        if keys.shape[2] != position or values.shape != keys.shape:
            raise ValueError(f"holds {keys.shape[2]} keys for position {position}")
        chunks = [state[f"chunks{level}"] for level in range(len(cache.compressed))]
        for level, got in zip(cfg.sparse.compression, chunks, strict=True):
            if got.shape[2] != chunk_count(level, position):
                raise ValueError(f"has {got.shape[2]} compressed chunks")
        cache.reserve(position, keys)
        bufs = (cache.keys, cache.values, *cache.compressed)
        for buf, a in zip(bufs, (keys, values, *chunks), strict=True):
            buf.lengths = [0]
            buf.append(a)
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds for its rows (the shared keys are counted by `shared_nbytes`)."""
        return sum(b.nbytes for b in (self.keys, self.values, *self.compressed))

    @property
    def shared_nbytes(self) -> int:
        return 0 if self.shared is None else self.shared.nbytes


def chunk_count(level: tuple[int, int], position: int) -> int:
    """Complete chunks of a compression level (size, stride) in the first `position` tokens."""
    size, stride = level
    return max(0, (position - size) // stride + 1)


def write_step(
    arrays: Sequence[mx.array], k: mx.array, v: mx.array, at: mx.array
) -> tuple[mx.array, mx.array]:
    """Inside a compiled decode step: the rows' (keys, values) [B, Hk, R, d]
    (`SparseKVCache.step_arrays`) with k, v [B, Hk, 1, d] written at each row's own place
    at [B] (its position past the shared keys)."""
    at = at[:, None, None, None]
    keys, values = arrays
    return mx.put_along_axis(keys, at, k, axis=2), mx.put_along_axis(values, at, v, axis=2)
