"""InfLLM-v2 for one query per row, the decode step (SPEC §4.4): stage-1 scores, block pooling,
top-k and stage-2 attention as one compiled graph.

In a decode step the arithmetic of a sparse layer is small and its ~70 op dispatches are most
of the time. The step's shapes stay the same for thousands of tokens when every buffer is read
whole (its capacity; what is not written yet is masked by position) and the block count is
rounded up to a multiple of 64: then one compiled graph per shape replaces those dispatches.
The same layouts and results as `select_blocks` then `block_sparse_attention`, whose
references this is tested against. The config's `block` and `compression` reach the compiled
graphs as plain ints, which `mx.compile` treats as constants of the graph, not as inputs.

On the CPU, for float32, the step runs instead as one C++ primitive where it is built
(`native.sparse_decode_step`, salabatch/engine/native/sparse_decode.cpp); these graphs are its
reference in the tests and what every other device and dtype runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import mlx.core as mx

from salabatch.engine.kernels import native
from salabatch.engine.kernels.attention import LOG2E, attention, exp2_poly, lanes, on_gpu
from salabatch.engine.kernels.sparse_attention import KVView
from salabatch.engine.kernels.sparse_select import (
    chunk_scores,
    force_and_mask,
    pool_blocks,
    top_k_lowest_index,
    visible_chunks,
)

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
) -> tuple[mx.array, mx.array]:
    """q [B, H, 1, d] at positions starts[b]; c1/c2 as in select_blocks, whose last part may be
    a whole buffer (chunks not complete yet are masked). → (o [B, H, 1, d], idx [B, Hk, 1, K]).

    The MLX-op step splits a batch of at least LANE_ROWS rows between the lanes (on the CPU, a
    core each: ~1.5× at batch 8); a smaller one is too short a step for two streams. The
    native step runs on one stream and splits its kv heads between the cores itself."""
    blocks = -(-n_blocks // BLOCK_BUCKET) * BLOCK_BUCKET
    settings = (prefill_len, blocks, k, scale, init_blocks, local_blocks, block, compression)
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


def dense_step(q: mx.array, kv: KVView, starts: Sequence[int], scale: float, block: int):
    """Dense attention of q [B, H, 1, d], row b at position starts[b] over its keys up to there,
    as the native step with every block selected (where `runs_native`): the shared prefix read
    once for all rows, as in a sparse step. → o [B, H, 1, d] float32."""
    return native.dense_decode_step(
        q, mx.array(list(starts), dtype=mx.int32),
        () if not kv.start else (kv.shared_k, kv.shared_v), kv.rows_k, kv.rows_v,
        start=kv.start, blocks=max(starts) // block + 1, scale=scale, block=block,
        stream=mx.default_stream(mx.default_device()),
    )  # fmt: skip


def _native_step(q, kv, c1, c2, starts, settings):
    prefill_len, _, k, scale, init_blocks, local_blocks, block, compression = settings
    shared = () if not kv.start else (kv.shared_k, kv.shared_v)
    return native.sparse_decode_step(
        q, mx.array(list(starts), dtype=mx.int32), c1, c2, shared, kv.rows_k, kv.rows_v,
        start=kv.start, prefill_len=prefill_len, k=k, scale=scale, init_blocks=init_blocks,
        local_blocks=local_blocks, block=block, compression=compression,
        stream=mx.default_stream(mx.default_device()),
    )  # fmt: skip


def _step(q, kv, c1, c2, starts, settings):
    prefill_len, blocks, k, scale, init_blocks, local_blocks, block, compression = settings
    pos = mx.array(list(starts), dtype=mx.int32)
    idx = _select(
        q, pos, c1, c2, prefill_len, blocks, k, scale, init_blocks, local_blocks, block, compression
    )
    # stage 2: one attention per (row, kv head) pair, its G query heads as the rows
    B, H, _, d = q.shape
    Hk = kv.rows_k.shape[1]
    shared = () if kv.shared_k is None else (kv.shared_k, kv.shared_v)
    attend = _attend_take if on_gpu() or CPU_STEP == "take" else _attend_blocks
    o = attend(
        q.reshape(B * Hk, 1, H // Hk, d), idx.reshape(B * Hk, k), mx.repeat(pos, Hk),
        shared, kv.rows_k, kv.rows_v, kv.start, scale, block,
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


def _attend_take_graph(q, sel, pos, shared, rows_k, rows_v, start, scale, block):
    """Stage 2 for the pairs p = b·Hk + g: q [n, 1, G, d], sel [n, k], pos [n] → like q.

    Without shared keys one `take` of whole blocks from the rows' buffer. With them, the
    slots in the shared keys are gathered from the shared buffer and the row's own positions (its
    question and answer) are read whole, masked to the selected blocks."""
    n, _, G, d = q.shape
    k = sel.shape[-1]
    Hk = rows_k.shape[1]
    pairs = mx.arange(n)
    allowed = (sel[..., None] >= 0) & (
        sel[..., None] * block + mx.arange(block) <= pos[:, None, None]
    )
    allowed = allowed.reshape(n, k * block)
    safe = mx.maximum(sel, 0)
    if not start:
        at = pairs[:, None] * (rows_k.shape[2] // block) + safe
        keys, values = _take(rows_k, at, block), _take(rows_v, at, block)
        return attention(q, keys, values, scale, allowed.reshape(n, 1, 1, -1))
    shared_k, shared_v = shared
    S = start // block
    at = (pairs % Hk)[:, None] * (shared_k.shape[2] // block) + mx.minimum(safe, S - 1)
    R = rows_k.shape[2]
    own_k, own_v = rows_k.reshape(n, 1, R, d), rows_v.reshape(n, 1, R, d)
    member = (sel[:, :, None] == S + mx.arange(R // block)).any(axis=1)  # [n, R/block]
    own = mx.repeat(member, block, axis=-1) & (start + mx.arange(R) <= pos[:, None])
    in_shared = mx.repeat(sel < S, block, axis=-1)
    mask = mx.concatenate([allowed & in_shared, own], axis=-1)
    return attention(
        q,
        (_take(shared_k, at, block), own_k),
        (_take(shared_v, at, block), own_v),
        scale,
        mask.reshape(n, 1, 1, -1),
    )


def _attend_blocks_graph(q, sel, pos, shared, rows_k, rows_v, start, scale, block):
    """Stage 2 as `_attend_take_graph`, each selected block multiplied where it lies
    (`gather_mm`): no gathered copy of the keys and values, ~4× less time on the CPU at batch 8.
    Scores stay per block, [n, k, G, block], and the softmax runs over the (k, block) axes."""
    n, _, G, d = q.shape
    k = sel.shape[-1]
    Hk = rows_k.shape[1]
    pairs = mx.arange(n)
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
        at = pairs[:, None] * (rows_k.shape[2] // block) + safe
    table_k, table_v = table_k.reshape(-1, block, d), table_v.reshape(-1, block, d)
    at = at.astype(mx.uint32)
    lhs = mx.broadcast_to(pairs[:, None], (n, k)).astype(mx.uint32)
    s = mx.gather_mm(qs, table_k.swapaxes(-1, -2), lhs, at)  # [n, k, G, block]
    s = mx.where(allowed[:, :, None], s, -mx.inf)
    top = s.max(axis=(1, 3))  # [n, G]
    if start:
        R = rows_k.shape[2]
        own_k, own_v = rows_k.reshape(n, R, d), rows_v.reshape(n, R, d)
        member = (sel[:, :, None] == S + mx.arange(R // block)).any(axis=1)  # [n, R/block]
        own = mx.repeat(member, block, axis=-1) & (start + mx.arange(R) <= pos[:, None])
        s_own = mx.where(own[:, None], qs.reshape(n, G, d) @ own_k.swapaxes(-1, -2), -mx.inf)
        top = mx.maximum(top, s_own.max(axis=-1))
    p = exp2_poly(s - top[:, None, :, None])
    total = p.sum(axis=(1, 3))
    slots = mx.arange(n * k, dtype=mx.uint32).reshape(n, k)
    o = mx.gather_mm(p, table_v, slots, at).sum(axis=1)  # [n, G, d]
    if start:
        p_own = exp2_poly(s_own - top[..., None])
        o, total = o + p_own @ own_v, total + p_own.sum(axis=-1)
    return (o / total[..., None]).reshape(n, 1, G, d)


# The decode step on the CPU: "native" (the C++ primitive of native.py where it is built, for
# float32; otherwise "blocks"), or the compiled MLX-op graphs with stage 2 as "blocks"
# (gather_mm) or "take" (the form a GPU runs). Tests set it to check every form on the CPU.
CPU_STEP = "native"
_select = mx.compile(_select_graph)
_attend_take = mx.compile(_attend_take_graph)
_attend_blocks = mx.compile(_attend_blocks_graph)


def _take(buffer: mx.array, at: mx.array, block: int) -> mx.array:
    """buffer [b, Hk, N, d] as a table of blocks; at [n, k] → [n, 1, k·block, d]."""
    d = buffer.shape[-1]
    n, k = at.shape
    return mx.take(buffer.reshape(-1, block * d), at, axis=0).reshape(n, 1, k * block, d)
