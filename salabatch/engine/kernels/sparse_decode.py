"""InfLLM-v2 for one query per row, the decode step (SPEC §4.4): stage-1 scores, block pooling,
top-k and stage-2 attention. Two forms, the same results, each tested against the references
(`select_blocks_ref`, `block_sparse_attention_ref`):

* the CPU's (`infllm_v2_step`, `dense_step`): per layer, as the model's per-layer decode call
  runs it: one C++ primitive where it is built, for float32 (`native.sparse_decode_step`,
  salabatch/engine/native/sparse_decode.cpp), else compiled MLX-op graphs of whole buffers and
  block counts in buckets of 64, the config's `block` and `compression` constants of the graph;
* the GPU's (`decode_attention`, below): one piece of the model's single compiled decode step
  (salabatch.engine.decode), with everything that changes per document or step an array.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from salabatch.engine.kernels import decode_cuda, native
from salabatch.engine.kernels.attention import (
    LOG2E,
    attention,
    exp2_poly,
    gather_products,
    lanes,
    on_gpu,
)
from salabatch.engine.kernels.sparse_attention import KVView
from salabatch.engine.kernels.sparse_select import (
    chunk_scores,
    force_and_mask,
    pool_blocks,
    top_k_lowest_index,
    visible_chunks,
)
from salabatch.engine.kernels.stage2_cuda import block_attention_takes

BLOCK_BUCKET = 64  # blocks: the step's shapes change once per 4096 tokens
LANE_ROWS = 4  # rows from which a step is split between the lanes


def infllm_v2_step(
    q: mx.array,
    kv: KVView,
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
    queries: int = 1,
) -> tuple[mx.array, mx.array]:
    """q [B, H, 1, d] at positions starts[b]; c1/c2 as in select_blocks, whose last part may be
    a whole buffer (chunks not complete yet are masked). → (o [B, H, 1, d], idx [B, Hk, 1, K]).
    `queries` > 1: q has that many rows per row of kv and c1/c2's rows, a verify pass's
    positions of one row, each computed as its own step (one call of the native step, or of the
    MLX-op graphs, whose rows then read their kv row's keys in place).

    The MLX-op step splits a batch of at least LANE_ROWS rows between the lanes (on the CPU, a
    core each: ~1.5× at batch 8); a smaller one is too short a step for two streams. The
    native step runs on one stream and splits its kv heads between the cores itself."""
    blocks = -(-n_blocks // BLOCK_BUCKET) * BLOCK_BUCKET
    settings = (prefill_len, blocks, k, scale, init_blocks, local_blocks, block, compression)
    if queries > 1:
        step = _native_step if runs_native(q, kv) else _step
        return step(q, kv, c1, c2, starts, settings, queries)
    B = q.shape[0]
    step = _native_step if runs_native(q, kv) else _step
    lane = lanes() if B >= LANE_ROWS and step is _step else lanes()[:1]
    cut = [B * i // len(lane) for i in range(len(lane) + 1)]
    outs = []
    for i, (a, b) in enumerate(itertools.pairwise(cut)):
        rows = [(*parts[:-1], parts[-1][a:b]) for parts in (c1, c2)]  # shared parts stay whole
        with mx.stream(lane[i]):
            outs.append(step(q[a:b], kv.slice(a, b), *rows, starts[a:b], settings))
    if len(outs) == 1:
        return outs[0]
    return tuple(mx.concatenate(part) for part in zip(*outs, strict=True))


def runs_native(q: mx.array, kv: KVView) -> bool:
    """The C++ step where it is built, on the CPU, for float32 (what it is written for); also
    for dense decode steps (`dense_step`)."""
    if on_gpu() or CPU_STEP != "native" or native.missing():
        return False
    return q.dtype == kv.rows_k.dtype == mx.float32


def dense_step(
    q: mx.array, kv: KVView, starts: Sequence[int], scale: float, block: int, queries: int = 1
):
    """Dense attention of q [B, H, 1, d], row b at position starts[b] over its keys up to there,
    as the native step with every block selected (where `runs_native`): the shared prefix read
    once for all rows, as in a sparse step; `queries` rows of q per row of kv (as in
    `infllm_v2_step`). → o [B, H, 1, d] float32."""
    return native.dense_decode_step(
        q, mx.array(list(starts), dtype=mx.int32),
        () if not kv.start else (kv.shared_k, kv.shared_v), kv.rows_k, kv.rows_v,
        start=kv.start, blocks=max(starts) // block + 1, scale=scale, block=block,
        stream=mx.default_stream(mx.default_device()), queries=queries,
    )  # fmt: skip


def _native_step(q, kv, c1, c2, starts, settings, queries=1):
    prefill_len, _, k, scale, init_blocks, local_blocks, block, compression = settings
    shared = () if not kv.start else (kv.shared_k, kv.shared_v)
    return native.sparse_decode_step(
        q, mx.array(list(starts), dtype=mx.int32), c1, c2, shared, kv.rows_k, kv.rows_v,
        start=kv.start, prefill_len=prefill_len, k=k, scale=scale, init_blocks=init_blocks,
        local_blocks=local_blocks, block=block, compression=compression,
        stream=mx.default_stream(mx.default_device()), queries=queries,
    )  # fmt: skip


def _step(q, kv, c1, c2, starts, settings, queries=1):
    """The MLX-op step: q [B·queries, H, 1, d], `queries` rows per row of kv (each at its own
    position starts[i])."""
    prefill_len, blocks, k, scale, init_blocks, local_blocks, block, compression = settings
    pos = mx.array(list(starts), dtype=mx.int32)
    if queries > 1:  # the rows' own compressed keys once per query (the shared part is common)
        c1, c2 = (
            tuple(p if p.shape[0] == 1 else mx.repeat(p, queries, 0) for p in c) for c in (c1, c2)
        )
    idx = _select(
        q, pos, c1, c2, prefill_len, blocks, k, scale, init_blocks, local_blocks, block, compression
    )
    # stage 2: one attention per (query row, kv head) pair, its G query heads as the rows
    B, H, _, d = q.shape
    Hk = kv.rows_k.shape[1]
    shared = () if kv.shared_k is None else (kv.shared_k, kv.shared_v)
    o = _attend_blocks(
        q.reshape(B * Hk, 1, H // Hk, d), idx.reshape(B * Hk, k), mx.repeat(pos, Hk),
        shared, kv.rows_k, kv.rows_v, kv.start, scale, block, queries,
    )  # fmt: skip
    return o.reshape(B, H, 1, d), idx


def _select_graph(q, pos, c1, c2, prefill_len, blocks, k, scale, init, local, block, compression):
    """Stage 1, pooling and top-k for one query per row → idx [B, Hk, 1, k]."""
    q_pos = pos[:, None]  # [B, 1]
    vis = [visible_chunks(q_pos, prefill_len, stride) for _, stride in compression]
    scores = chunk_scores(q, c1, c2, *vis, scale, exp2=exp2_poly)  # [B, Hk, 1, N1]
    q_blk = q_pos // block
    r = block // compression[0][1]  # level-1 strides per block
    pooled = force_and_mask(pool_blocks(scores, blocks, r), q_blk, init, local)
    return top_k_lowest_index(pooled, k, q_blk)


def _attend_blocks_graph(q, sel, pos, shared, rows_k, rows_v, start, scale, block, queries=1):
    """Stage 2 for the pairs p = b·Hk + g: q [n, 1, G, d], sel [n, k], pos [n] → like q; each
    selected block multiplied where it lies (`gather_mm`): no gathered copy of the keys and
    values (~4× less time on the CPU at batch 8 than a `take`). With shared keys, the slots in
    them are read from the shared buffer and the row's own positions whole, masked to the
    selected blocks. `queries` query rows b per row of keys: pair p reads kv row b // queries.
    Scores stay per block, [n, k, G, block], and the softmax runs over the (k, block) axes."""
    n, _, G, d = q.shape
    k = sel.shape[-1]
    Hk = rows_k.shape[1]
    pairs = mx.arange(n)
    kv_pairs = pairs if queries == 1 else pairs // (Hk * queries) * Hk + pairs % Hk
    safe = mx.maximum(sel, 0)
    allowed = (sel[..., None] >= 0) & (
        sel[..., None] * block + mx.arange(block) <= pos[:, None, None]
    )  # [n, k, block]
    qs = q.reshape(n, 1, G, d) * (scale * LOG2E)  # base 2 as on the CPU path of `attention`
    if start:  # blocks in the shared keys; the row's own positions below, read whole
        table_k, table_v = shared
        S = start // block
        at = (pairs % Hk)[:, None] * (table_k.shape[2] // block) + mx.minimum(safe, S - 1)
        allowed = allowed & (sel < S)[..., None]
    else:
        table_k, table_v = rows_k, rows_v
        at = kv_pairs[:, None] * (rows_k.shape[2] // block) + safe
    table_k, table_v = table_k.reshape(-1, block, d), table_v.reshape(-1, block, d)
    at = at.astype(mx.uint32)
    lhs = mx.broadcast_to(pairs[:, None], (n, k)).astype(mx.uint32)
    s = gather_products(qs, table_k.swapaxes(-1, -2), lhs, at)  # [n, k, G, block]
    s = mx.where(allowed[:, :, None], s, -mx.inf)
    top = s.max(axis=(1, 3))  # [n, G]
    if start:
        R = rows_k.shape[2]
        own_k, own_v = rows_k.reshape(-1, R, d), rows_v.reshape(-1, R, d)
        if queries > 1:  # each pair its kv row's own keys (a fork's own: a few hundred)
            own_k, own_v = own_k[kv_pairs], own_v[kv_pairs]
        member = (sel[:, :, None] == S + mx.arange(R // block)).any(axis=1)  # [n, R/block]
        own = mx.repeat(member, block, axis=-1) & (start + mx.arange(R) <= pos[:, None])
        s_own = mx.where(own[:, None], qs.reshape(n, G, d) @ own_k.swapaxes(-1, -2), -mx.inf)
        top = mx.maximum(top, s_own.max(axis=-1))
    p = exp2_poly(s - top[:, None, :, None])  # float32, as its sums
    total = p.sum(axis=(1, 3))
    slots = mx.arange(n * k, dtype=mx.uint32).reshape(n, k)
    o = gather_products(p.astype(q.dtype), table_v, slots, at).sum(axis=1)  # [n, G, d]
    if start:
        p_own = exp2_poly(s_own - top[..., None])
        o, total = o + p_own.astype(q.dtype) @ own_v, total + p_own.sum(axis=-1)
    return (o / total[..., None]).astype(q.dtype).reshape(n, 1, G, d)


# The decode step on the CPU: "native" (the C++ primitive of native.py where it is built, for
# float32) or "blocks" (the compiled MLX-op graphs, stage 2 as blocks multiplied in place).
# Tests set it to check both forms on the CPU.
CPU_STEP = "native"
_select = mx.compile(_select_graph)
_attend_blocks = mx.compile(_attend_blocks_graph)


# -- the GPU form: one graph inside the model's compiled decode step ------------------------------
#
# Everything that changes per document or per step is an array, never a Python constant, and
# every buffer is read whole, so the graph depends only on the buffers' capacities
# (`sparse_cache.capacity`), the batch size and the mode: the model's step traces once per such
# shape (salabatch.engine.decode). Each op is a kernel launch there, so what the host already
# knows it computes in numpy: per step the rows' positions and what follows from them (`rows`),
# per batch the map of score entries to chunk numbers and blocks (`tables`). The rows' own
# compressed keys are summed afresh from their keys (a fork's rows hold a few hundred) instead
# of being kept in buffers rewritten every step, and top-k is one partition of exact keys.

DENSE, MIXED, SPARSE = "dense", "mixed", "sparse"
_UNSEEN = np.iinfo(np.int32).max  # the chunk number of an entry that is no chunk


def step_mode(positions: Sequence[int], dense_len: int) -> str:
    """Which rows of a decode step (queries at `positions`) attend sparsely: all, none, or
    some. A row is sparse once its sequence, this token included, reaches dense_len (SPEC P7)."""
    sparse = [p + 1 >= dense_len for p in positions]
    return SPARSE if all(sparse) else DENSE if not any(sparse) else MIXED


def step_rows(positions: Sequence[int], start: int, block: int, strides: Sequence[int]):
    """[B, 3 + levels] int32, per row: its position, its place in its own buffers (past the
    shared `start`), its block, then the chunks it sees at each level (SPEC §4.4)."""
    pos = np.asarray(positions, dtype=np.int64)[:, None]
    seen = [np.maximum((pos + 1) // s - 1, 0) for s in strides]
    return mx.array(
        np.concatenate([pos, pos - start, pos // block, *seen], axis=1).astype(np.int32)
    )


def step_tables(
    start: int,
    counts: Sequence[int],
    shared_entries: Sequence[int],
    own: int,
    n_blocks: int,
    block: int,
    compression: tuple[tuple[int, int], tuple[int, int]],
) -> dict[str, mx.array]:
    """The batch's map of stage-1 score entries, [the shared chunk buffer (shared_entries[l]
    entries, the first counts[l] of them chunks) | the rows' chunks, summed from their `own`
    keys | at level 1, one entry scoring 0]: `numbers{l}` [E_l] each entry's chunk number
    (_UNSEEN for none), `pool` [n_blocks, r + 1] the level-1 entries of the chunks overlapping
    each block (the 0 entry where a chunk does not exist), `first` [1] the first block the
    rows own."""
    tables = {"first": mx.array([start // block], dtype=mx.int32)}
    for level, (_, stride) in enumerate(compression):
        shared = np.arange(shared_entries[level])
        shared = np.where(shared < counts[level], shared, _UNSEEN)
        mine = start // stride + np.arange(own // stride - 1)
        mine = np.where(mine >= counts[level], mine, _UNSEEN)
        zero = [_UNSEEN] if level == 0 else []
        tables[f"numbers{level}"] = mx.array(np.concatenate([shared, mine, zero]).astype(np.int32))
    stride = compression[0][1]
    r, zero = block // stride, tables["numbers0"].shape[0] - 1
    chunk = r * np.arange(n_blocks)[:, None] - 1 + np.arange(r + 1)  # [n_blocks, r + 1]
    entry = np.where(chunk < counts[0], chunk, shared_entries[0] + chunk - start // stride)
    exists = (chunk >= 0) & (entry >= 0) & (entry < zero)
    tables["pool"] = mx.array(np.where(exists, entry, zero).astype(np.int32))
    return tables


def decode_attention(
    q: mx.array,
    rows: Sequence[mx.array],
    shared: Sequence[mx.array],
    info: mx.array,
    tables: dict[str, mx.array],
    *,
    mode: str,
    k: int,
    dense_len: int,
    scale: float,
    init_blocks: int,
    local_blocks: int,
    block: int,
    compression: tuple[tuple[int, int], tuple[int, int]],
) -> tuple[mx.array, mx.array]:
    """One query per row against its cache, dense or InfLLM-v2 by row (SPEC §4.4).

    q [B, H, 1, d], its own key already written; rows: the rows' keys and values [B, Hk, R, d]
    (R a multiple of the widest compression stride); shared: the shared keys' (keys, values
    [1, Hk, S, d], chunks1, chunks2 [1, Hk, ·, d]) or (); info: `step_rows`; tables:
    `step_tables`. → (o [B, H, 1, d], idx [B, Hk, 1, slots]): the blocks each row attended
    (sorted, -1 for none; computed only where read). A dense row attends every block up to
    its own (the same as dense attention), a sparse row its top-k.
    """
    B, Hk = q.shape[0], rows[0].shape[1]
    n_blocks = (rows[0].shape[2] + (shared[0].shape[2] if shared else 0)) // block
    k = min(k, n_blocks)
    pos, q_blk = info[:, :1], info[:, 2:3]  # [B, 1]
    slots = k if mode == SPARSE else max(k, min(n_blocks, -(-dense_len // block)))
    if mode != DENSE:
        top = _select_step(q, rows[0], shared[2:], info, tables, n_blocks, k, scale, init_blocks,
                           local_blocks, block, compression)  # fmt: skip
        chosen = mx.sort(top, axis=-1)  # as the reference writes it: -1 past the query's block
        chosen = mx.where(chosen > q_blk[:, :, None], -1, chosen)
    if mode != SPARSE:
        every = mx.array(np.arange(slots, dtype=np.int32))
        dense = mx.broadcast_to(mx.where(every <= q_blk, every, -1)[:, None], (B, Hk, slots))
    if mode == SPARSE:
        attend, idx = top, chosen
    elif mode == DENSE:
        attend = idx = dense
    else:
        sparse_row = (pos + 1 >= dense_len)[:, :, None]
        pad = [(0, 0), (0, 0), (0, slots - k)]
        attend = mx.where(sparse_row, mx.pad(top, pad, constant_values=-1), dense)
        idx = mx.where(sparse_row, mx.pad(chosen, pad, constant_values=-1), dense)
    o = _attend_step(q, attend, info, rows, shared[:2], tables["first"], scale, block,
                     padded=mode != SPARSE)  # fmt: skip
    return o, idx[:, :, None]


def _select_step(
    q, keys, shared_c, info, tables, n_blocks, k, scale, init, local, block, compression
):
    """Stage 1, pooling and top-k of one query per row → block ids [B, Hk, k]. The dispatcher:
    for rows forked from shared keys, on CUDA with its kernel switched on, the shared chunks'
    scores as two matmuls and the rest in one launch (`decode_cuda`: the rows' own chunks and
    their scores, the normaliser, the head sum, the pooling, the top-k; ids ascending); else
    `select_step_ref`'s MLX ops (ids unordered)."""
    B, H, _, d = q.shape
    Hk, R = keys.shape[1], keys.shape[2]
    G = H // Hk
    qg = q.reshape(B, Hk, G, d)
    kw = dict(k=k, scale=scale, init=init, local=local)
    strides = [stride for _, stride in compression]
    if (
        shared_c
        and decode_cuda.available()
        and decode_cuda.supports(n_blocks, G, k, R, d, keys.dtype.size, strides)
    ):
        shared = [qg @ c.swapaxes(-1, -2) for c in shared_c]  # [B, Hk, G, S_l]
        return decode_cuda.top_k(qg, keys, shared, tables, info, compression, **kw)
    return select_step_ref(qg, keys, shared_c, tables, info, compression, **kw)


def select_step_ref(qg, keys, shared_c, tables, info, compression, *, k, scale, init, local):
    """`_select_step` as MLX ops, for qg [B, Hk, G, d]: the rows' chunks from their own keys
    (summed as the cache sums them, the same bits), every entry's score (the shared chunks',
    then the rows' own, at level 1 one more entry scoring 0: where pooling finds no chunk),
    the level-2 normaliser, each level-1 entry's probability summed over the heads, pooled by
    `tables["pool"]`, then `_top_k`."""
    B, Hk, G, d = qg.shape
    R = keys.shape[2]
    wide = keys.astype(mx.float32)
    levels = []
    for level, (size, stride) in enumerate(compression):
        groups = wide.reshape(B, Hk, R // stride, stride, d).sum(axis=3)
        own = ((groups[:, :, :-1] + groups[:, :, 1:]) / size).astype(keys.dtype)
        s = [qg @ p.swapaxes(-1, -2) for p in (*shared_c[level : level + 1], own)]
        if level == 0:
            s.append(mx.broadcast_to(mx.array(np.zeros((1, 1, 1, 1)), qg.dtype), (B, Hk, G, 1)))
        seen = tables[f"numbers{level}"] < info[:, None, None, 3 + level : 4 + level]
        levels.append((mx.concatenate(s, axis=-1), seen))  # [B, Hk, G, E], [B, 1, 1, E]
    (s1, seen1), (s2, seen2) = levels
    any2 = info[:, None, None, 4:5] > 0  # a level-2 chunk is visible
    # the level-2 normaliser in one kernel (where no chunk is visible it is not finite, and
    # unused: p is 0 there)
    lse2 = mx.logsumexp(mx.where(seen2, s2.astype(mx.float32) * scale, -mx.inf), -1, True)
    p = mx.where(seen1 & any2, mx.exp(s1.astype(mx.float32) * scale - lse2), 0.0).sum(axis=2)
    # block b: the max over the level-1 chunks r·b − 1 … r·b + r − 1, by their entries
    pool = tables["pool"]
    pooled = mx.take(p, pool.reshape(-1), axis=-1).reshape(B, Hk, *pool.shape).max(axis=-1)
    return _top_k(pooled, k, info[:, None, 2:3], init, local)  # [B, Hk, nb] → [B, Hk, k]


def _top_k(scores: mx.array, k: int, q_blk: mx.array, init: int, local: int) -> mx.array:
    """The ids of the k best of scores [B, Hk, n] float32 ≥ 0, with the first `init` blocks
    and the local window (q_blk [B, 1, 1] and `local` before it) forced and the blocks after
    q_blk excluded, ties to the lowest id (SPEC P11); in no order → [B, Hk, k] int32.

    One partition of exact keys: a score's bits (for floats ≥ 0, ordered as unsigned ints)
    above the complement of its id, so that equal scores rank by id; forced blocks get the
    largest key, excluded ones the smallest (`sparse_select.top_k_lowest_index` is the
    reference)."""
    n = scores.shape[-1]
    b = mx.array(np.arange(n, dtype=np.int32))
    forced = (b < init) | ((b >= q_blk - local) & (b <= q_blk))
    bits = mx.view(scores, mx.uint32).astype(mx.uint64) + 1
    bits = mx.where(forced, np.uint64(0xFFFFFFFF), mx.where(b > q_blk, 0, bits))
    low = mx.array(np.arange(n - 1, -1, -1, dtype=np.uint64))  # n − 1 − id
    best = mx.topk((bits << 32) | low, k, axis=-1)
    return (n - 1) - (best & 0xFFFFFFFF).astype(mx.int32)


def _attend_step(q, idx, info, rows_kv, shared_kv, first, scale, block, padded):
    """Stage 2: q [B, H, 1, d] against the blocks idx [B, Hk, slots] (-1: none, where
    `padded`), each read from the shared keys (blocks before `first`) or the row's own;
    causal by position. The dispatcher: on CUDA with its kernels switched on, two launches
    (`decode_cuda.attend`: each block read in place, the slots in splits, then their sum);
    else these MLX ops (the blocks gathered, one SDPA with a mask)."""
    B, H, _, d = q.shape
    Hk, R = rows_kv[0].shape[1], rows_kv[0].shape[2] // block
    if decode_cuda.available() and block_attention_takes(q, H // Hk, block):
        return decode_cuda.attend(q, idx, info, rows_kv, shared_kv, first, scale, block)
    slots = idx.shape[-1]
    safe = mx.maximum(idx, 0) if padded else idx
    pairs = mx.array((np.arange(B)[:, None] * Hk + np.arange(Hk))[..., None] * R)  # [B, Hk, 1]
    own = pairs + mx.clip(safe - first, 0, R - 1)
    keys, values = (mx.take(a.reshape(-1, block * d), own, axis=0) for a in rows_kv)
    if shared_kv:
        C = shared_kv[0].shape[2] // block
        at = mx.array(np.arange(Hk)[:, None] * C) + mx.minimum(safe, C - 1)  # [B, Hk, slots]
        in_shared = (safe < first)[..., None]
        keys, values = (
            mx.where(in_shared, mx.take(a.reshape(-1, block * d), at, axis=0), mine)
            for a, mine in zip(shared_kv, (keys, values), strict=True)
        )
    key_pos = idx[..., None] * block + mx.array(np.arange(block, dtype=np.int32))
    allowed = key_pos <= info[:, None, None, :1]  # [B, Hk, slots, block]
    if padded:
        allowed = allowed & (idx[..., None] >= 0)
    n = B * Hk
    o = attention(
        q.reshape(n, 1, H // Hk, d),
        keys.reshape(n, 1, slots * block, d),
        values.reshape(n, 1, slots * block, d),
        scale,
        allowed.reshape(n, 1, 1, slots * block),
    )
    return o.reshape(B, H, 1, d)
