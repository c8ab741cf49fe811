"""InfLLM-v2 block selection (SPEC §4.3 steps B–D): stage-1 scores → block max-pool → top-k.

Layout (every function here):
  q       [B, H, T, d]   queries of this call, H = Hk · G (G query heads share one kv head)
  c1      level-1 compressed keys (mean of 32 keys every 16), float32, as a tuple of parts
          concatenated along the chunk axis: each [1 or B, Hk, n, d] (the shared keys' chunks,
          common to all rows, then the rows' own chunks); N1 = Σ n
  c2      level-2 compressed keys (mean of 128 keys every 64), likewise (N2)
  starts  the position of each row's first query (row b's queries sit at starts[b] + 0..T-1)
  block   tokens per key block, `SparseConfig.block_size` (64); `compression`: the (size, stride)
          of each level, `SparseConfig.compression` ((32, 16), (128, 64))
  →       [B, Hk, T, K]  int32 selected block ids, ascending; -1 marks a slot holding no block

Scores: p[h, t, j] = exp(q·c1_j · scale − logsumexp_j' q·c2_j' · scale) over visible chunks (the
normaliser comes from the coarse level, SPEC P6), summed over the G heads of a kv group; a query
that sees no level-2 chunk scores 0 everywhere. A block scores the max over the level-1 chunks that
overlap it (4b−1 … 4b+3); the first `init_blocks` blocks and the local window (the query's block
and `local_blocks` before it) are forced; then the K best, ties going to the lowest block id (the
CUDA torch.topk rule the golden vectors follow, SPEC P11).

The block and the compression levels come from the config (arguments above); the code relies on
the geometry InfLLM-v2 fixes and the config enforces (SPEC P14): a chunk spans two strides and a
block a whole number r of level-1 strides (r = 4), so block b overlaps chunks r·b−1 … r·b+r−1.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from salabatch.engine.kernels import scores_cuda, stage1_cuda
from salabatch.engine.kernels.attention import (
    LOG2E,
    exp2,
    grouped_scores,
    in_turn,
    lanes,
    on_gpu,
    tile_rows,
)
from salabatch.engine.runtime import dtype_name

# Bound on the [B, Hk, G, rows, N1] score tile of one query tile (float32 elements).
MAX_SCORE_ELEMENTS = 1 << 24
# A tile scores level-1 chunks up to a multiple of this (its later ones are masked), so tiles
# share buffer shapes and MLX reuses its cached buffers.
CHUNK_BUCKET = 256


def visible_chunks(q_pos: mx.array, prefill_len: int, stride: int) -> mx.array:
    """How many compressed chunks (size 2·stride) each query may score: those that end at or
    before it. Inside a planned prefill of L tokens the kernel hides one more when
    L ≡ stride − 1 (mod stride) (SPEC §4.3 length quirk); decode steps never do."""
    seen = (q_pos + 1) // stride - 1
    seen = mx.where(q_pos < prefill_len, seen + _quirk(prefill_len, stride), seen)
    return mx.maximum(seen, 0)


def visible_count(pos: int, prefill_len: int, stride: int) -> int:
    """`visible_chunks` of one query position, as a Python int."""
    seen = (pos + 1) // stride - 1
    if pos < prefill_len:
        seen += _quirk(prefill_len, stride)
    return max(seen, 0)


def _quirk(prefill_len: int, stride: int) -> int:
    size = 2 * stride
    if prefill_len < size:
        return 0
    return (prefill_len - size) // stride + 1 - (prefill_len - stride + 1) // stride


def chunk_scores(
    q: mx.array,
    c1: tuple[mx.array, ...],
    c2: tuple[mx.array, ...],
    vis1: mx.array,
    vis2: mx.array,
    scale: float,
    exp2=exp2,
) -> mx.array:
    """Stage-1 scores summed over each kv group: [B, Hk, T, N1] float32; vis1/vis2 [B, T].
    `exp2`: `attention.exp2`, or `exp2_poly` inside a compiled graph.

    Computed in base 2 (exp(x − lse) = 2^(x·log2e − lse2)): the same numbers up to float32
    rounding, and `power(2, ·)` is about 3× cheaper than `exp` on MLX's CPU backend.
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
    lse2 = m2 + mx.log2(exp2(s2 - m2).sum(axis=-1, keepdims=True))
    p = mx.where((mx.arange(n1) < v1) & (v2 > 0), exp2(s1 - lse2), 0.0)
    return p.sum(axis=2)


def _scores(qg: mx.array, parts: tuple[mx.array, ...]) -> mx.array:
    s = [grouped_scores(qg, p) for p in parts if p.shape[2]]
    return s[0] if len(s) == 1 else mx.concatenate(s, axis=-1)


def pool_blocks(scores: mx.array, n_blocks: int, r: int) -> mx.array:
    """Max over the level-1 chunks overlapping each block of r level-1 strides (r = 4):
    [..., N1] → [..., n_blocks].

    Block b overlaps chunks r·b−1 … r·b+r−1; chunks that do not exist count as −inf.
    """
    lead = scores.shape[:-1]
    n1 = min(scores.shape[-1], r * n_blocks + r - 1)  # later chunks overlap no block here
    scores = scores[..., :n1]
    width = r * n_blocks + r  # padded[j + 1] holds chunk j
    left = mx.full((*lead, 1), -mx.inf, dtype=scores.dtype)
    right = mx.full((*lead, width - 1 - n1), -mx.inf, dtype=scores.dtype)
    padded = mx.concatenate([left, scores, right], axis=-1)
    body = padded[..., : r * n_blocks].reshape(*lead, n_blocks, r).max(axis=-1)
    return mx.maximum(body, padded[..., r : r * n_blocks + r : r])


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
    starts: Sequence[int],
    *,
    prefill_len: int,
    n_blocks: int,
    k: int,
    scale: float,
    init_blocks: int,
    local_blocks: int,
    block: int,
    compression: tuple[tuple[int, int], tuple[int, int]],
) -> mx.array:
    """The dispatcher: `select_blocks_gpu` on the GPU path, else the CPU's query tiles: each
    scores only the chunks and blocks its last query can see (causal), so the score buffer
    stays under MAX_SCORE_ELEMENTS and a prefill does half the work of scoring every chunk;
    slots past a tile's blocks are -1 padding."""
    if on_gpu():
        return select_blocks_gpu(
            q,
            c1,
            c2,
            starts,
            prefill_len=prefill_len,
            n_blocks=n_blocks,
            k=k,
            scale=scale,
            init_blocks=init_blocks,
            local_blocks=local_blocks,
            block=block,
            compression=compression,
        )
    B, H, T, _ = q.shape
    N1, N2 = (sum(p.shape[2] for p in parts) for parts in (c1, c2))
    pos = mx.array(list(starts), dtype=mx.int32)[:, None] + mx.arange(T, dtype=mx.int32)
    (_, stride1), (_, stride2) = compression
    lane = lanes()
    rows = max(1, MAX_SCORE_ELEMENTS // (B * H * max(N1, n_blocks, 1)))
    rows = min(rows, -(-T // len(lane)))  # at least one tile per lane
    out = []
    for s in range(0, T, rows):
        e = min(T, s + rows)
        last = max(starts) + e - 1  # the tile's furthest query
        # counts rounded up (what the tile cannot see is masked), so tiles share buffer shapes
        n1 = _bucket(visible_count(last, prefill_len, stride1), N1, CHUNK_BUCKET)
        n2 = _bucket(visible_count(last, prefill_len, stride2), N2, CHUNK_BUCKET // 4)
        blocks = _bucket(last // block + 1, n_blocks, CHUNK_BUCKET // 4)
        p = pos[:, s:e]
        with mx.stream(lane[len(out) % len(lane)]):
            scores = chunk_scores(
                in_turn(q[:, :, s:e], out),
                _head(c1, n1),
                _head(c2, n2),
                visible_chunks(p, prefill_len, stride1),
                visible_chunks(p, prefill_len, stride2),
                scale,
            )
            pooled = pool_blocks(scores, blocks, block // stride1)
            pooled = force_and_mask(pooled, p // block, init_blocks, local_blocks)
            idx = top_k_lowest_index(pooled, min(k, blocks), p // block)
            if idx.shape[-1] < k:
                idx = mx.pad(idx, [(0, 0)] * 3 + [(0, k - idx.shape[-1])], constant_values=-1)
        out.append(idx)
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)


def select_blocks_gpu(
    q: mx.array,
    c1: tuple[mx.array, ...],
    c2: tuple[mx.array, ...],
    starts: Sequence[int],
    *,
    prefill_len: int,
    n_blocks: int,
    k: int,
    scale: float,
    init_blocks: int,
    local_blocks: int,
    block: int,
    compression: tuple[tuple[int, int], tuple[int, int]],
) -> mx.array:
    """GPU path: query tiles as large as the device's tile budget allows (the same tiles at every
    context a budget covers), each one compiled graph over every chunk: scores as matmuls in q's
    dtype (bf16 operands, float32 accumulation), the softmax and head sum in float32 and fused,
    then one partition of unique keys (`_k_smallest`) instead of top-k and its tie-breaking."""
    B, H, T, d = q.shape
    c1, c2 = (_keys_of(parts, q.dtype) for parts in (c1, c2))  # [b, Hk, N, d]
    Hk, N1, N2 = c1.shape[1], c1.shape[2], c2.shape[2]
    strides = tuple(stride for _, stride in compression)
    plan = mx.array([prefill_len] + [_quirk(prefill_len, s) for s in strides], dtype=mx.int32)
    seen = _seen(mx.array(list(starts), dtype=mx.int32), plan, (T, strides, block))
    qg = q.reshape(B, Hk, H // Hk, T, d)
    r = block // compression[0][1]
    choose = (n_blocks, k, init_blocks, local_blocks)
    if scores_cuda.available() and scores_cuda.supports(qg, c1, r):
        # the whole chunk's block scores in one launch (no raw scores kept), then the top-k in
        # tiles of its keys and sort (each query adds Hk rows per batch row to the sort)
        pooled = scores_cuda.pooled_scores(qg, c1, c2, seen[0], seen[1], scale, n_blocks, r)
        rows, dtype = tile_rows(Hk * n_blocks * 16, T, batched=B * Hk), dtype_name(q.dtype)
        out = []
        for s in range(0, T, rows):
            tile = in_turn(pooled[:, :, s : s + rows], out)
            out.append(_choose_tile(tile, seen[2][:, s : s + rows], dtype, choose))
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)
    # per query, H heads' scores: level 1 in q's dtype and float32, level 2 once more in float32
    # (each query adds Hk rows per batch row to the block sort)
    rows = tile_rows(H * (N1 * (q.dtype.size + 4) + N2 * (q.dtype.size + 8)), T, batched=B * Hk)
    # whether `_pooled` takes the CUDA kernels is a constant of the trace, as the rest
    settings = (*choose, scale, r, stage1_cuda.available())
    out = []
    for s in range(0, T, rows):
        tile = in_turn(qg[:, :, :, s : s + rows], out)
        out.append(_select_tile(tile, c1, c2, [x[:, s : s + rows] for x in seen], settings))
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)


def _keys_of(parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
    """Compressed keys as one array [b, Hk, N, d] in the queries' dtype (the shared part is
    broadcast to the rows' batch only when there are both)."""
    parts = tuple(p for p in parts if p.shape[2]) or parts[-1:]
    if len(parts) > 1:
        B = max(p.shape[0] for p in parts)
        parts = (mx.concatenate([mx.broadcast_to(p, (B, *p.shape[1:])) for p in parts], axis=2),)
    return parts[0].astype(dtype)


@mx.compile
def _seen(starts: mx.array, plan: mx.array, settings) -> list[mx.array]:
    """Per query of rows starting at starts [B]: the chunks it sees at each level
    (`visible_chunks`), its block ([B, T] each). plan [1 + levels]: the planned prefill length
    and each level's quirk, as data, so every document runs the same fused kernel."""
    T, strides, block = settings
    pos = starts[:, None] + mx.arange(T, dtype=mx.int32)
    quirk = [mx.where(pos < plan[0], plan[i + 1], 0) for i in range(len(strides))]
    seen = [mx.maximum((pos + 1) // s - 1 + x, 0) for s, x in zip(strides, quirk, strict=True)]
    return [*seen, pos // block]


@mx.compile
def _select_tile(qg: mx.array, c1: mx.array, c2: mx.array, seen, settings) -> mx.array:
    """qg [B, Hk, G, t, d]; c1, c2 [b, Hk, N, d]; seen: [B, t] each, the chunks each query
    sees at levels 1 and 2 and its block; r: level-1 strides per block → [B, Hk, t, K]."""
    n_blocks, k, init_blocks, local_blocks, scale, r, _ = settings
    B, Hk, G, t, _ = qg.shape
    if c1.shape[2] and c2.shape[2]:
        s1, s2 = (qg @ c[:, :, None].swapaxes(-1, -2) for c in (c1, c2))  # [B, Hk, G, t, N]
        pooled = _pooled(s1, s2, seen[0], seen[1], scale, n_blocks, r)
    else:  # no complete chunk: every query scores 0
        pooled = mx.zeros((B, Hk, t, n_blocks), dtype=mx.float32)
    return _choose(pooled, seen[2], dtype_name(qg.dtype), settings[:4])


def _choose(pooled: mx.array, q_blk: mx.array, dtype: str, settings) -> mx.array:
    """The k blocks of pooled [B, Hk, t, n_blocks] (queries in blocks q_blk [B, t]): ascending
    keys, best first: forced blocks, then scores high to low (in q's dtype, named: as the CUDA
    kernel stores them), blocks after the query last → [B, Hk, t, k], -1 past the query's
    block."""
    n_blocks, k, init_blocks, local_blocks = settings
    b = mx.arange(n_blocks)
    qb = q_blk[:, None, :, None]  # [B, 1, t, 1]
    forced = (b < init_blocks) | ((b >= qb - local_blocks) & (b <= qb))
    key = mx.where(forced, -mx.inf, mx.where(b > qb, mx.inf, -pooled.astype(getattr(mx, dtype))))
    idx = _k_smallest(key, k).astype(mx.int32)
    return mx.where(idx > qb, -1, idx)


_choose_tile = mx.compile(_choose)


def _pooled(s1, s2, seen1, seen2, scale: float, n_blocks: int, r: int) -> mx.array:
    """A tile's block scores from its raw scores s1 [B, Hk, G, t, N1], s2 [.., N2] (q's dtype,
    unscaled) and the chunks each query sees (seen1, seen2 [B, t]) → [B, Hk, t, n_blocks]
    float32: each level-1 chunk's probability under the level-2 normaliser, summed over the G
    heads, maxed over the chunks overlapping each block. The dispatcher: on CUDA, two kernels
    reading each score once (`stage1_cuda`); else these MLX ops, their reference."""
    if stage1_cuda.available():
        return stage1_cuda.pooled_scores(s1, s2, seen1, seen2, scale, n_blocks, r)
    B, Hk, _, t, N1 = s1.shape
    N2 = s2.shape[-1]
    v1, v2 = (v[:, None, None, :, None] for v in (seen1, seen2))  # [B, 1, 1, t, 1]
    s2 = mx.where(mx.arange(N2) < v2, s2.astype(mx.float32) * scale, -mx.inf)
    m2 = mx.where(v2 > 0, s2.max(axis=-1, keepdims=True), 0.0)
    lse2 = m2 + mx.log(mx.exp(s2 - m2).sum(axis=-1, keepdims=True))
    s1 = s1.astype(mx.float32) * scale
    p = mx.where((mx.arange(N1) < v1) & (v2 > 0), mx.exp(s1 - lse2), 0.0)
    scores = p.sum(axis=2)  # [B, Hk, t, N1]
    # Pooled over the chunks overlapping each block (r·b−1 … r·b+r−1). Scores are ≥ 0, so zero
    # padding never wins a max; the one block that can lack chunks is the query's own (forced).
    padded = mx.pad(scores, [(0, 0), (0, 0), (0, 0), (1, r * n_blocks - N1)])  # [.., r·nb + 1]
    body = padded[..., : r * n_blocks].reshape(B, Hk, t, n_blocks, r).max(axis=-1)
    return mx.maximum(body, padded[..., r::r])


def _k_smallest(key: mx.array, k: int) -> mx.array:
    """The ids (positions on the last axis) of the k smallest of key [..., n], equal keys by
    the lowest id (SPEC P11), ascending. Where the ids fit beside the key's bits (a 16-bit key
    and n ≤ 65,536, or a 32-bit key), one partition of unique unsigned keys, the key's bits in
    ascending order above the id, then a sort of k: the same ids as a stable sort (MLX's
    partitions need not be stable, but the keys are unique), with no sort of the whole axis
    where MLX partitions by selection. Else a stable argsort."""
    n, bits = key.shape[-1], 8 * key.dtype.size
    if bits not in (16, 32) or n > 1 << 16:
        return mx.sort(mx.argsort(key, axis=-1)[..., :k], axis=-1)
    wide, shift = (mx.uint32, 16) if bits == 16 else (mx.uint64, 32)
    key = mx.where(key == 0, 0, key)  # −0 and +0 are equal: one bit pattern
    raw = mx.view(key, mx.uint16 if bits == 16 else mx.uint32).astype(wide)
    top = 1 << (bits - 1)  # the sign bit: negative floats order reversed, below the positive
    ordered = mx.where(raw >= top, (2 * top - 1) - raw, raw + top)
    unique = (ordered << shift) | mx.arange(n, dtype=wide)
    best = mx.partition(unique, k - 1, axis=-1)[..., :k]
    return mx.sort(best & ((1 << shift) - 1), axis=-1)


def _bucket(n: int, limit: int, step: int) -> int:
    return min(limit, -(-n // step) * step)


def _head(parts: tuple[mx.array, ...], n: int) -> tuple[mx.array, ...]:
    """The first n chunks of the concatenated parts, still as parts."""
    out, left = [], n
    for p in parts:
        take = min(p.shape[2], left)
        out.append(p if take == p.shape[2] else p[:, :, :take])
        left -= take
    return tuple(out)


def select_blocks_ref(
    q: mx.array,
    c1: tuple[mx.array, ...],
    c2: tuple[mx.array, ...],
    starts: Sequence[int],
    *,
    prefill_len: int,
    n_blocks: int,
    k: int,
    scale: float,
    init_blocks: int,
    local_blocks: int,
    block: int,
    compression: tuple[tuple[int, int], tuple[int, int]],
) -> mx.array:
    """Reference: whole score matrix, pooling by explicit ranges, top-k by a stable sort."""
    T = q.shape[2]
    pos = mx.array(list(starts), dtype=mx.int32)[:, None] + mx.arange(T, dtype=mx.int32)
    vis = [visible_chunks(pos, prefill_len, stride) for _, stride in compression]
    scores = np.array(chunk_scores(q, c1, c2, *vis, scale))  # [B, Hk, T, N1]
    B, Hk, T, n1 = scores.shape
    qb = np.array(pos) // block
    r = block // compression[0][1]  # level-1 strides per block
    out = np.full((B, Hk, T, k), -1, dtype=np.int32)
    for b in range(B):
        for g in range(Hk):
            for t in range(T):
                block = np.full(n_blocks, -np.inf, dtype=np.float32)
                for i in range(n_blocks):
                    lo, hi = max(r * i - 1, 0), min(r * i + r, n1)
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
