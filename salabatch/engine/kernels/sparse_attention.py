"""InfLLM-v2 stage 2: each query attends to its selected 64-token key blocks only (SPEC §4.3 E).

Layout:
  q       [B, H, T, d]    queries; query head h reads kv head h // G (G = H / Hk)
  kv      KVView          row b's keys/values: a shared part [1, Hk, S, d] (S a multiple of the
                          block; may be absent) then the row's own [B, Hk, R, d] (R a multiple of
                          the block; positions past a row's length hold anything: causality
                          masks them)
  idx     [B, Hk, T, K]   selected block ids per query (-1 = none), shared by a kv group
  q_pos   [B, T] int32    absolute position of each query
  →       [B, H, T, d]    in q's dtype

Query t attends to key j iff block(j) is in idx[.., t, :] and j ≤ q_pos[t].

The fast path gathers, on the device, the K selected blocks of every query (fixed K, -1 slots
padded and masked), so its cost grows with K, not with the context, and nothing depends on the
values of the selection: no host round trip, the same op graph for every prompt of a shape.
Queries go in tiles whose gathered keys stay under MAX_GATHER_BYTES; the G query heads of a kv
head form the rows of one small attention, which runs through the attention dispatcher (fused
SDPA on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from salabatch.engine.kernels.attention import (
    LOG2E,
    attention,
    attention_ref,
    grouped_scores,
    grouped_weighted,
    lanes,
)
from salabatch.engine.kernels.sparse_select import BLOCK

# Bound on the keys + values one query tile gathers (bytes).
MAX_GATHER_BYTES = 1 << 27
# Bound on the [B, H, rows, keys] float32 score tile of `_scored` (elements).
MAX_SCORE_ELEMENTS = 1 << 24
# `_scored` while the keys before a tile are at most this many per selected key slot: past
# that, scoring every key costs more than gathering the selected ones (measured on CPU).
SCORED_KEYS_PER_SLOT = 4


@dataclass(frozen=True)
class KVView:
    """What attention reads. Row b's sequence is the shared prefix, positions [0, start) of
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
        or (rows,) without a shared prefix."""
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
    q: mx.array, kv: KVView, idx: mx.array, starts: Sequence[int], scale: float
) -> mx.array:
    """Reference: a float32 masked softmax over each row's whole sequence (O(T·N) memory)."""
    keys, values = kv.full()
    B, H, T, d = q.shape
    N, Hk = keys.shape[2], keys.shape[1]
    q_pos = _positions(starts, T)
    chosen = (idx[..., None] == mx.arange(N) // BLOCK).any(axis=-2)  # [B, Hk, T, N]
    causal = mx.arange(N) <= q_pos[:, None, :, None]
    allowed = mx.repeat(chosen & causal, H // Hk, axis=1)  # [B, H, T, N]
    return attention_ref(q, keys, values, scale, allowed)


def block_sparse_attention(
    q: mx.array, kv: KVView, idx: mx.array, starts: Sequence[int], scale: float
) -> mx.array:
    """The dispatcher, per query tile: `_scored` while the keys up to the tile are few (at most
    SCORED_KEYS_PER_SLOT per selected key slot), else `_gathered`; row b's queries sit at
    starts[b] + 0..T-1."""
    B, H, T, d = q.shape
    Hk, K = kv.rows_k.shape[1], idx.shape[-1]
    G = H // Hk
    q_pos = _positions(starts, T)
    qg = q.reshape(B, Hk, G, T, d).transpose(0, 1, 3, 2, 4)  # [B, Hk, T, G, d]
    block = BLOCK
    gather_rows = max(1, MAX_GATHER_BYTES // (2 * B * Hk * K * block * d * kv.rows_k.itemsize))
    outs, s = [], 0
    lane = lanes()
    while s < T:
        end_key = -(-(max(starts) + min(T, s + block)) // block) * block  # keys up to the tile
        if T - s >= block and end_key <= SCORED_KEYS_PER_SLOT * K * block:
            score_rows = MAX_SCORE_ELEMENTS // (B * H * end_key)
            e = min(T, s + max(block, score_rows // block * block))
            end_key = -(-(max(starts) + e) // block) * block
            with mx.stream(lane[len(outs) % len(lane)]):
                o = _scored(qg[:, :, s:e], kv, idx[:, :, s:e], q_pos[:, s:e], scale, end_key)
        else:
            e = min(T, s + gather_rows)
            with mx.stream(lane[len(outs) % len(lane)]):
                o = _gathered(qg[:, :, s:e], kv, idx[:, :, s:e], q_pos[:, s:e], scale)
        outs.append(o)
        s = e
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)  # [B, Hk, T, G, d]
    return o.transpose(0, 1, 3, 2, 4).reshape(B, H, T, d)


def _positions(starts: Sequence[int], T: int) -> mx.array:
    """[B, T] int32: row b's queries at starts[b] + 0..T-1."""
    return mx.array(list(starts), dtype=mx.int32)[:, None] + mx.arange(T, dtype=mx.int32)


def _allowed(idx: mx.array, q_pos: mx.array, block: int) -> mx.array:
    """[B, Hk, t, K, block]: the slot holds a block and the key is not after the query."""
    tok = idx[..., None] * block + mx.arange(block)
    return (idx[..., None] >= 0) & (tok <= q_pos[:, None, :, None, None])


def _gathered(qg, kv: KVView, idx, q_pos, scale):
    """Each query's K blocks gathered: qg [B, Hk, t, G, d], idx [B, Hk, t, K] → like qg."""
    B, Hk, t, G, d = qg.shape
    K, block = idx.shape[-1], BLOCK
    keys, values = _gather_blocks(kv, idx)  # [B, Hk, t, K, block·d]
    n = B * Hk * t
    # one attention per (row, kv head, query): its G heads are the query rows, no GQA inside
    o = attention(
        qg.reshape(n, 1, G, d),
        keys.reshape(n, 1, K * block, d),
        values.reshape(n, 1, K * block, d),
        scale,
        _allowed(idx, q_pos, block).reshape(n, 1, 1, K * block),
    )
    return o.reshape(B, Hk, t, G, d)


def _scored(qg, kv: KVView, idx, q_pos, scale, end: int):
    """Scores of every key before `end` as one matmul per kv head (cheap next to a softmax),
    then the softmax of the selected blocks only, scattered back for one matmul with the
    values: qg [B, Hk, t, G, d], idx [B, Hk, t, K] → like qg, float32 softmax in base 2."""
    B, Hk, t, G, d = qg.shape
    block = BLOCK
    nb = end // block
    keys, values = kv.parts(end)
    q2 = (qg.astype(mx.float32) * (scale * LOG2E)).reshape(B, Hk, 1, t * G, d)
    s = mx.concatenate([grouped_scores(q2, k) for k in keys], axis=-1)  # [B, Hk, 1, t·G, end]
    s = s.reshape(B, Hk, t, G, nb, block)
    slots = idx[:, :, :, None, :, None]  # [B, Hk, t, 1, K, 1]
    sel = mx.take_along_axis(s, mx.maximum(slots, 0), axis=4)  # [B, Hk, t, G, K, block]
    sel = mx.where(_allowed(idx, q_pos, block)[:, :, :, None], sel, -mx.inf)
    p = mx.power(2.0, sel - sel.max(axis=(-2, -1), keepdims=True))
    total = p.sum(axis=(-2, -1))[..., None]  # [B, Hk, t, G, 1]
    # back to key order; empty slots write to a spare block past the end
    spread = mx.zeros((B, Hk, t, G, nb + 1, block), dtype=p.dtype)
    to = mx.broadcast_to(mx.where(slots >= 0, slots, nb), p.shape)
    spread = mx.put_along_axis(spread, to, p, axis=4)[:, :, :, :, :nb]
    spread = spread.reshape(B, Hk, 1, t * G, end)
    o = None
    at = 0
    for v in values:
        n = v.shape[2]
        part = grouped_weighted(spread[..., at : at + n], v)  # [B, Hk, 1, t·G, d]
        o, at = part if o is None else o + part, at + n
    o = o.reshape(B, Hk, t, G, d) / total
    return o.astype(qg.dtype)


def _gather_blocks(kv: KVView, idx: mx.array) -> tuple[mx.array, mx.array]:
    """Keys and values of the blocks idx [B, Hk, t, K] → [B, Hk, t, K, block·d] each.

    Each table is flat, one block per row ([(b, g, block), block·d]), so one `take` gathers
    whole blocks; a -1 slot reads block 0 (it is masked). Blocks below the shared part's end
    come from the shared table.
    """
    B, Hk, t, K = idx.shape
    d, block = kv.rows_k.shape[-1], BLOCK
    S = kv.start // block
    R = kv.rows_k.shape[2] // block
    C = 0 if kv.shared_k is None else kv.shared_k.shape[2] // block  # shared buffer, in blocks
    safe = mx.maximum(idx, 0)
    base = (mx.arange(B)[:, None] * Hk + mx.arange(Hk)[None, :]) * R  # [B, Hk]
    at = base[:, :, None, None] + mx.maximum(safe - S, 0)
    rows_k = mx.take(kv.rows_k.reshape(-1, block * d), at, axis=0)
    rows_v = mx.take(kv.rows_v.reshape(-1, block * d), at, axis=0)
    if not S:
        return rows_k, rows_v
    in_shared = (safe < S)[..., None]
    at = mx.arange(Hk)[None, :, None, None] * C + mx.minimum(safe, S - 1)
    shared_k = mx.take(kv.shared_k.reshape(-1, block * d), at, axis=0)
    shared_v = mx.take(kv.shared_v.reshape(-1, block * d), at, axis=0)
    return mx.where(in_shared, shared_k, rows_k), mx.where(in_shared, shared_v, rows_v)
