"""A decode step's products of a few rows as one CUDA kernel (`mx.fast.cuda_kernel`): y = x wᵀ for
x [M, K] of at most 8 rows and a bf16 or fp16 weight w [N, K], the weight streamed once.

A decode step is its weights' bytes: 18.5 GB a step for the 9B at 32K, ~17 of them the
products'. MLX's CUDA backend runs a one-row product as its matrix-vector kernel (a warp a row
of w, 8 bytes a lane at a time, one load in flight; on an H100 its time fits 70 µs + bytes /
1.9 TB/s, 57 % of the HBM's 3.35) and more rows, or an `addmm`, as a cuBLAS GEMM (a few rows'
`addmm` at 0.35-0.6× the matrix-vector kernel's speed). Here a warp takes one row n of w and
each lane keeps four 16-byte loads of it in flight (2 KB a warp; ~31 warps an SM for the
smallest product of the 9B's step, 4096 rows), the rows of x read from L1 (every warp of an SM
reads the same), float32 sums, the lanes' sums added by shuffles, each y[m, n] rounded once
to w's dtype. (A first kernel of a few rows, on a branch now gone, streamed at ~1.4 TB/s on an
H100, 2026-11-26; its design is not known here.)

Layout:
  x  [M, K]   M ≤ 8 rows, w's dtype, K a multiple of 8 (16-byte rows)
  w  [N, K]   bfloat16 or float16, row-contiguous
  →  [M, N]   in w's dtype

Off by default until its parity test (`tests/engine/kernels/test_rows_cuda.py`, marked `gpu`)
has passed on a GPU and it has won there: `SALABATCH_CUDA_KERNELS=stage1,decode,rows` switches
it on; the dispatcher (`linear.product`) then takes it for the decode step's products.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from salabatch.engine.kernels.attention import cuda_kernel

MAX_ROWS = 8
THREADS = 256  # 8 warps: 8 rows of w a thread block
IN_FLIGHT = 4  # U: 16-byte loads of w a lane issues before it sums them (the profile: 2, 4, 8)
INPUTS = ("x", "w", "dims")

# A warp a row n of w; lane ℓ reads w[n, k] for k = 8ℓ + 256u + 256·U·i (u < U: the loads in
# flight), the same columns of each row of x, and sums in float32. Constants: T, M (rows of x),
# U.
_SOURCE = """
    constexpr int VE = 8, STEP = 32 * VE * U;
    const int N = dims[0], K = dims[1];
    const long long n = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (n >= N) {
        return;  // a last thread block's spare warps
    }
    const int lane = threadIdx.x % 32;
    const T* row = w + n * K;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        acc[m] = 0.0f;
    }
    for (int k0 = lane * VE; k0 < K; k0 += STEP) {
        uint4 wv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = k0 + u * 32 * VE;
            wv[u] = k < K ? *reinterpret_cast<const uint4*>(row + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = k0 + u * 32 * VE;
            if (k < K) {
                const T* wt = reinterpret_cast<const T*>(&wv[u]);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const uint4 xv = *reinterpret_cast<const uint4*>(x + (long long)m * K + k);
                    const T* xt = reinterpret_cast<const T*>(&xv);
#pragma unroll
                    for (int e = 0; e < VE; ++e) {
                        acc[m] += static_cast<float>(wt[e]) * static_cast<float>(xt[e]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        for (int s = 16; s > 0; s /= 2) {
            acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], s);
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            y[(long long)m * N + n] = static_cast<T>(acc[m]);
        }
    }
"""


def available() -> bool:
    """Whether the kernel may run: CUDA, and `SALABATCH_CUDA_KERNELS` names "rows"."""
    return cuda_kernel("rows")


def supports(x: mx.array, w: mx.array) -> bool:
    """A few rows (all leading axes of x together, at most MAX_ROWS) against a 2-D bf16 or fp16
    weight of x's dtype whose rows are whole 16-byte loads."""
    K = x.shape[-1]
    return (
        w.ndim == 2
        and w.dtype in (mx.bfloat16, mx.float16)
        and x.dtype == w.dtype
        and w.shape[1] == K
        and K % 8 == 0
        and 0 < x.size // max(K, 1) <= MAX_ROWS
    )


def product(x: mx.array, w: mx.array, in_flight: int = IN_FLIGHT) -> mx.array:
    """x [..., K] (at most MAX_ROWS rows in all) times w [N, K] transposed → [..., N]."""
    K, N = x.shape[-1], w.shape[0]
    M = x.size // K
    (y,) = _kernel()(
        inputs=[x.reshape(M, K), w, mx.array([N, K], dtype=mx.int32)],
        template=[("T", w.dtype), ("M", M), ("U", in_flight)],
        grid=(-(-N // (THREADS // 32)) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[w.dtype],
    )
    return y.reshape(*x.shape[:-1], N)


@functools.cache
def _kernel():
    """The kernel object, made on first use (there is none without a CUDA backend); MLX
    compiles it once per dtype and number of rows."""
    return mx.fast.cuda_kernel(
        name="salabatch_rows",
        input_names=list(INPUTS),
        output_names=["y"],
        source=_SOURCE,
    )
