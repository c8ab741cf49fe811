"""InfLLM-v2 stage 2: attention over the selected 64-token key blocks only (SPEC §4.3 step E).

Layout:
  q       [B, H, T, d]    queries; query head h reads kv head h // G
  kv      KVView          row b's keys/values: a shared part [1, Hk, S, d] (S a multiple of the
                          block; may be empty) then the row's own [B, Hk, R, d] (R a multiple of
                          the block; positions past a row's length hold anything: causality
                          masks them)
  idx     [B, Hk, T, K]   selected block ids per query (-1 = none), shared by a kv group
  q_pos   [B, T] int32    absolute position of each query
  →       [B, H, T, d]    in q's dtype

Query t attends to key j iff block(j) is in idx[.., t, :] and j ≤ q_pos[t].
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from salabatch.engine.cache import KVView
from salabatch.engine.kernels.attention import attend

# Bound on the [G, rows, union·block] score tile of the prefill path (elements).
MAX_TILE_ELEMENTS = 1 << 24
# A query tile is split while the union of its blocks exceeds this many times the per-query K.
MAX_UNION_RATIO = 2


def block_sparse_attention_ref(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    idx: mx.array,
    q_pos: mx.array,
    scale: float,
    block: int = 64,
) -> mx.array:
    """Reference: float32 masked softmax over each row's whole sequence keys/values
    [B, Hk, N, d] (O(T·N) memory; tests only)."""
    B, H, T, d = q.shape
    Hk, N = keys.shape[1], keys.shape[2]
    G = H // Hk
    qf = q.astype(mx.float32).reshape(B, Hk, G, T, d)
    s = (qf @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)) * scale  # [B, Hk, G, T, N]
    key_blk = mx.arange(N) // block
    chosen = (idx[..., None] == key_blk).any(axis=-2)  # [B, Hk, T, N]
    causal = mx.arange(N) <= q_pos[:, None, :, None]
    allowed = (chosen & causal)[:, :, None]
    p = mx.softmax(mx.where(allowed, s, -mx.inf), axis=-1)
    o = p @ values.astype(mx.float32)[:, :, None]
    return o.reshape(B, H, T, d).astype(q.dtype)


def block_sparse_attention(
    q: mx.array, kv: KVView, idx: mx.array, q_pos: mx.array, scale: float, block: int = 64
) -> mx.array:
    """Dispatcher: gathered blocks for one query per row (decode), block unions for prefill."""
    if q.shape[2] == 1:
        return _decode(q, kv, idx, q_pos, scale, block)
    return _prefill(q, kv, idx, q_pos, scale, block)


def _decode(q, kv: KVView, idx, q_pos, scale, block):
    """Gathers the K selected blocks of each (row, kv head): cost grows with K, not with N."""
    B, H, _, d = q.shape
    Hk, K = kv.rows_k.shape[1], idx.shape[-1]
    tok = (idx[:, :, 0, :, None] * block + mx.arange(block)).reshape(B, Hk, K * block)
    valid = (tok >= 0) & (tok <= q_pos[:, None, :1])  # [B, Hk, K·block]
    tok = mx.where(valid, tok, 0)
    k_sel, v_sel = _gather_tokens(kv, tok)  # [B, Hk, K·block, d]
    mask = mx.repeat(valid, H // Hk, axis=1)[:, :, None, :]  # [B, H, 1, K·block]
    return attend(q, k_sel, v_sel, scale, mask)


def _gather_tokens(kv: KVView, tok: mx.array) -> tuple[mx.array, mx.array]:
    """Keys/values at positions tok [B, Hk, n] of each row's sequence → [B, Hk, n, d] each."""
    S = kv.start
    own = mx.maximum(tok - S, 0)[..., None]
    k = mx.take_along_axis(kv.rows_k, own, axis=2)
    v = mx.take_along_axis(kv.rows_v, own, axis=2)
    if S:
        in_shared = (tok < S)[..., None]
        at = mx.minimum(tok, S - 1)[..., None]
        k = mx.where(in_shared, mx.take_along_axis(kv.shared_k, at, axis=2), k)
        v = mx.where(in_shared, mx.take_along_axis(kv.shared_v, at, axis=2), v)
    return k, v


def _prefill(q, kv: KVView, idx, q_pos, scale, block):
    """Per (row, kv head), query tiles attend to the union of their selected blocks.

    The selection is brought to the host once; each tile gathers its union of blocks and masks
    per query. Tiles are split while the union is much larger than K, which bounds both the
    wasted work and the tile's memory.
    """
    B, H, T, d = q.shape
    Hk = kv.rows_k.shape[1]
    G, K = H // Hk, idx.shape[-1]
    sel = np.array(idx)  # [B, Hk, T, K]
    pos = np.array(q_pos)  # [B, T]
    shared_blocks = kv.start // block
    rows_kb = kv.rows_k.reshape(B, Hk, -1, block, d)
    rows_vb = kv.rows_v.reshape(B, Hk, -1, block, d)
    if shared_blocks:
        shared_kb = kv.shared_k.reshape(Hk, shared_blocks, block, d)
        shared_vb = kv.shared_v.reshape(Hk, shared_blocks, block, d)
    out = []
    for b in range(B):
        heads = []
        for g in range(Hk):
            parts = []
            for s, e, union in _tiles(sel[b, g], K, G * block):
                member = (sel[b, g, s:e, :, None] == union).any(axis=1)  # [rows, U]
                tok = union[:, None] * block + np.arange(block)  # [U, block]
                allowed = member[:, :, None] & (tok <= pos[b, s:e, None, None])
                own = mx.array(union[union >= shared_blocks] - shared_blocks)
                k_u, v_u = rows_kb[b, g][own], rows_vb[b, g][own]
                if shared_blocks and union[0] < shared_blocks:  # union is ascending
                    common = mx.array(union[union < shared_blocks])
                    k_u = mx.concatenate([shared_kb[g][common], k_u])
                    v_u = mx.concatenate([shared_vb[g][common], v_u])
                mask = mx.array(allowed.reshape(e - s, -1))
                qt = q[b, g * G : (g + 1) * G, s:e][None]  # [1, G, rows, d]
                o = attend(qt, k_u.reshape(1, 1, -1, d), v_u.reshape(1, 1, -1, d), scale, mask)
                parts.append(o[0])
            heads.append(mx.concatenate(parts, axis=1))  # [G, T, d]
        out.append(mx.concatenate(heads, axis=0))  # [H, T, d]
    return mx.stack(out)


def _tiles(sel: np.ndarray, k: int, cost_per_block: int):
    """Splits queries [T, K] into ranges whose block union is small; yields (start, end, union)."""
    stack = [(0, sel.shape[0])]
    while stack:
        s, e = stack.pop()
        union = np.unique(sel[s:e])
        union = union[union >= 0]
        rows = e - s
        too_big = rows * len(union) * cost_per_block > MAX_TILE_ELEMENTS
        wasteful = len(union) > MAX_UNION_RATIO * k
        if rows > 1 and (too_big or wasteful):
            mid = s + rows // 2
            stack += [(mid, e), (s, mid)]
            continue
        yield s, e, union
