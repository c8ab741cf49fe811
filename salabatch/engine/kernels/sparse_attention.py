"""InfLLM-v2 stage 2: attention over the selected 64-token key blocks only (SPEC §4.3 step E).

Layout:
  q       [B, H, T, d]       queries; query head h reads kv head h // G
  keys    [B, Hk, N, d]      the cache buffer, N a multiple of `block` (positions ≥ the real
  values  [B, Hk, N, d]      length hold anything: causality masks them)
  idx     [B, Hk, T, K]      selected block ids per query (-1 = none), shared by a kv group
  q_pos   [B, T] int32       absolute position of each query
  →       [B, H, T, d]       in q's dtype

Query t attends to key j iff block(j) is in idx[.., t, :] and j ≤ q_pos[t].
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

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
    """Reference: float32 masked softmax over all keys (O(T·N) memory; tests only)."""
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
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    idx: mx.array,
    q_pos: mx.array,
    scale: float,
    block: int = 64,
) -> mx.array:
    """Dispatcher: gathered blocks for one query per row (decode), block unions for prefill."""
    if q.shape[2] == 1:
        return _decode(q, keys, values, idx, q_pos, scale, block)
    return _prefill(q, keys, values, idx, q_pos, scale, block)


def _decode(q, keys, values, idx, q_pos, scale, block):
    """Gathers the K selected blocks of each (row, kv head): cost grows with K, not with N."""
    B, H, _, d = q.shape
    Hk, K = keys.shape[1], idx.shape[-1]
    tok = (idx[:, :, 0, :, None] * block + mx.arange(block)).reshape(B, Hk, K * block)
    valid = (tok >= 0) & (tok <= q_pos[:, None, :1])  # [B, Hk, K·block]
    tok = mx.where(valid, tok, 0)[..., None]
    k_sel = mx.take_along_axis(keys, tok, axis=2)  # [B, Hk, K·block, d]
    v_sel = mx.take_along_axis(values, tok, axis=2)
    mask = mx.repeat(valid, H // Hk, axis=1)[:, :, None, :]  # [B, H, 1, K·block]
    return attend(q, k_sel, v_sel, scale, mask)


def _prefill(q, keys, values, idx, q_pos, scale, block):
    """Per (row, kv head), query tiles attend to the union of their selected blocks.

    The selection is brought to the host once; each tile gathers its union of blocks and masks
    per query. Tiles are split while the union is much larger than K, which bounds both the
    wasted work and the tile's memory.
    """
    B, H, T, d = q.shape
    Hk, N = keys.shape[1], keys.shape[2]
    G, K = H // Hk, idx.shape[-1]
    sel = np.array(idx)  # [B, Hk, T, K]
    pos = np.array(q_pos)  # [B, T]
    kb = keys.reshape(B, Hk, N // block, block, d)
    vb = values.reshape(B, Hk, N // block, block, d)
    rows_out = []
    for b in range(B):
        heads_out = []
        for g in range(Hk):
            parts = []
            for s, e, union in _tiles(sel[b, g], K, G * block):
                member = (sel[b, g, s:e, :, None] == union).any(axis=1)  # [rows, U]
                tok = union[:, None] * block + np.arange(block)  # [U, block]
                allowed = member[:, :, None] & (tok <= pos[b, s:e, None, None])
                u = mx.array(union)
                k_u = kb[b, g][u].reshape(-1, d)  # [U·block, d]
                v_u = vb[b, g][u].reshape(-1, d)
                mask = mx.array(allowed.reshape(e - s, -1))
                qt = q[b, g * G : (g + 1) * G, s:e][None]  # [1, G, rows, d]
                o = attend(qt, k_u[None, None], v_u[None, None], scale, mask)
                parts.append(o[0])
            heads_out.append(mx.concatenate(parts, axis=1))  # [G, T, d]
        rows_out.append(mx.concatenate(heads_out, axis=0))  # [H, T, d]
    return mx.stack(rows_out)


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
