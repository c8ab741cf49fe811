"""Softmax attention, the one dispatcher every attention of the sparse layers goes through.

Layout: q [B, H, Tq, d]; keys and values [B, Hk, Tk, d], H a multiple of Hk (GQA: query head h
reads kv head h // (H / Hk)); the result is [B, H, Tq, d] in q's dtype. Keys and values may also
come as a tuple of parts concatenated along Tk, each [B or 1, Hk, n, d]: a part with batch 1 is
the shared keys (or values) of every row, read once rather than copied per row.

mask: None (every key), "causal" (query i sits at position Tk − Tq + i: the queries are the last
Tq of the keys), or a boolean array (True = attend) broadcastable to [B, H, Tq, Tk]. Every query
must be allowed at least one key.

On a GPU the dispatcher calls MLX's fused SDPA in one call (`mask="causal"` stays a string, so
the fused kernel never reads a mask array). On the CPU, where MLX's `exp` costs ~13 ns an
element, it computes a base-2 softmax (`power(2, ·)` is about 3× cheaper, same numbers up to
float32 rounding) in query tiles, so the score buffer stays bounded whatever the length.
"""

from __future__ import annotations

import functools
import math
import os

import mlx.core as mx

LOG2E = math.log2(math.e)
# CPU: bound on the [B, H, rows, Tk] float32 score tile (elements, 256 MiB).
MAX_SCORE_ELEMENTS = 1 << 26
# CPU: queries are split between lanes only in tiles of at least this many.
LANE_ROWS = 64
# GPU path: the share of the device's memory one query tile's transient arrays may take. MLX
# encodes ahead of the device, so a few tiles are alive at once, beside weights and caches.
TILE_MEMORY_SHARE = 1 / 16
# GPU path: queries per tile at most. A thousand queries of 32 heads already fill a GPU; larger
# tiles only hold more memory (and a 8K chunk's graph has the same tiles at every context).
TILE_ROWS = 1024
# GPU path: the most entries one `gather_mm` or sort may batch. MLX's CUDA backend launches
# them with one grid row per entry, and a grid's y and z sizes stop at 65,535: at 65,536 the
# launch fails ("cuGraphAddKernelNode ... invalid argument"; seen on an H200, MLX 0.32.4, for
# gather_mm, argsort, topk and argpartition). Tiles keep under it on every device, so the
# graphs counted on the CPU are the ones CUDA runs.
GRID_ROWS = 65_535

Parts = mx.array | tuple[mx.array, ...]


@functools.cache
def _second_lane() -> mx.Stream:
    # Created once per process, and per thread by MLX: since MLX 0.31.2 a stream belongs to the
    # thread that made it, so a plain `new_stream` cached here would fail on any other thread.
    # Older MLX, whose streams are global, has no thread-local kind and needs none.
    new = getattr(mx, "new_thread_local_stream", mx.new_stream)
    return new(mx.cpu)


def on_gpu() -> bool:
    """Whether the kernels take their GPU branches: the one place they ask. True on a GPU (Metal
    or CUDA), and on any device under `SALABATCH_GPU_PATH=1`, which runs the GPU path's graphs
    on the CPU so their results, node counts and traces are tested without a GPU."""
    return (
        os.environ.get("SALABATCH_GPU_PATH") == "1" or mx.default_device().type == mx.DeviceType.gpu
    )


def gather_products(a: mx.array, b: mx.array, lhs: mx.array, rhs: mx.array) -> mx.array:
    """`mx.gather_mm(a, b, lhs, rhs)`: the products a[lhs] @ b[rhs] over a's and b's matrices
    (their batch axes flattened), lhs and rhs int index arrays of one shape → [*lhs.shape, M,
    N]. MLX's CPU backend multiplies in place only in float32: off the GPU path, other dtypes
    (a bf16 model on the CPU) take the matrices first, then multiply (copies of what is read);
    the GPU path keeps its one kernel, also where `SALABATCH_GPU_PATH` counts it on the CPU."""
    if a.dtype == mx.float32 or on_gpu():
        return mx.gather_mm(a, b, lhs, rhs)
    a = a.reshape(-1, *a.shape[-2:])
    b = b.reshape(-1, *b.shape[-2:])
    return a[lhs] @ b[rhs]


# The custom CUDA kernels (`kernels/stage1_cuda.py`, `scores_cuda.py`, `stage2_cuda.py`,
# `decode_cuda.py`, `gla_cuda.py`, `norm_cuda.py`, `rows_cuda.py`), and those on by default:
# the ones whose parity tests (marked `gpu`) have passed on a GPU and that won there
# (benchmarks/README.md, GPU). On an H200 (2026-11-28) `stage1`, `scores`, `stage2`, `decode`
# and `gla` passed; `stage2` won past ~45K keys (19 ms a chunk and layer at 32K and 128K, the
# masked form 14.4 and 53.5: its dispatcher takes it past STAGE2_KERNEL_KEYS), `scores` and
# `gla` lost to the MLX ops (stage 1 22.0 ms against 20.5 at 32K and 128K together; a
# lightning layer 5.10 ms against 4.86). `norm` and `rows` ran out of their parity call's time
# compiling (8 of `rows`' tests and 2 of `norm`'s passed): untimed.
CUDA_KERNELS = ("stage1", "scores", "stage2", "decode", "gla", "norm", "rows")
DEFAULT_CUDA_KERNELS = "stage1,stage2,decode"


def on_cuda() -> bool:
    """Whether the default device is a CUDA GPU: where MLX's ops differ from Metal's in what
    a dispatcher must know (`linear.add_product`), and custom CUDA kernels may run."""
    gpu = mx.default_device().type == mx.DeviceType.gpu
    return gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def cuda_kernel(name: str) -> bool:
    """Whether the engine's custom CUDA kernel `name` (one of CUDA_KERNELS) runs: the
    default device is a CUDA GPU and `SALABATCH_CUDA_KERNELS` (a comma-separated list, or
    "none") names it. Default: the kernels whose parity tests have passed on a GPU (DEFAULT).
    Where it does not run, its dispatcher runs the MLX-op form."""
    chosen = os.environ.get("SALABATCH_CUDA_KERNELS", DEFAULT_CUDA_KERNELS).split(",")
    return name in chosen and on_cuda()


def rotates_in_float32() -> bool:
    """Whether `mx.fast.rope` of a bf16 or fp16 array rotates it in float32 and rounds the
    result once, the bits of an upcast rotation cast back: MLX's Metal and CUDA kernels do (one
    kernel instead of three); its CPU rope computes in the input's dtype. `bench.graph` counts
    the GPU's graph with it on."""
    return mx.default_device().type == mx.DeviceType.gpu


def device_memory() -> int:
    """Bytes the default device can work in: Metal's recommended working set, CUDA's total
    memory, the host's RAM for the CPU (and under MLX < 0.30.4, which has no `device_info`)."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
        if key in info:
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tile_rows(row_bytes: int, rows: int, batched: int = 1) -> int:
    """GPU path: queries per tile when each takes `row_bytes` of transient memory and adds
    `batched` entries to the tile's batched kernels (`gather_mm`, sorts), of `rows` queries: a
    power of two (tiles of every call and chunk share shapes) within the device's tile budget
    and GRID_ROWS, at most TILE_ROWS, at least 1."""
    fit = max(1, int(device_memory() * TILE_MEMORY_SHARE) // max(row_bytes, 1))
    fit = max(1, min(fit, GRID_ROWS // max(batched, 1)))
    return min(rows, TILE_ROWS, 1 << (fit.bit_length() - 1))


def lanes() -> tuple[mx.Stream, ...]:
    """Streams that independent query tiles take turns on. On the CPU, two: MLX runs the ops of
    one stream on one thread, so the elementwise work of a softmax (most of a sparse layer's
    time there) uses one core per stream. Elsewhere the default stream only: a GPU already runs
    each op across the device."""
    if on_gpu():
        return (mx.default_stream(mx.default_device()),)
    return mx.default_stream(mx.cpu), _second_lane()


def in_turn(tile: mx.array, earlier: list[mx.array]) -> mx.array:
    """`tile` (a query tile's first input), computed only once the tile a turn of the lanes
    before it (`earlier`: the call's tile outputs so far) is done. MLX orders a graph's
    independent branches breadth first, so a call's tiles would all take their score buffers
    before any tile's softmax frees one; in turn, a call holds one tile per lane at a time, and
    MLX's memory limit (`memory.bounded`) holds its run-ahead to the plan."""
    n = len(lanes())
    return mx.depends(tile, earlier[-n]) if len(earlier) >= n else tile


def attention_ref(
    q: mx.array, keys: Parts, values: Parts, scale: float, mask: str | mx.array | None = None
) -> mx.array:
    """Plain float32 softmax attention, the reference the fast paths are tested against."""
    k, v = _joined(keys, q.shape[0]), _joined(values, q.shape[0])
    B, H, Tq, d = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    qf = q.astype(mx.float32).reshape(B, Hk, H // Hk, Tq, d)
    s = (qf @ k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)) * scale  # [B, Hk, G, Tq, Tk]
    allowed = _causal(Tq, Tk, 0, Tq) if isinstance(mask, str) else mask
    if allowed is not None:
        s = mx.where(_per_group(allowed, Hk, H), s, -mx.inf)
    o = mx.softmax(s, axis=-1) @ v.astype(mx.float32)[:, :, None]
    return o.reshape(B, H, Tq, d).astype(q.dtype)


def attention(
    q: mx.array, keys: Parts, values: Parts, scale: float, mask: str | mx.array | None = None
) -> mx.array:
    """Dispatcher: fused SDPA on a GPU, base-2 query tiles on the CPU (same results)."""
    if mask is not None and isinstance(mask, str) and mask != "causal":
        raise ValueError(f"attention: mask must be None, 'causal' or an array, got {mask!r}")
    if on_gpu():
        k, v = _joined(keys, q.shape[0]), _joined(values, q.shape[0])
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return attention_cpu(q, _parts(keys), _parts(values), scale, mask)


def attention_cpu(
    q: mx.array,
    keys: tuple[mx.array, ...],
    values: tuple[mx.array, ...],
    scale: float,
    mask: str | mx.array | None,
) -> mx.array:
    """The CPU path: query tiles of at most MAX_SCORE_ELEMENTS scores; under a causal mask
    each tile reads only the keys up to its last query."""
    B, H, Tq, d = q.shape
    Hk = keys[0].shape[1]
    Tk = sum(k.shape[2] for k in keys)
    qg = q.reshape(B, Hk, H // Hk, Tq, d) * (scale * LOG2E)  # base 2: 2^(s·log2e) = e^s
    rows = max(1, MAX_SCORE_ELEMENTS // (B * H * max(Tk, 1)))
    if Tq >= 2 * LANE_ROWS:  # a long prefill: at least one tile per lane
        rows = min(rows, -(-Tq // len(lanes())))
    outs = []
    for i, s in enumerate(range(0, Tq, rows)):
        e = min(Tq, s + rows)
        if isinstance(mask, str):  # causal: keys past this tile's last query are never read
            end = Tk - Tq + e
            tile_mask = _causal(Tq, Tk, s, e)[..., :end]
        else:
            end = Tk
            tile_mask = _rows(mask, Tq, s, e)
        ks, vs = _first(keys, end), _first(values, end)
        with mx.stream(lanes()[i % len(lanes())]):
            qt = in_turn(qg[:, :, :, s:e], outs)
            outs.append(_softmax_base2(qt, ks, vs, tile_mask, Hk, H))
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return o.reshape(B, H, Tq, d).astype(q.dtype)


def _softmax_base2(qg, keys, values, mask, Hk, H):
    """qg [B, Hk, G, t, d] (pre-scaled by scale·log2e) → [B, Hk, G, t, d] float32."""
    s = mx.concatenate([grouped_scores(qg, k) for k in keys], axis=-1)  # [B, Hk, G, t, Tk]
    if mask is not None:
        s = mx.where(_per_group(mask, Hk, H), s, -mx.inf)
    p = exp2(s - s.max(axis=-1, keepdims=True))
    o, at = None, 0
    for v in values:
        n = v.shape[2]
        part = grouped_weighted(p[..., at : at + n], v)
        o, at = part if o is None else o + part, at + n
    return o / p.sum(axis=-1, keepdims=True)


def exp2(x: mx.array) -> mx.array:
    """2^x, elementwise: what the CPU paths' base-2 softmaxes exponentiate with."""
    return mx.power(2.0, x)


# Minimax coefficients of 2^f on [-1/2, 1/2] (Cephes' exp2f): relative error ~1e-7.
_EXP2_POLY = (
    0.6931472028550421,
    0.2402264791363012,
    0.05550332471162809,
    0.009618437357674640,
    0.001339887440266574,
    0.0001535336188319500,
)
# Adding then subtracting 1.5·2^23 rounds a float32 of magnitude < 2^22 to the nearest integer
# (ties to even, as `mx.round`) with two additions, which `mx.compile` fuses; MLX's CPU backend
# runs `round` as an op of its own, a whole extra pass over the scores.
_ROUND = 12582912.0


def exp2_poly(x: mx.array) -> mx.array:
    """2^x for x ≤ 0 (−inf gives 0) as a polynomial times 2^round(x) built from its exponent
    bits: for graphs under `mx.compile`, where it fuses with its neighbours into one loop and
    costs about a third of `power` on the CPU (outside a compiled graph it is ~10 ops: use
    `exp2`). Values below 2^-126 flush to 0. In float32 (its rounding trick and exponent bits
    are float32's: a bf16 or f16 x is taken up first)."""
    x = mx.maximum(x.astype(mx.float32), -127.0)
    i = (x + _ROUND) - _ROUND  # = mx.round(x), fused
    f = x - i
    c = _EXP2_POLY
    p = 1.0 + f * (c[0] + f * (c[1] + f * (c[2] + f * (c[3] + f * (c[4] + f * c[5])))))
    return p * mx.view(mx.left_shift(i.astype(mx.int32) + 127, 23), mx.float32)


def grouped_scores(qg: mx.array, k: mx.array) -> mx.array:
    """qg [B, Hk, G, t, d] · k [b, Hk, n, d] → [B, Hk, G, t, n]. A shared part (b = 1) is one
    matmul with every row's queries stacked, not B broadcast ones. A single query (t = 1, a
    decode step) has its G heads as the rows of one matmul: G vector products would read the
    keys G times (~4× slower); longer tiles keep the group axis (no copy of a strided tile)."""
    B, Hk, G, t, d = qg.shape
    if k.shape[0] == 1 and B > 1:
        stacked = qg.transpose(1, 0, 2, 3, 4).reshape(1, Hk, B * G * t, d)
        s = stacked @ k.swapaxes(-1, -2)  # [1, Hk, B·G·t, n]
        return s.reshape(Hk, B, G, t, -1).transpose(1, 0, 2, 3, 4)
    if t == 1:
        return (qg.reshape(B, Hk, G, d) @ k.swapaxes(-1, -2)).reshape(B, Hk, G, 1, -1)
    return qg @ k[:, :, None].swapaxes(-1, -2)


def grouped_weighted(p: mx.array, v: mx.array) -> mx.array:
    """p [B, Hk, G, t, n] · v [b, Hk, n, d] → [B, Hk, G, t, d] (a shared part and a single query
    as in grouped_scores)."""
    B, Hk, G, t, n = p.shape
    if v.shape[0] == 1 and B > 1:
        stacked = p.transpose(1, 0, 2, 3, 4).reshape(1, Hk, B * G * t, n)
        return (stacked @ v).reshape(Hk, B, G, t, -1).transpose(1, 0, 2, 3, 4)
    if t == 1:
        return (p.reshape(B, Hk, G, n) @ v).reshape(B, Hk, G, 1, -1)
    return p @ v[:, :, None]


def _causal(Tq: int, Tk: int, s: int, e: int) -> mx.array:
    """[e − s, Tk] mask of queries s..e−1 when the Tq queries are the last Tq of Tk keys."""
    q_pos = mx.arange(Tk - Tq + s, Tk - Tq + e)[:, None]
    return mx.arange(Tk)[None, :] <= q_pos


def _rows(mask: mx.array | None, Tq: int, s: int, e: int) -> mx.array | None:
    """The query rows s..e−1 of a mask (a mask without a per-query axis applies as it is)."""
    if mask is None or mask.ndim < 2 or mask.shape[-2] != Tq or (s == 0 and e == Tq):
        return mask
    return mask[..., s:e, :]


def _per_group(mask: mx.array, Hk: int, H: int) -> mx.array:
    """A mask broadcastable to [B, H, Tq, Tk] as [b, Hk, G or 1, Tq, Tk], never copied per
    head."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, h = mask.shape[:2]
    if h == H and H > 1:
        return mask.reshape(b, Hk, H // Hk, *mask.shape[2:])
    return mask[:, :, None]


def _parts(x: Parts) -> tuple[mx.array, ...]:
    return tuple(p for p in x if p.shape[2]) if isinstance(x, tuple) else (x,)


def _joined(x: Parts, batch: int) -> mx.array:
    """The parts as one array [B, Hk, Tk, d] (a shared part copied per row)."""
    parts = _parts(x)
    if len(parts) == 1 and parts[0].shape[0] == batch:
        return parts[0]
    return mx.concatenate(
        [mx.broadcast_to(p, (batch, *p.shape[1:])) if p.shape[0] != batch else p for p in parts],
        axis=2,
    )


def _first(parts: tuple[mx.array, ...], end: int) -> tuple[mx.array, ...]:
    """The first `end` positions of the concatenation of parts, still as parts."""
    out, at = [], 0
    for p in parts:
        n = min(p.shape[2], end - at)
        if n <= 0:
            break
        out.append(p if n == p.shape[2] else p[:, :, :n])
        at += n
    return tuple(out)
