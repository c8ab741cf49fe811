"""InfLLM-v2 block selection (SPEC §4.3 steps B–D): stage-1 scores → block max-pool → top-k.

Layout (every function here):
  q      [B, H, T, d]    queries of this call, H = Hk · G (G query heads share one kv head)
  c1     level-1 compressed keys (mean of 32 keys every 16), float32, as a tuple of parts
         concatenated along the chunk axis: each [1 or B, Hk, n, d] (a prefix shared by all
         rows, then the rows' own chunks); N1 = Σ n
  c2     level-2 compressed keys (mean of 128 keys every 64), likewise (N2)
  vis1   [B, T] int32    how many leading c1 chunks each query may see (c2: vis2)
  q_blk  [B, T] int32    the 64-token key block each query sits in
  →      [B, Hk, T, K]   int32 selected block ids, ascending; -1 marks a slot holding no past block

Scores: p[h, t, j] = exp(q·c1_j · scale − logsumexp_j' q·c2_j' · scale) over visible chunks (the
normaliser comes from the coarse level, SPEC P6), summed over the G heads of a kv group; a query
that sees no level-2 chunk scores 0 everywhere. A block scores the max over the level-1 chunks that
overlap it (4b−1 … 4b+3); the first `init_blocks` blocks and the local window (the query's block
and `local_blocks` before it) are forced; then the K best, ties going to the lowest block id (the
CUDA torch.topk rule the golden vectors follow, SPEC P11).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from salabatch.engine.kernels.attention import LOG2E

# Bound on the [B, Hk, G, rows, N1] score tile the fast path materialises (float32 elements).
MAX_SCORE_ELEMENTS = 1 << 25


def chunk_scores(
    q: mx.array,
    c1: tuple[mx.array, ...],
    c2: tuple[mx.array, ...],
    vis1: mx.array,
    vis2: mx.array,
    scale: float,
) -> mx.array:
    """Stage-1 scores summed over each kv group: [B, Hk, T, N1] float32.

    Computed in base 2 (exp(x − lse) = 2^(x·log2e − lse2)): the same numbers up to float32
    rounding, and `power(2, ·)` is 2–3× cheaper than `exp` on MLX's CPU backend.
    """
    B, H, T, d = q.shape
    Hk = c1[0].shape[1]
    n1, n2 = (sum(p.shape[2] for p in parts) for parts in (c1, c2))
    if n1 == 0 or n2 == 0:  # no complete chunk: every query scores 0
        return mx.zeros((B, Hk, T, n1), dtype=mx.float32)
    qg = q.astype(mx.float32).reshape(B, Hk, H // Hk, T, d) * (scale * LOG2E)
    s1 = _scores(qg, c1)  # [B, Hk, G, T, N1]
    s2 = _scores(qg, c2)  # [B, Hk, G, T, N2]
    v1 = vis1[:, None, None, :, None]
    v2 = vis2[:, None, None, :, None]
    s2 = mx.where(mx.arange(n2) < v2, s2, -mx.inf)
    m2 = mx.where(v2 > 0, s2.max(axis=-1, keepdims=True), 0.0)
    lse2 = m2 + mx.log2(mx.power(2.0, s2 - m2).sum(axis=-1, keepdims=True))
    p = mx.where((mx.arange(n1) < v1) & (v2 > 0), mx.power(2.0, s1 - lse2), 0.0)
    return p.sum(axis=2)


def _scores(qg: mx.array, parts: tuple[mx.array, ...]) -> mx.array:
    """qg [B, Hk, G, T, d] against each part's chunks (a shared part is read once, broadcast)."""
    s = [qg @ p[:, :, None].swapaxes(-1, -2) for p in parts if p.shape[2]]
    return s[0] if len(s) == 1 else mx.concatenate(s, axis=-1)


def pool_blocks(scores: mx.array, n_blocks: int) -> mx.array:
    """Max over the level-1 chunks overlapping each 64-token block: [..., N1] → [..., n_blocks].

    Block b overlaps chunks 4b−1 … 4b+3; chunks that do not exist count as −inf.
    """
    lead = scores.shape[:-1]
    n1 = scores.shape[-1]
    width = 4 * n_blocks + 4  # padded[j + 1] holds chunk j
    left = mx.full((*lead, 1), -mx.inf, dtype=scores.dtype)
    right = mx.full((*lead, width - 1 - n1), -mx.inf, dtype=scores.dtype)
    padded = mx.concatenate([left, scores, right], axis=-1)
    body = padded[..., : 4 * n_blocks].reshape(*lead, n_blocks, 4).max(axis=-1)
    return mx.maximum(body, padded[..., 4 : 4 * n_blocks + 4 : 4])


def force_and_mask(
    pooled: mx.array, q_blk: mx.array, init_blocks: int, local_blocks: int
) -> mx.array:
    """+inf on forced blocks, −inf on blocks after the query's own: [B, Hk, T, n_blocks]."""
    b = mx.arange(pooled.shape[-1])
    qb = q_blk[:, None, :, None]
    forced = (b < init_blocks) | ((b >= qb - local_blocks) & (b <= qb))
    return mx.where(forced, mx.inf, mx.where(b > qb, -mx.inf, pooled))


def top_k_lowest_index(scores: mx.array, k: int, q_blk: mx.array) -> mx.array:
    """The k best blocks, ties to the lowest id, sorted; ids past the query block become -1."""
    kth = mx.topk(scores, k, axis=-1).min(axis=-1, keepdims=True)
    above = scores > kth
    tied = scores == kth
    room = k - above.astype(mx.int32).sum(axis=-1, keepdims=True)
    take = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))
    n = scores.shape[-1]
    b = mx.arange(n, dtype=mx.int32)
    # Taken blocks get key b, the rest b + n: the k smallest keys are exactly the taken ids.
    key = mx.where(take, b, b + n)
    idx = mx.sort(mx.take_along_axis(key, mx.argpartition(key, k - 1, axis=-1)[..., :k], -1), -1)
    return mx.where(idx > q_blk[:, None, :, None], -1, idx)


def select_blocks(
    q: mx.array,
    c1: tuple[mx.array, ...],
    c2: tuple[mx.array, ...],
    vis1: mx.array,
    vis2: mx.array,
    q_blk: mx.array,
    *,
    n_blocks: int,
    k: int,
    scale: float,
    init_blocks: int,
    local_blocks: int,
) -> mx.array:
    """Fast path: the same selection, in query tiles so the score buffer stays bounded."""
    B, H, T, _ = q.shape
    N1 = max(sum(p.shape[2] for p in c1), 1)
    rows = max(1, MAX_SCORE_ELEMENTS // (B * H * max(N1, n_blocks)))
    out = []
    for s in range(0, T, rows):
        e = min(T, s + rows)
        scores = chunk_scores(q[:, :, s:e], c1, c2, vis1[:, s:e], vis2[:, s:e], scale)
        pooled = pool_blocks(scores, n_blocks)
        masked = force_and_mask(pooled, q_blk[:, s:e], init_blocks, local_blocks)
        out.append(top_k_lowest_index(masked, k, q_blk[:, s:e]))
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)


def select_blocks_ref(
    q: mx.array,
    c1: tuple[mx.array, ...],
    c2: tuple[mx.array, ...],
    vis1: mx.array,
    vis2: mx.array,
    q_blk: mx.array,
    *,
    n_blocks: int,
    k: int,
    scale: float,
    init_blocks: int,
    local_blocks: int,
) -> mx.array:
    """Reference: whole score matrix, pooling by explicit ranges, top-k by a stable sort."""
    scores = np.array(chunk_scores(q, c1, c2, vis1, vis2, scale))  # [B, Hk, T, N1]
    B, Hk, T, n1 = scores.shape
    qb = np.array(q_blk)
    out = np.full((B, Hk, T, k), -1, dtype=np.int32)
    for b in range(B):
        for g in range(Hk):
            for t in range(T):
                block = np.full(n_blocks, -np.inf, dtype=np.float32)
                for i in range(n_blocks):
                    lo, hi = max(4 * i - 1, 0), min(4 * i + 4, n1)
                    if lo < hi:
                        block[i] = scores[b, g, t, lo:hi].max()
                blk = qb[b, t]
                for i in range(n_blocks):
                    if i < init_blocks or blk - local_blocks <= i <= blk:
                        block[i] = np.inf
                    elif i > blk:
                        block[i] = -np.inf
                order = np.lexsort((np.arange(n_blocks), -block))  # by score desc, then id asc
                chosen = np.sort(order[:k])
                out[b, g, t] = np.where(chosen > blk, -1, chosen)
    return mx.array(out)
