"""Stage 1's softmax, head sum and block pooling as two CUDA kernels (`mx.fast.cuda_kernel`),
for the GPU path on CUDA: what `sparse_select._select_tile` computes with MLX ops from the two
levels' raw scores, reading each score once in its own dtype instead of materialising every
head's float32 probabilities before summing them (at 128K keys those are ~8.6 GB a 8K chunk).

Layout (the tile's, `_select_tile`):
  s1      [B, Hk, G, t, N1]  q·c1 per level-1 chunk, q's dtype (unscaled)
  s2      [B, Hk, G, t, N2]  q·c2 per level-2 chunk
  seen1, seen2  [B, t] int32 the chunks each query sees at each level
  →       [B, Hk, t, n_blocks] float32: block b's max over the level-1 chunks r·b−1 … r·b+r−1
          of Σ_g exp(scale·s1 − lse2) (0 where a chunk is unseen or missing, and for a query
          that sees no level-2 chunk)

The MLX-op form in `_select_tile` is the reference they are tested against (tests marked `gpu`,
run where CUDA is). Sizes travel as data (`dims`), so one compiled kernel serves every chunk
and context; only the score dtype picks a kernel.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from salabatch.engine.kernels.attention import cuda_kernel

# One warp per (row, query, head): the row's level-2 log-sum-exp over the chunks it sees.
_LSE = """
    const int N2 = dims[0], t = dims[1], heads = dims[2], rows = dims[3];
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const int query = row % t, b = row / (t * heads);
    const int seen = min(seen2[b * t + query], N2);
    const float a = scale[0];
    const auto* x = s2 + (long long)row * N2;
    float m = __int_as_float(0xff800000);  // -inf
    for (int j = lane; j < seen; j += 32) {
        m = fmaxf(m, static_cast<float>(x[j]) * a);
    }
    for (int step = 16; step > 0; step /= 2) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, step));
    }
    if (seen <= 0) {
        m = 0.0f;
    }
    float sum = 0.0f;
    for (int j = lane; j < seen; j += 32) {
        sum += expf(static_cast<float>(x[j]) * a - m);
    }
    for (int step = 16; step > 0; step /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, step);
    }
    if (lane == 0) {
        lse[row] = m + logf(sum);
    }
"""

# One thread per (row, kv head, query, block): the head sum of each overlapping chunk, maxed.
_POOL = """
    const int N1 = dims[0], t = dims[1], G = dims[2], Hk = dims[3], n_blocks = dims[4];
    const int r = dims[5];
    const long long total = (long long)dims[6] * n_blocks;
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= total) {
        return;
    }
    const int block = id % n_blocks;
    const long long rest = id / n_blocks;
    const int query = rest % t;
    const int h = (rest / t) % Hk, b = rest / ((long long)t * Hk);
    const float a = scale[0];
    float best = 0.0f;
    if (seen2[b * t + query] > 0) {
        const int first = max(r * block - 1, 0);
        const int last = min(r * block + r - 1, min(seen1[b * t + query], N1) - 1);
        const long long head0 = ((long long)(b * Hk + h) * G) * t + query;
        for (int c = first; c <= last; ++c) {
            float p = 0.0f;
            for (int g = 0; g < G; ++g) {
                const long long row = head0 + (long long)g * t;
                p += expf(static_cast<float>(s1[row * N1 + c]) * a - lse[row]);
            }
            best = fmaxf(best, p);
        }
    }
    pooled[id] = best;
"""

_WARPS = 8  # rows per thread block of the log-sum-exp kernel
_THREADS = 256


def available() -> bool:
    """Whether these kernels can run (`attention.cuda_kernel`: CUDA, and not switched off)."""
    return cuda_kernel("stage1")


def pooled_scores(
    s1: mx.array,
    s2: mx.array,
    seen1: mx.array,
    seen2: mx.array,
    scale: float,
    n_blocks: int,
    r: int,
) -> mx.array:
    """The tile's pooled block scores [B, Hk, t, n_blocks] float32 (layout above)."""
    B, Hk, G, t, N1 = s1.shape
    N2 = s2.shape[-1]
    rows = B * Hk * G * t
    a = mx.array([scale], dtype=mx.float32)
    seen1, seen2 = (s.astype(mx.int32) for s in (seen1, seen2))
    (lse,) = _kernel("salabatch_stage1_lse", ("s2", "seen2", "dims", "scale"), ("lse",), _LSE)(
        inputs=[s2, seen2, mx.array([N2, t, Hk * G, rows], dtype=mx.int32), a],
        grid=(rows * 32, 1, 1),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(rows,)],
        output_dtypes=[mx.float32],
    )
    dims = mx.array([N1, t, G, Hk, n_blocks, r, B * Hk * t], dtype=mx.int32)
    names = ("s1", "lse", "seen1", "seen2", "dims", "scale")
    (pooled,) = _kernel("salabatch_stage1_pool", names, ("pooled",), _POOL)(
        inputs=[s1, lse, seen1, seen2, dims, a],
        grid=(B * Hk * t * n_blocks, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(B, Hk, t, n_blocks)],
        output_dtypes=[mx.float32],
    )
    return pooled


@functools.cache
def _kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str):
    """The kernel object, made on first use (there is none without a CUDA backend); MLX
    compiles it once per input dtypes."""
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=source)
