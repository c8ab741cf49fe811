"""InfLLM-v2 stage 2: each query attends to its selected key blocks only (SPEC §4.3 E).

Layout:
  q       [B, H, T, d]    queries; query head h reads kv head h // G (G = H / Hk)
  kv      KVView          row b's keys/values: a shared part [1, Hk, S, d] (S a multiple of the
                          block; may be absent) then the row's own [B, Hk, R, d] (R a multiple of
                          the block; positions past a row's length hold anything: causality
                          masks them)
  idx     [B, Hk, T, K]   selected block ids per query (-1 = none), shared by a kv group
  q_pos   [B, T] int32    absolute position of each query
  block   int             tokens per key block (`SparseConfig.block_size`, 64)
  →       [B, H, T, d]    in q's dtype

Query t attends to key j iff block(j) is in idx[.., t, :] and j ≤ q_pos[t].

The fast paths gather, on the device, the K selected blocks of every query (fixed K, -1 slots
padded and masked), so their cost grows with K, not with the context, and nothing depends on the
values of the selection: no host round trip, the same op graph for every prompt of a shape. On
the CPU, queries go in tiles whose gathered keys stay under MAX_GATHER_BYTES. On the GPU path
(`block_sparse_attention_gpu`), while the keys are few (MASKED_KEYS), a query tile is instead
one fused SDPA over every key with the selection as an additive mask: a GPU's fused attention
over all of them costs less there than the gathers (measured on an H200).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from salabatch.engine.kernels import stage2_cuda
from salabatch.engine.kernels.attention import (
    LOG2E,
    attention,
    attention_ref,
    exp2,
    gather_products,
    grouped_scores,
    in_turn,
    lanes,
    on_gpu,
    tile_rows,
)
from salabatch.engine.runtime import dtype_name

# Bound on the keys + values one query tile gathers (bytes). MLX keeps about ten tiles in
# flight, so this sets the transient memory of a sparse layer (~0.7 GB at 32K).
MAX_GATHER_BYTES = 1 << 25
# Bound on the [B, H, rows, keys] float32 score tile of `_scored` (elements).
MAX_SCORE_ELEMENTS = 1 << 24
# `_scored` while the keys before a tile are at most this many per selected key slot: past
# that, scoring every key costs more than gathering the selected ones (CPU: 7.3 → 9.6 ns per
# selected score from 8K to 28K keys, gathered 16 ns; lanes on, one BLAS thread).
SCORED_KEYS_PER_SLOT = 16
# `_scored` reads keys up to a multiple of this: tiles and chunks then share buffer shapes, so
# MLX reuses its cached buffers instead of faulting in fresh memory for every tile.
KEY_BUCKET = 4096
# GPU path: while a query tile's keys (rounded up to MASKED_BUCKET) are at most this many, stage
# 2 is one fused SDPA over all of them with the selection as an additive mask (`_masked_tile`);
# beyond, each query's blocks are gathered (`_sparse_tile`). Timed on an H200 (2026-11-28,
# `device-profile.py`: 9B shapes, bf16, one 8K chunk a layer): the masked form 14.4 ms at 32K
# keys and 53.5 at 128K (~0.41 ms more a 1K keys), the gathers 37.6 and 39.8: they cross near
# 92K keys.
MASKED_KEYS = 88 * 1024
# With the stage-2 kernel on (`stage2_cuda`, CUDA), rows with their own keys take it past this
# many keys (as the masked form reads them), the masked form up to it: the kernel took 18.5-19.3
# ms at 32K and at 128K on the same H200, flat with the context, where the masked form grows
# as above: they cross near 45K keys.
STAGE2_KERNEL_KEYS = 40 * 1024
# The masked form's keys are a multiple of this (the mask hides the rest): its SDPA and mask
# shapes, and so cuDNN's built graphs, repeat across chunks and documents.
MASKED_BUCKET = 8192


@dataclass(frozen=True)
class KVView:
    """What attention reads. Row b's sequence is the shared keys, positions [0, start) of
    `shared_k` ([1, Hk, capacity, d], or None when start is 0), followed by `rows_k[b]`
    ([B, Hk, R, d], R a multiple of the block): `lengths[b]` positions in all. Buffers are
    passed whole (never sliced and copied); positions past a row's length hold anything."""

    shared_k: mx.array | None
    shared_v: mx.array | None
    start: int
    rows_k: mx.array
    rows_v: mx.array
    lengths: tuple[int, ...]

    def parts(self, end: int | None = None) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """Positions [0, end) (default: the longest row) as attention's parts: (shared, rows),
        or (rows,) without shared keys."""
        end = max(self.lengths) if end is None else end
        own = end - self.start
        rows = (self.rows_k[:, :, :own], self.rows_v[:, :, :own])
        if not self.start:
            return (rows[0],), (rows[1],)
        shared = (self.shared_k[:, :, : self.start], self.shared_v[:, :, : self.start])
        return (shared[0], rows[0]), (shared[1], rows[1])

    def full(self) -> tuple[mx.array, mx.array]:
        """Each row's whole key/value sequence [B, Hk, N, d] (the shared part copied per row)."""
        B = self.rows_k.shape[0]
        keys, values = self.parts()
        return tuple(
            mx.concatenate([mx.broadcast_to(p, (B, *p.shape[1:])) for p in parts], axis=2)
            for parts in (keys, values)
        )

    def slice(self, a: int, b: int) -> KVView:
        """Rows a..b−1 (views, no copy)."""
        return KVView(
            self.shared_k,
            self.shared_v,
            self.start,
            self.rows_k[a:b],
            self.rows_v[a:b],
            self.lengths[a:b],
        )

    def take(self, rows: Sequence[int]) -> KVView:
        idx = mx.array(list(rows))
        return KVView(
            self.shared_k,
            self.shared_v,
            self.start,
            self.rows_k[idx],
            self.rows_v[idx],
            tuple(self.lengths[b] for b in rows),
        )


def block_sparse_attention_ref(
    q: mx.array, kv: KVView, idx: mx.array, starts: Sequence[int], scale: float, block: int
) -> mx.array:
    """Reference: a float32 masked softmax over each row's whole sequence (O(T·N) memory)."""
    keys, values = kv.full()
    B, H, T, d = q.shape
    N, Hk = keys.shape[2], keys.shape[1]
    q_pos = _positions(starts, T)
    chosen = (idx[..., None] == mx.arange(N) // block).any(axis=-2)  # [B, Hk, T, N]
    causal = mx.arange(N) <= q_pos[:, None, :, None]
    allowed = mx.repeat(chosen & causal, H // Hk, axis=1)  # [B, H, T, N]
    return attention_ref(q, keys, values, scale, allowed)


def block_sparse_attention(
    q: mx.array, kv: KVView, idx: mx.array, starts: Sequence[int], scale: float, block: int
) -> mx.array:
    """The dispatcher; row b's queries sit at starts[b] + 0..T-1. On the GPU path,
    `block_sparse_attention_gpu`. On the CPU, query tiles alternate lanes and each takes the
    cheapest exact path:

    * `_causal`: every query of the tile sits in a block below K, so its K slots hold every
      block up to its own (top-k of fewer candidates than slots): plain causal attention;
    * `_scored`: while the keys before the tile are at most SCORED_KEYS_PER_SLOT per slot;
    * `_gathered`: otherwise, and for fewer queries than a block (decode).
    """
    if on_gpu():
        return block_sparse_attention_gpu(q, kv, idx, starts, scale, block)
    B, H, T, d = q.shape
    Hk, K = kv.rows_k.shape[1], idx.shape[-1]
    q_pos = _positions(starts, T)
    qg = q.reshape(B, Hk, H // Hk, T, d).transpose(0, 1, 3, 2, 4)  # [B, Hk, T, G, d]
    first = max(starts)
    per_query = B * Hk * K * block * d * kv.rows_k.itemsize  # one gathered K or V
    gather_rows = max(1, MAX_GATHER_BYTES // (2 * per_query))
    dense_rows = K * block - first  # queries before position K·block
    # one row count for every scored tile of the call, so their buffers are reused
    score_rows = min(MAX_SCORE_ELEMENTS // (B * H * (first + T)), MAX_GATHER_BYTES // per_query)
    score_rows = max(1, score_rows)
    capacity = kv.start + kv.rows_k.shape[2]
    outs, s = [], 0
    lane = lanes()
    while s < T:
        with mx.stream(lane[len(outs) % len(lane)]):
            if s < dense_rows:
                e = min(T, dense_rows)
                o = _causal(in_turn(q[:, :, s:e], outs), kv, starts, s, scale)
            elif T - s >= block and first + s <= SCORED_KEYS_PER_SLOT * K * block:
                e = min(T, s + score_rows)
                end = min(capacity, -(-(first + e) // KEY_BUCKET) * KEY_BUCKET)
                qt = in_turn(qg[:, :, s:e], outs)
                o = _scored(qt, kv, idx[:, :, s:e], q_pos[:, s:e], scale, block, end)
            else:
                e = min(T, s + gather_rows)
                qt = in_turn(qg[:, :, s:e], outs)
                o = _gathered(qt, kv, idx[:, :, s:e], q_pos[:, s:e], scale, block)
        outs.append(o)
        s = e
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)  # [B, H, T, d]
    return o


def block_sparse_attention_gpu(
    q: mx.array, kv: KVView, idx: mx.array, starts: Sequence[int], scale: float, block: int
) -> mx.array:
    """GPU path. Queries whose slots hold every block before them (the first K blocks of a
    sequence) take fused causal attention. The rest, in query tiles sized by the device's tile
    budget: while their keys are few (MASKED_KEYS, rows with their own keys only), one fused
    SDPA over every key with the selection as an additive mask (`_masked_tile`); else
    `mx.gather_mm` reads each query's selected blocks in place from the cache (no copy of keys
    or values), the G heads of a kv head as the rows of one small matmul per block, scores in
    q's dtype, softmax in float32, tiles the same at every context (`_sparse_tile`). On CUDA
    with the stage-2 kernel on (`stage2_cuda`, a default), rows with their own keys only send
    all their queries to it in one call once their keys pass STAGE2_KERNEL_KEYS."""
    B, H, T, d = q.shape
    Hk, K = kv.rows_k.shape[1], idx.shape[-1]
    G = H // Hk
    dense = min(T, max(0, K * block - max(starts)))
    outs = []  # [B, t, H, d] each
    if dense:
        outs.append(_causal(q[:, :, :dense], kv, starts, 0, scale).transpose(0, 2, 1, 3))
    keys = _masked_keys(kv, max(starts) + T)
    own = dense < T and kv.start == 0  # rows with their own keys only
    kernel = own and keys > STAGE2_KERNEL_KEYS and stage2_cuda.available()
    if kernel and stage2_cuda.supports(q, G, block):
        first = mx.array([s + dense for s in starts], dtype=mx.int32)
        o = stage2_cuda.attend(
            q[:, :, dense:].transpose(0, 2, 1, 3), kv.rows_k, kv.rows_v, idx[:, :, dense:], first,
            scale, block,
        )  # fmt: skip
        outs.append(o)
    elif own and keys <= MASKED_KEYS:
        # per query: its row of the mask (bool, then q's dtype), the scores of the SDPA's tiles
        step = tile_rows(Hk * keys * (1 + 2 * q.dtype.size), T - dense)
        for s in range(dense, T, step):
            e = min(T, s + step)
            qt = in_turn(q[:, :, s:e], outs)
            o = [
                _masked_tile(qt[b : b + 1], kv, b, idx[b, :, s:e], starts[b] + s, scale, block)
                for b in range(B)
            ]
            outs.append(mx.concatenate(o) if B > 1 else o[0])
    elif dense < T:
        # [B·T·Hk, G, d]: one query's G heads per row; a view when q is the projection's output
        table = q.transpose(0, 2, 1, 3).reshape(B * T * Hk, G, d)
        rows = mx.arange(B * T * Hk, dtype=mx.uint32).reshape(B, T, Hk, 1)
        sel = idx.transpose(0, 2, 1, 3)  # [B, T, Hk, K]
        q_pos = _positions(starts, T)
        parts = _block_tables(kv, block)
        # per query: scores and weights of K·block keys for each of H heads, and K partial outputs
        # (each query adds Hk·K entries per row to the gather_mm batches)
        row_bytes = H * K * (block * (3 * q.dtype.size + 4) + 2 * d * q.dtype.size)
        step = tile_rows(row_bytes, T, batched=B * Hk * K)
        for s in range(dense, T, step):
            e = min(T, s + step)
            at = in_turn(rows[:, s:e], outs)  # the tile's queries: what its gathers read
            o = _sparse_tile(table, at, parts, sel[:, s:e], q_pos[:, s:e], (scale, block))
            outs.append(o.reshape(B, e - s, H, d))
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)  # [B, T, H, d]
    return o.transpose(0, 2, 1, 3)


def _masked_tile(q, kv: KVView, b: int, idx, first: int, scale: float, block: int) -> mx.array:
    """Row b's queries q [1, H, t, d] at positions first.. attending their blocks idx [Hk, t, K]
    as one fused SDPA over the row's keys up to the last query, rounded up to MASKED_BUCKET (at
    most its buffer): kv heads as the SDPA's batch, each one's G query heads sharing its mask,
    0 where the key's block is selected and the key is not after the query, −inf elsewhere
    (every query keeps its own key) → [1, t, H, d]."""
    _, H, t, d = q.shape
    Hk = idx.shape[0]
    keys = _masked_keys(kv, first + t)
    # Additive, made here: the dispatcher's boolean mask would reach CUDA's SDPA converted at
    # the full [Hk, G, t, keys] (G times this)
    dtype = dtype_name(q.dtype)  # a compile constant: the dtype's name
    mask = _additive_mask(idx, mx.array(first, dtype=mx.int32), (keys, block, dtype))
    k = kv.rows_k[b : b + 1, :, :keys].transpose(1, 0, 2, 3)  # [Hk, 1, keys, d]: a view
    v = kv.rows_v[b : b + 1, :, :keys].transpose(1, 0, 2, 3)
    o = mx.fast.scaled_dot_product_attention(
        q.reshape(Hk, H // Hk, t, d), k, v, scale=scale, mask=mask
    )
    return o.reshape(1, H, t, d).transpose(0, 2, 1, 3)


def _masked_keys(kv: KVView, end: int) -> int:
    """Keys the masked form reads for queries ending at `end`: rounded up to MASKED_BUCKET,
    at most the rows' buffer."""
    return min(kv.rows_k.shape[2], -(-end // MASKED_BUCKET) * MASKED_BUCKET)


@mx.compile
def _additive_mask(idx: mx.array, first: mx.array, settings) -> mx.array:
    """idx [Hk, t, K] (-1: none) of queries at first + 0..t-1 → [Hk, 1, t, keys] in the dtype
    named: 0 where the key's block is selected and the key is not after the query, -inf
    elsewhere. One kernel writes it, block by block (then viewed key by key), from the
    selection as [Hk, t, blocks] flags. `first` is data: one trace per shape, not per chunk."""
    keys, block, dtype = settings
    Hk, t, _ = idx.shape
    blocks = -(-keys // block)
    spare = mx.where(idx < 0, blocks, idx)  # -1 slots mark a spare column, dropped
    chosen = mx.zeros((Hk, t, blocks + 1), dtype=mx.bool_)
    chosen = mx.put_along_axis(chosen, spare, mx.array(True), axis=-1)[..., :blocks, None]
    q_pos = (first + mx.arange(t, dtype=mx.int32))[:, None, None]  # [t, 1, 1]
    key = mx.arange(blocks * block, dtype=mx.int32).reshape(blocks, block)
    mask = mx.where(chosen & (key <= q_pos), 0.0, -mx.inf).astype(getattr(mx, dtype))
    return mask.reshape(Hk, 1, t, blocks * block)[..., :keys]


def _block_tables(kv: KVView, block: int) -> list[tuple[mx.array, ...]]:
    """The cache as tables of blocks for `gather_mm`, one per part of the sequence: (keys,
    values [n, block, d], base [B, 1, Hk, 1] the table row of the part's first block for each
    (row, kv head), span int32 [2]: the block ids [first, end) the part holds). Spans are data,
    not compile constants: forks of every document run the same kernels."""
    B, Hk, R, d = kv.rows_k.shape
    heads = mx.arange(Hk, dtype=mx.uint32)
    own = (mx.arange(B, dtype=mx.uint32)[:, None] * Hk + heads) * (R // block)
    S = kv.start // block
    parts = [(kv.rows_k, kv.rows_v, own, (S, 1 << 30))]
    if S:  # rows forked from one document: its blocks from the shared buffers
        shared = mx.broadcast_to(heads * (kv.shared_k.shape[2] // block), (B, Hk))
        parts.insert(0, (kv.shared_k, kv.shared_v, shared, (0, S)))
    return [
        (k.reshape(-1, block, d), v.reshape(-1, block, d), base[:, None, :, None], mx.array(span))
        for k, v, base, span in parts
    ]


@mx.compile
def _sparse_tile(table, rows, parts, idx, q_pos, settings):
    """Queries rows [B, t, Hk, 1] of table [P, G, d], their blocks idx [B, t, Hk, K] (-1: none)
    at positions q_pos [B, t] → [B, t, Hk, G, d] in q's dtype."""
    scale, block = settings
    B, t, Hk, K = idx.shape
    G = table.shape[1]
    # the slot holds a block and the key is not after the query: [B, t, Hk, K, 1, block]
    key_pos = idx[..., None] * block + mx.arange(block)
    allowed = (idx[..., None] >= 0) & (key_pos <= q_pos[:, :, None, None, None])
    allowed = allowed[..., None, :]
    ats, insides = [], []
    for _, _, base, (first, end) in parts:
        ats.append(base + mx.clip(idx - first, 0, end - first - 1).astype(mx.uint32))
        insides.append(((idx >= first) & (idx < end))[..., None, None])

    def gathered(a, rows, pick):  # [B, t, Hk, K, G, ·]: slot by slot, from its part's table
        out = None
        for part, at, inside in zip(parts, ats, insides, strict=True):
            x = gather_products(a, pick(part), rows, at)
            out = x if out is None else mx.where(inside, x, out)
        return out

    s = gathered(table, rows, lambda part: part[0].swapaxes(-1, -2))  # [B, t, Hk, K, G, block]
    s = mx.where(allowed, s, -mx.inf)
    m = s.max(axis=(3, 5), keepdims=True)  # exact in any dtype
    p = mx.exp((s.astype(mx.float32) - m.astype(mx.float32)) * scale).astype(table.dtype)
    # Sums as matmuls: they accumulate in float32, where a bf16 `sum` accumulates in bf16.
    flat = p.reshape(B * t * Hk * K, G, block)
    total = (flat @ mx.ones((block, 1), p.dtype)).reshape(B, t, Hk, K, G)
    total = (mx.ones((1, K), p.dtype) @ total).astype(mx.float32)  # [B, t, Hk, 1, G]
    slots = mx.arange(B * t * Hk * K, dtype=mx.uint32).reshape(B, t, Hk, K)
    pv = gathered(flat, slots, lambda part: part[1])  # [B, t, Hk, K, G, d]
    o = mx.ones((1, K), p.dtype) @ pv.reshape(B, t, Hk, K, -1)  # [B, t, Hk, 1, G·d]
    o = o.reshape(B, t, Hk, G, -1).astype(mx.float32) / total.reshape(B, t, Hk, G, 1)
    return o.astype(table.dtype)


def _causal(q, kv: KVView, starts: Sequence[int], s: int, scale: float) -> mx.array:
    """q [B, H, t, d], the queries s.. of each row, against every key before them."""
    t = q.shape[2]
    end = max(starts) + s + t
    keys, values = kv.parts(end)
    if kv.start == 0 and len(set(starts)) == 1:
        return attention(q, keys, values, scale, "causal")
    q_pos = _positions(starts, t) + s
    return attention(q, keys, values, scale, mx.arange(end) <= q_pos[:, None, :, None])


def _positions(starts: Sequence[int], T: int) -> mx.array:
    """[B, T] int32: row b's queries at starts[b] + 0..T-1."""
    return mx.array(list(starts), dtype=mx.int32)[:, None] + mx.arange(T, dtype=mx.int32)


def _allowed(idx: mx.array, q_pos: mx.array, block: int) -> mx.array:
    """[B, Hk, t, K, block]: the slot holds a block and the key is not after the query."""
    tok = idx[..., None] * block + mx.arange(block)
    return (idx[..., None] >= 0) & (tok <= q_pos[:, None, :, None, None])


def _gathered(qg, kv: KVView, idx, q_pos, scale, block: int):
    """Each query's K blocks gathered: qg [B, Hk, t, G, d], idx [B, Hk, t, K] → [B, H, t, d].

    The (row, kv head) pairs are split between the lanes (a decode step is one query per row,
    so this is where its parallelism is).
    """
    B, Hk, t, G, d = qg.shape
    P, K = B * Hk, idx.shape[-1]
    lane = lanes()
    n = min(len(lane), P)
    bounds = [P * i // n for i in range(n + 1)]
    outs = []
    for i in range(n):
        p0, p1 = bounds[i], bounds[i + 1]
        with mx.stream(lane[i]):
            q = qg.reshape(P, t, G, d)[p0:p1]
            sel = idx.reshape(P, t, K)[p0:p1]
            pos = mx.repeat(q_pos, Hk, axis=0)[p0:p1]  # [P', t]
            outs.append(_gathered_pairs(q, kv, sel, pos, p0, scale, block))
    o = outs[0] if n == 1 else mx.concatenate(outs, axis=0)
    return _heads(o.reshape(B, Hk, t, G, d))


def _gathered_pairs(q, kv: KVView, idx, q_pos, p0: int, scale, block: int):
    """Pairs p0.. of (row, kv head), as p = b·Hk + g: q [P', t, G, d], idx [P', t, K],
    q_pos [P', t] → [P', t, G, d].

    Without shared keys, one `take` of whole blocks from the row buffer read as a flat
    table ([(b, g, block), block·d]). With them, the slots in the shared keys are gathered from
    the shared buffer, and the row's own positions (after a document: its question and answer, a
    few blocks) are read whole, masked to the selected blocks, so no gathered array is built
    twice and merged.
    """
    Pn, t, G, d = q.shape
    K = idx.shape[-1]
    Hk = kv.rows_k.shape[1]
    S = kv.start // block
    g = (mx.arange(p0, p0 + Pn) % Hk)[:, None, None]
    safe = mx.maximum(idx, 0)
    allowed = _allowed(idx[:, None], q_pos, block)[:, 0]  # [P', t, K, block]
    n = Pn * t
    if not S:
        R = kv.rows_k.shape[2] // block
        at = mx.arange(p0, p0 + Pn)[:, None, None] * R + safe
        keys = _take_blocks(kv.rows_k, at, block)
        values = _take_blocks(kv.rows_v, at, block)
        mask = allowed.reshape(n, 1, 1, K * block)
        return attention(q.reshape(n, 1, G, d), keys, values, scale, mask).reshape(q.shape)
    C = kv.shared_k.shape[2] // block
    at = g * C + mx.minimum(safe, S - 1)
    keys = (_take_blocks(kv.shared_k, at, block),)
    values = (_take_blocks(kv.shared_v, at, block),)
    mask = (allowed & (idx < S)[..., None]).reshape(Pn, t, K * block)
    own = max(kv.lengths) - kv.start
    if own > 0:
        R = -(-own // block) * block
        rows_k = kv.rows_k[:, :, :R].reshape(-1, R, kv.rows_k.shape[-1])[p0 : p0 + Pn]
        rows_v = kv.rows_v[:, :, :R].reshape(-1, R, kv.rows_v.shape[-1])[p0 : p0 + Pn]
        keys += (mx.broadcast_to(rows_k[:, None], (Pn, t, R, d)).reshape(n, 1, R, d),)
        values += (mx.broadcast_to(rows_v[:, None], (Pn, t, R, d)).reshape(n, 1, R, d),)
        blocks = S + mx.arange(R // block)
        member = (idx[..., None] == blocks).any(axis=-2)  # [P', t, R/block]
        key_pos = kv.start + mx.arange(R)
        own_mask = mx.repeat(member, block, axis=-1) & (key_pos <= q_pos[..., None])
        mask = mx.concatenate([mask, own_mask], axis=-1)
    mask = mask.reshape(n, 1, 1, -1)
    return attention(q.reshape(n, 1, G, d), keys, values, scale, mask).reshape(q.shape)


def _take_blocks(buffer: mx.array, at: mx.array, block: int) -> mx.array:
    """buffer [b, Hk, N, d] read as a table of blocks; at [P', t, K] table rows →
    [P'·t, 1, K·block, d]."""
    d = buffer.shape[-1]
    Pn, t, K = at.shape
    out = mx.take(buffer.reshape(-1, block * d), at, axis=0)
    return out.reshape(Pn * t, 1, K * block, d)


def _scored(qg, kv: KVView, idx, q_pos, scale, block: int, end: int):
    """Scores of every key before `end` as one matmul per kv head (a matmul costs far less per
    score than the softmax, and reads each key once per tile, not once per query), then the
    softmax of the selected blocks only, against their gathered values:
    qg [B, Hk, t, G, d], idx [B, Hk, t, K] → [B, H, t, d], a float32 softmax in base 2."""
    B, Hk, t, G, d = qg.shape
    K = idx.shape[-1]
    keys, _ = kv.parts(end)
    q2 = (qg.astype(mx.float32) * (scale * LOG2E)).reshape(B, Hk, 1, t * G, d)
    s = mx.concatenate([grouped_scores(q2, k) for k in keys], axis=-1)  # [B, Hk, 1, t·G, end]
    s = s.reshape(B, Hk, t, G, end // block, block)
    slots = mx.maximum(idx, 0)[:, :, :, None, :, None]  # [B, Hk, t, 1, K, 1]
    sel = mx.take_along_axis(s, slots, axis=4)  # [B, Hk, t, G, K, block]
    sel = mx.where(_allowed(idx, q_pos, block)[:, :, :, None], sel, -mx.inf)
    p = exp2(sel - sel.max(axis=(-2, -1), keepdims=True))
    total = p.sum(axis=(-2, -1))[..., None]  # [B, Hk, t, G, 1]
    values = _gather_blocks(kv.rows_v, kv.shared_v, kv.start, idx, block)  # [B, Hk, t, K, block·d]
    o = p.reshape(B, Hk, t, G, K * block) @ values.reshape(B, Hk, t, K * block, d)
    return _heads((o / total).astype(qg.dtype))


def _heads(o: mx.array) -> mx.array:
    """[B, Hk, t, G, d] → [B, H, t, d]."""
    B, Hk, t, G, d = o.shape
    return o.transpose(0, 1, 3, 2, 4).reshape(B, Hk * G, t, d)


def _gather_blocks(
    rows: mx.array, shared: mx.array | None, start: int, idx: mx.array, block: int
) -> mx.array:
    """The blocks idx [B, Hk, t, K] of each row's sequence → [B, Hk, t, K, block·d].

    rows [B, Hk, R, d] and shared [1, Hk, C, d] (positions [0, start) are the shared part) are
    read as flat tables of one block per row ([(b, g, block), block·d]), so one `take` copies
    whole blocks; a -1 slot reads block 0 (the caller masks it).
    """
    B, Hk, t, K = idx.shape
    d = rows.shape[-1]
    S = start // block
    safe = mx.maximum(idx, 0)
    base = (mx.arange(B)[:, None] * Hk + mx.arange(Hk)[None, :]) * (rows.shape[2] // block)
    own = mx.take(rows.reshape(-1, block * d), base[:, :, None, None] + mx.maximum(safe - S, 0), 0)
    if not S:
        return own
    at = mx.arange(Hk)[None, :, None, None] * (shared.shape[2] // block) + mx.minimum(safe, S - 1)
    common = mx.take(shared.reshape(-1, block * d), at, axis=0)
    return mx.where((safe < S)[..., None], common, own)
