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

from salabatch.engine.kernels.attention import attend
from salabatch.engine.sparse_cache import KVView

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
    """Query tiles attend to the union of their selected blocks, many tiles per batched op.

    The selection comes to the host once. Each (row, kv head)'s queries are split into tiles
    whose union of blocks is small (`_tiles`); tiles of similar size are padded to a common
    shape and processed together, so the number of MLX ops does not grow with the number of
    tiles, and a group's score buffer stays under MAX_TILE_ELEMENTS.
    """
    B, H, T, d = q.shape
    Hk = kv.rows_k.shape[1]
    G, K = H // Hk, idx.shape[-1]
    sel, pos = np.array(idx), np.array(q_pos)  # [B, Hk, T, K], [B, T]
    tiles = [
        (b, g, s, e, union)
        for b in range(B)
        for g in range(Hk)
        for s, e, union in _tiles(sel[b, g], K, G * block)
    ]
    tiles.sort(key=lambda t: (t[3] - t[2], len(t[4])))  # similar shapes pad little
    S = kv.start // block  # blocks in the shared part
    shared_k = shared_v = None
    if S:
        shared_k = kv.shared_k.reshape(Hk * S, block * d)  # [(g, block), block·d]
        shared_v = kv.shared_v.reshape(Hk * S, block * d)
    rows_k = kv.rows_k.reshape(-1, block * d)  # [(b, g, block), block·d]
    rows_v = kv.rows_v.reshape(-1, block * d)
    row_blocks = kv.rows_k.shape[2] // block
    # queries as [(b, g, t), G, d], plus one spare row that padded tile rows read and write
    flat_q = q.reshape(B, Hk, G, T, d).transpose(0, 1, 3, 2, 4).reshape(B * Hk * T, G, d)
    flat_q = mx.concatenate([flat_q, mx.zeros((1, G, d), q.dtype)])
    out = mx.zeros(flat_q.shape, q.dtype)
    spare = B * Hk * T
    groups: list[list] = [[]]  # consecutive tiles whose padded scores fit the budget
    for tile in tiles:
        group = groups[-1]
        rows = max(t[3] - t[2] for t in [*group, tile])
        if group and (len(group) + 1) * rows * len(tile[4]) * G * block > MAX_TILE_ELEMENTS:
            groups.append([])
        groups[-1].append(tile)
    tables = ((shared_k, shared_v), (rows_k, rows_v))
    for group in filter(None, groups):
        out = _attend_group(
            group, out, flat_q, *tables, S, row_blocks, sel, pos, scale, block, Hk, spare
        )
    o = out[:spare].reshape(B, Hk, T, G, d).transpose(0, 1, 3, 2, 4)
    return o.reshape(B, H, T, d)


def _attend_group(
    group, out, flat_q, shared, rows_kv, S, row_blocks, sel, pos, scale, block, Hk, spare
):
    """One batched attention over tiles padded to the group's largest rows and union."""
    n = len(group)
    R = max(e - s for _, _, s, e, _ in group)
    U = max(len(u) for *_, u in group)
    q_rows = np.full((n, R), spare, dtype=np.int32)
    from_shared = np.zeros((n, U), dtype=bool)
    at = np.zeros((n, U), dtype=np.int32)  # block row in the shared or the rows table
    mask = np.zeros((n, R, U, block), dtype=bool)
    T = sel.shape[2]
    for i, (b, g, s, e, union) in enumerate(group):
        q_rows[i, : e - s] = (b * Hk + g) * T + np.arange(s, e)
        common = union < S
        from_shared[i, : len(union)] = common
        at[i, : len(union)] = np.where(common, g * S + union, (b * Hk + g) * row_blocks + union - S)
        member = (sel[b, g, s:e, :, None] == union).any(axis=1)  # [rows, len(union)]
        tok = union[:, None] * block + np.arange(block)
        mask[i, : e - s, : len(union)] = member[:, :, None] & (tok <= pos[b, s:e, None, None])
    mask[:, :, 0, 0] |= q_rows == spare  # padded rows attend to something (their output is dropped)
    k = mx.take(rows_kv[0], mx.array(np.where(from_shared, 0, at).reshape(-1)), axis=0)
    v = mx.take(rows_kv[1], mx.array(np.where(from_shared, 0, at).reshape(-1)), axis=0)
    if from_shared.any():
        pick = mx.array(from_shared.reshape(-1, 1))
        shared_idx = mx.array(np.where(from_shared, at, 0).reshape(-1))
        k = mx.where(pick, mx.take(shared[0], shared_idx, axis=0), k)
        v = mx.where(pick, mx.take(shared[1], shared_idx, axis=0), v)
    d = flat_q.shape[-1]
    k = k.reshape(n, 1, U * block, d)
    v = v.reshape(n, 1, U * block, d)
    qt = flat_q[mx.array(q_rows.reshape(-1))].reshape(n, R, -1, d).transpose(0, 2, 1, 3)
    o = attend(qt, k, v, scale, mx.array(mask.reshape(n, 1, R, U * block)))  # [n, G, R, d]
    out[mx.array(q_rows.reshape(-1))] = o.transpose(0, 2, 1, 3).reshape(n * R, -1, d)
    return out


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
