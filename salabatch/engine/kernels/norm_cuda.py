"""A decode step's residual add and the RMS norm after it as one CUDA kernel
(`mx.fast.cuda_kernel`): h + s·y, then rms_norm of that with the next norm's weight, two
outputs. On CUDA the step's output projections run as plain products (an `addmm` of a few rows
is a cuBLAS GEMM there, 0.35-0.6× the speed of MLX's matrix-vector product on an H100), and each
residual add was a kernel of its own before the next norm's: here they are one, a row a thread
block, the row read once.

Arithmetic as the MLX ops it replaces (`linear.add_product`'s sum, then `nn.RMSNorm`): s rounded
to h's dtype (as MLX casts a Python float it multiplies an array by), s·y and the sum rounded to
it, the squares summed in float32 over the rounded row, then
w · (x · rsqrt(mean + eps)), the product rounded to the dtype before the weight's.

Off by default until its parity test (`tests/engine/kernels/test_norm_cuda.py`, marked `gpu`)
has passed on a GPU: `SALABATCH_CUDA_KERNELS=stage1,norm` switches it on; the dispatcher
(`linear.add_product_norm`) then takes it.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from salabatch.engine.kernels.attention import cuda_kernel

THREADS = 256
INPUTS = ("h", "y", "weight", "params")

_SOURCE = """
    constexpr int PER = (N + 255) / 256;  // elements a thread
    const long long row = blockIdx.x;
    // s as MLX takes a Python float times an array of T: rounded to T first
    const float s = static_cast<float>(static_cast<T>(params[0])), eps = params[1];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    extern __shared__ __align__(16) unsigned char smem[];
    float* sums = reinterpret_cast<float*>(smem);  // a float a warp
    float x[PER];
    float sq = 0.0f;
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + i * 256;
        if (c < N) {
            const T t = static_cast<T>(s * static_cast<float>(y[row * N + c]));
            const float sum = static_cast<float>(h[row * N + c]) + static_cast<float>(t);
            const T hn = static_cast<T>(sum);
            h_out[row * N + c] = hn;
            x[i] = static_cast<float>(hn);
            sq += x[i] * x[i];
        }
    }
    for (int m = 16; m > 0; m /= 2) {
        sq += __shfl_xor_sync(0xffffffffu, sq, m);
    }
    if (lane == 0) {
        sums[warp] = sq;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < 8; ++w) {
        total += sums[w];
    }
    const float r = rsqrtf(total / N + eps);
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + i * 256;
        if (c < N) {
            const T v = static_cast<T>(x[i] * r);
            const float w = static_cast<float>(weight[c]);
            normed[row * N + c] = static_cast<T>(w * static_cast<float>(v));
        }
    }
"""


def available() -> bool:
    """Whether the kernel may run: CUDA, and `SALABATCH_CUDA_KERNELS` names "norm"."""
    return cuda_kernel("norm")


def supports(h: mx.array) -> bool:
    """Rows in bfloat16 or float16, at most 8,192 wide (y: of h's shape and dtype)."""
    return h.dtype in (mx.bfloat16, mx.float16) and h.shape[-1] <= 8192


def add_rms_norm(
    h: mx.array, y: mx.array, scale: float, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """h, y [..., n] → (h + scale · y, its RMS norm with `weight` [n]), in h's dtype."""
    n = h.shape[-1]
    rows = h.size // n
    params = mx.array([scale, eps], dtype=mx.float32)
    return _kernel()(
        inputs=[h, y, weight.astype(h.dtype), params],
        template=[("T", h.dtype), ("N", n)],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[h.shape, h.shape],
        output_dtypes=[h.dtype, h.dtype],
    )


@functools.cache
def _kernel():
    """The kernel object, made on first use (there is none without a CUDA backend)."""
    return mx.fast.cuda_kernel(
        name="salabatch_add_rms_norm",
        input_names=list(INPUTS),
        output_names=["h_out", "normed"],
        source=_SOURCE,
        shared_memory=4 * THREADS // 32,
    )
