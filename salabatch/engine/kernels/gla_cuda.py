"""A lightning layer's recurrence as CUDA kernels (`mx.fast.cuda_kernel`): the prefill's simple
GLA over 64-token chunks in three launches, each parallel over (row, head, chunk) or over the
state's elements, and the decode step's token in one.

The MLX-op form on the GPU path (`gla.gla_parallel`) casts q, k and v to float32 copies, writes
the chunks' scores, their decayed keys, every chunk's start state and the outputs' parts as
float32 arrays and reads them back: 2.4-2.8 ms a layer and 8K chunk on an H100, where its bytes
need ~0.5. A first kernel here walked the chunks in order, a thread block a (row, head, 32
columns of the state): 128 thread blocks for the 9B at batch 1, one an SM, each chunk's loads
and products in a chain, 3.4 ms (H100, 2026-11-27): latency, not bytes. Now the chain is only
the state's sum, element by element:

    1. `states`:  U_c = Σ_σ (k_σ γ^(C_c−1−σ)) v_σᵀ             a thread block a (row, head, chunk)
    2. `scan`:    S_0 = the given state (or zeros), S_c+1 = γ^C_c S_c + U_c, each S_c written
                  (the last is the final state)                  a thread a state element
    3. `out`:     P = (q kᵀ) · scale · γ^(τ−σ) for σ ≤ τ, else 0;
                  o_τ = (q_τ · scale · γ^(τ+1)) S_c + Σ_σ P[τ, σ] v_σ   a thread block a chunk

with γ = exp(g_h) and C_c the chunk's tokens (64, or fewer in the last). The products run on
tensor cores in TF32 (m16n16k8) with float32 accumulation, as MLX's own float32 matmuls run on
CUDA by default (TF32 on): q, k and v come from bf16 or fp16, which TF32 holds exactly; the
decayed operands and S are rounded to TF32 as they enter a product; the scan adds in float32.
o is written once, in the layout [B, T, H, dv] the layer reads next, in `out_dtype`. Bytes a
layer and 8K chunk of the 9B: ~1.5 GB (the chunks' U and S, 268 MB each, written and read once).

Layout:
  q, k, v  [B, H, T, d]    bfloat16 or float16 (row-contiguous; d a multiple of 32, ≤ 128)
  g        [H]             float32 log-decays
  state    [B, H, d, d]    float32, or None for zeros
  →        o [B, T, H, d] in out_dtype, the final state [B, H, d, d] float32

Off by default until its parity test (`tests/engine/kernels/test_gla_cuda.py`, marked `gpu`)
has passed on a GPU and it has won there: `SALABATCH_CUDA_KERNELS=stage1,gla` switches it on;
the dispatchers (`gla.gla`, `LightningAttention.step`) then take it where `supports` says.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from salabatch.engine.kernels.attention import cuda_kernel

CHUNK = 64  # tokens a chunk: 16 rows of a tensor-core tile per warp, 4 warps
THREADS = 128  # a thread block of `states` and `out`
SCAN_THREADS = 256
STATES_INPUTS = ("k", "v", "g", "dims")
SCAN_INPUTS = ("chunk_states", "g", "state", "dims")
OUT_INPUTS = ("q", "k", "v", "g", "starts", "dims", "scale")
STEP_INPUTS = ("y", "wq", "wk", "pos", "decay", "state", "params")

# What the three prefill kernels share: tile types, the chunk and its tokens, the (row, head,
# chunk) of a thread block, and the rows of q, k or v as float32 in shared memory (stride D + 8:
# rows stay 32-byte aligned for WMMA and neighbouring rows start in other banks), zeros past the
# chunk's tokens, each scaled by f(row) (the decays) and rounded to TF32 where asked.
HEADER = """
#include <mma.h>
namespace salabatch_gla {
using namespace nvcuda;
constexpr int C = 64;
using A8 = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using AT8 = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using B8 = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using BT8 = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

// rows t0 .. t0 + n − 1 of x [T, D] (a (row, head)'s) into dst [C][D + 8]
template <typename InT, int D, typename F>
__device__ void load_rows(float* dst, const InT* x, int t0, int n, F scale, bool tf32) {
    constexpr int VE = 16 / sizeof(InT), L = D + 8;  // elements a 16-byte load
    for (int i = threadIdx.x; i < C * D / VE; i += blockDim.x) {
        const int r = i / (D / VE), c = (i % (D / VE)) * VE;
        alignas(16) InT e[VE];
        if (r < n) {
            *reinterpret_cast<uint4*>(e) =
                *reinterpret_cast<const uint4*>(x + (long long)(t0 + r) * D + c);
        }
        const float f = r < n ? scale(r) : 0.0f;
        for (int j = 0; j < VE; ++j) {
            const float y = r < n ? (float)e[j] * f : 0.0f;
            dst[r * L + c + j] = tf32 ? wmma::__float_to_tf32(y) : y;
        }
    }
}
}  // namespace salabatch_gla
"""

# 1. A thread block (row, head, chunk c): U_c = (k γ^(n−1−σ))ᵀ v, n the chunk's tokens, [D, D]
# float32 into chunk_states [B, H, N, D, D]; warp w the tiles w, w + 4, ...
_STATES = """
    using namespace salabatch_gla;
    constexpr int L = D + 8, NT = D / 16;
    const int T = dims[0], H = dims[1], N = (T + C - 1) / C;
    const int bh = blockIdx.x / N, c = blockIdx.x % N, h = bh % H;
    const int t0 = c * C, n = min(C, T - t0), warp = threadIdx.x / 32;
    extern __shared__ __align__(32) unsigned char smem[];
    float* Ks = reinterpret_cast<float*>(smem);
    float* Vs = Ks + C * L;
    const float gh = g[h];
    const long long base = (long long)bh * T * D;  // k, v [b, h, 0, 0]
    load_rows<InT, D>(Ks, k + base, t0, n, [&](int r) { return expf(gh * (float)(n - 1 - r)); },
                      true);
    load_rows<InT, D>(Vs, v + base, t0, n, [](int) { return 1.0f; }, false);
    __syncthreads();
    float* U = chunk_states + ((long long)bh * N + c) * D * D;
    for (int t = warp; t < NT * NT; t += 4) {
        const int rt = (t / NT) * 16, ct = (t % NT) * 16;
        Acc acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < C; kk += 8) {
            AT8 kt;
            B8 vb;
            wmma::load_matrix_sync(kt, Ks + kk * L + rt, L);
            wmma::load_matrix_sync(vb, Vs + kk * L + ct, L);
            wmma::mma_sync(acc, kt, vb, acc);
        }
        wmma::store_matrix_sync(U + rt * D + ct, acc, D, wmma::mem_row_major);
    }
"""

# 2. A thread an element e of [B, H, D, D]: the state before each chunk into starts [B, H, N,
# D, D] (S_0 the given state, or zeros), S ← γ^n S + U_c after it (n the chunk's tokens), the
# last into final_state. Loads of U do not wait on the sum: the chain is one multiply-add a
# chunk.
_SCAN = """
    constexpr int C = 64;
    const int T = dims[0], H = dims[1], B = dims[2], N = (T + C - 1) / C;
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < (long long)B * H * D * D) {
        const long long bh = e / (D * D), at = e % (D * D);
        const float gh = g[bh % H];
        const float full = expf(gh * (float)C), last = expf(gh * (float)(T - (N - 1) * C));
        float S = FRESH ? 0.0f : state[e];
        const float* u = chunk_states + bh * N * D * D + at;
        float* s = starts + bh * N * D * D + at;
#pragma unroll 8
        for (int c = 0; c < N; ++c) {
            s[(long long)c * D * D] = S;
            S = (c + 1 < N ? full : last) * S + u[(long long)c * D * D];
        }
        final_state[e] = S;
    }
"""

# 3. A thread block (row, head, chunk c): P = the chunk's causal decayed scores (warp w its rows
# 16w …), then o = (q · scale · γ^(τ+1)) S_c + P v, warp w the column tiles w, w + 4, ... of all
# 64 rows (S_c's fragments read once a block, straight from `starts`), written once as [B, T, H,
# D] in OutT. Shared memory: Qs, KVs (k, then v) [C][D + 8], Ps [C][C + 8], γ^0 … γ^C.
_OUT = """
    using namespace salabatch_gla;
    constexpr int L = D + 8, PL = C + 8, NT = D / 16;
    constexpr int OWN = (NT + 3) / 4;  // column tiles a warp, at most
    const int T = dims[0], H = dims[1], N = (T + C - 1) / C;
    const int bh = blockIdx.x / N, c = blockIdx.x % N, h = bh % H, b = bh / H;
    const int t0 = c * C, n = min(C, T - t0), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float sc = scale[0];
    extern __shared__ __align__(32) unsigned char smem[];
    float* Qs = reinterpret_cast<float*>(smem);
    float* KVs = Qs + C * L;
    float* Ps = KVs + C * L;
    float* dec = Ps + C * PL;
    const float gh = g[h];
    for (int x = threadIdx.x; x <= C; x += blockDim.x) {
        dec[x] = expf(gh * (float)x);
    }
    const long long base = (long long)bh * T * D;  // q, k, v [b, h, 0, 0]
    load_rows<InT, D>(Qs, q + base, t0, n, [](int) { return 1.0f; }, false);
    load_rows<InT, D>(KVs, k + base, t0, n, [](int) { return 1.0f; }, false);
    __syncthreads();
    // the warp's 16 rows of q kᵀ, the tiles on and below the diagonal (q, k exact in TF32)
    const int r0 = warp * 16;
    for (int ct = 0; ct <= warp; ++ct) {
        Acc acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < D; kk += 8) {
            A8 a;
            BT8 bt;
            wmma::load_matrix_sync(a, Qs + r0 * L + kk, L);
            wmma::load_matrix_sync(bt, KVs + ct * 16 * L + kk, L);
            wmma::mma_sync(acc, a, bt, acc);
        }
        wmma::store_matrix_sync(Ps + r0 * PL + ct * 16, acc, PL, wmma::mem_row_major);
    }
    __syncthreads();  // every warp has read the keys: v takes their place
    load_rows<InT, D>(KVs, v + base, t0, n, [](int) { return 1.0f; }, false);
    // the warp's rows: P causal, decayed and scaled; q scaled and decayed for S_c
    for (int i = lane; i < 16 * C; i += 32) {
        const int r = r0 + i / C, col = i % C;
        const float p = col <= r ? Ps[r * PL + col] * sc * dec[r - col] : 0.0f;
        Ps[r * PL + col] = wmma::__float_to_tf32(p);
    }
    for (int i = lane; i < 16 * D; i += 32) {
        const int r = r0 + i / D, col = i % D;
        Qs[r * L + col] = wmma::__float_to_tf32(Qs[r * L + col] * sc * dec[r + 1]);
    }
    __syncthreads();
    Acc o[OWN][4];
    const float* S = starts + ((long long)bh * N + c) * D * D;
#pragma unroll
    for (int j = 0; j < OWN; ++j) {
        const int ct = (warp + 4 * j) * 16;
        if (ct < D) {
#pragma unroll
            for (int rt = 0; rt < 4; ++rt) {
                wmma::fill_fragment(o[j][rt], 0.0f);
            }
            for (int kk = 0; kk < D; kk += 8) {
                B8 s;
                wmma::load_matrix_sync(s, S + kk * D + ct, D);
                for (int e = 0; e < s.num_elements; ++e) {
                    s.x[e] = wmma::__float_to_tf32(s.x[e]);
                }
#pragma unroll
                for (int rt = 0; rt < 4; ++rt) {
                    A8 a;
                    wmma::load_matrix_sync(a, Qs + rt * 16 * L + kk, L);
                    wmma::mma_sync(o[j][rt], a, s, o[j][rt]);
                }
            }
            for (int kk = 0; kk < C; kk += 8) {
                B8 vb;
                wmma::load_matrix_sync(vb, KVs + kk * L + ct, L);
#pragma unroll
                for (int rt = 0; rt < 4; ++rt) {  // P's tiles on and below the diagonal
                    if (rt < kk / 16) {
                        continue;
                    }
                    A8 p;
                    wmma::load_matrix_sync(p, Ps + rt * 16 * PL + kk, PL);
                    wmma::mma_sync(o[j][rt], p, vb, o[j][rt]);
                }
            }
        }
    }
    __syncthreads();  // every warp has read Qs: it takes the output
#pragma unroll
    for (int j = 0; j < OWN; ++j) {
        const int ct = (warp + 4 * j) * 16;
        if (ct < D) {
#pragma unroll
            for (int rt = 0; rt < 4; ++rt) {
                wmma::store_matrix_sync(Qs + rt * 16 * L + ct, o[j][rt], L, wmma::mem_row_major);
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
        const int r = i / D, col = i % D;
        out[(((long long)b * T + t0 + r) * H + h) * D + col] = (OutT)Qs[r * L + col];
    }
"""


# The decode step's token, a thread block a (row b, head h, 32 columns of the state): q and k
# from the fused projection's output y [B, 1, N] (q's H heads, then k's HK, v's HK), normed
# (float32 sums, the result rounded to the input's dtype, times the norm's weight, rounded
# again: `mx.fast.rms_norm` then a product, as the MLX-op step), q scaled, both rotated at the
# row's position in float32 (MLX's rope: θ = pos · 2^(−(i / (D/2)) · log2(base))), then each
# of the 32 columns: S[i] ← decay · S[i] + k[i] · v, o = Σ_i q[i] · S[i] over the rows, 4 warps
# a quarter of the rows each, summed in shared memory. params: scale, eps, log2(base).
_STEP = """
    constexpr int DV = 32, NS = D / DV, G = H / HK, HALF = D / 2;
    const int b = blockIdx.x / (H * NS), h = (blockIdx.x / NS) % H, j = blockIdx.x % NS;
    const int kh = h / G, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float scale = params[0], eps = params[1], log2_base = params[2];
    extern __shared__ __align__(16) unsigned char smem[];
    float* qs = reinterpret_cast<float*>(smem);  // [D]
    float* ks = qs + D;                           // [D]
    float* sums = ks + D;                         // [2][4]: the warps' sums of squares
    float* part = sums + 8;                       // [4][DV]: the warps' parts of o
    const InT* row = y + (long long)b * N;
    float qx = 0.0f, kx = 0.0f;
    if (threadIdx.x < D) {
        qx = (float)row[h * D + threadIdx.x];
        kx = (float)row[(H + kh) * D + threadIdx.x];
    }
    if (QKNORM) {
        float sq = qx * qx, sk = kx * kx;
        for (int m = 16; m > 0; m /= 2) {
            sq += __shfl_xor_sync(0xffffffffu, sq, m);
            sk += __shfl_xor_sync(0xffffffffu, sk, m);
        }
        if (lane == 0) {
            sums[warp] = sq;
            sums[4 + warp] = sk;
        }
        __syncthreads();
        sq = sums[0] + sums[1] + sums[2] + sums[3];
        sk = sums[4] + sums[5] + sums[6] + sums[7];
        if (threadIdx.x < D) {
            const float rq = rsqrtf(sq / D + eps), rk = rsqrtf(sk / D + eps);
            qx = (float)(InT)((float)(InT)(qx * rq) * (float)wq[threadIdx.x]);
            kx = (float)(InT)((float)(InT)(kx * rk) * (float)wk[threadIdx.x]);
        }
    }
    if (threadIdx.x < D) {
        qs[threadIdx.x] = qx * scale;
        ks[threadIdx.x] = kx;
    }
    __syncthreads();
    if (ROPE && threadIdx.x < HALF) {
        const int i = threadIdx.x;
        const float inv_freq = exp2f(-((float)i / (float)HALF) * log2_base);
        const float theta = (float)pos[b] * inv_freq, c = cosf(theta), s = sinf(theta);
        const float q1 = qs[i], q2 = qs[i + HALF], k1 = ks[i], k2 = ks[i + HALF];
        qs[i] = q1 * c - q2 * s;
        qs[i + HALF] = q1 * s + q2 * c;
        ks[i] = k1 * c - k2 * s;
        ks[i + HALF] = k1 * s + k2 * c;
    }
    __syncthreads();
    const int col = j * DV + lane;
    const float vc = (float)row[(H + HK + kh) * D + col], dec = decay[h];
    const long long at = ((long long)b * H + h) * D * D + col;
    float acc = 0.0f;
    for (int i = warp * (D / 4); i < (warp + 1) * (D / 4); ++i) {
        const float s_new = dec * state[at + (long long)i * D] + ks[i] * vc;
        new_state[at + (long long)i * D] = s_new;
        acc += qs[i] * s_new;
    }
    part[warp * DV + lane] = acc;
    __syncthreads();
    if (warp == 0) {
        const float o = part[lane] + part[DV + lane] + part[2 * DV + lane] + part[3 * DV + lane];
        out[((long long)b * H + h) * D + col] = (InT)o;
    }
"""


def available() -> bool:
    """Whether the kernel may run: CUDA, and `SALABATCH_CUDA_KERNELS` names "gla"."""
    return cuda_kernel("gla")


def supports(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """The shapes the kernels take: q, k, v of one shape [B, H, T, d] in bfloat16 or float16
    (exact in TF32), d a multiple of 32 up to 128."""
    d = q.shape[-1]
    return (
        q.dtype in (mx.bfloat16, mx.float16)
        and k.dtype == v.dtype == q.dtype
        and q.shape == k.shape == v.shape
        and d % 32 == 0
        and d <= 128
    )


def shared_bytes(name: str, d: int) -> int:
    """Dynamic shared memory of a thread block of the prefill's kernel `name` ("states" or
    "out"; the layouts above)."""
    rows = 2 * CHUNK * (d + 8)  # k and v, or q and k-then-v
    if name == "states":
        return 4 * rows
    return 4 * (rows + CHUNK * (CHUNK + 8) + CHUNK + 1)


def gla(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    scale: float,
    state: mx.array | None,
    out_dtype: mx.Dtype,
) -> tuple[mx.array, mx.array]:
    """The recurrence over q, k, v [B, H, T, d] from `state` (None: zeros) → (o [B, H, T, d] in
    out_dtype, a view of its [B, T, H, d] layout; the final state [B, H, d, d] float32)."""
    B, H, T, d = q.shape
    N = -(-T // CHUNK)
    fresh = state is None
    dims = mx.array([T, H, B], dtype=mx.int32)
    g = g.astype(mx.float32)
    blocks = (B * H * N * THREADS, 1, 1)
    (chunk_states,) = _kernel("states", shared_bytes("states", d))(
        inputs=[k, v, g, dims],
        template=[("InT", q.dtype), ("D", d)],
        grid=blocks,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, N, d, d)],
        output_dtypes=[mx.float32],
    )
    start = g if fresh else state.astype(mx.float32)  # a zero state is not read
    starts, final = _kernel("scan", 0)(
        inputs=[chunk_states, g, start, dims],
        template=[("D", d), ("FRESH", int(fresh))],
        grid=(B * H * d * d, 1, 1),  # a multiple of SCAN_THREADS: d is of 32
        threadgroup=(SCAN_THREADS, 1, 1),
        output_shapes=[(B, H, N, d, d), (B, H, d, d)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (o,) = _kernel("out", shared_bytes("out", d))(
        inputs=[q, k, v, g, starts, dims, mx.array([scale], dtype=mx.float32)],
        template=[("InT", q.dtype), ("OutT", out_dtype), ("D", d)],
        grid=blocks,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, T, H, d)],
        output_dtypes=[out_dtype],
    )
    return o.transpose(0, 2, 1, 3), final


def step_supports(y: mx.array, heads: int, kv_heads: int, d: int) -> bool:
    """The shapes the decode step's kernel takes: one token a row of a fused projection's
    output in bfloat16 or float16, a head dim of 32·k up to 128 (a thread a dimension), heads
    a multiple of the kv heads."""
    return (
        y.dtype in (mx.bfloat16, mx.float16)
        and y.ndim == 3
        and y.shape[1] == 1
        and d % 32 == 0
        and d <= 128
        and heads % kv_heads == 0
    )


def step(
    y: mx.array,
    norms: tuple[mx.array, mx.array] | None,
    pos: mx.array,
    decay: mx.array,
    state: mx.array,
    *,
    heads: int,
    kv_heads: int,
    d: int,
    scale: float,
    eps: float,
    rope_base: float | None,
) -> tuple[mx.array, mx.array]:
    """A decode step's recurrence from the fused projection's output y [B, 1, N] (q, k, v
    heads side by side at its start): q and k normed (`norms`: their weights, or None),
    scaled, rotated (`rope_base`, or None), then the state's update and read-out →
    (o [B, 1, heads · d] in y's dtype, the new state [B, heads, d, d] float32)."""
    B, _, N = y.shape
    log2_base = float(np.log2(np.float32(rope_base))) if rope_base else 0.0
    params = mx.array([scale, eps, log2_base], dtype=mx.float32)
    wq, wk = norms if norms else (y, y)  # not read without norms
    o, new_state = _kernel("step", step_shared_bytes(d))(
        inputs=[y, wq, wk, pos.astype(mx.int32), decay, state, params],
        template=[("InT", y.dtype), ("D", d), ("H", heads), ("HK", kv_heads), ("N", N),
                  ("QKNORM", int(norms is not None)), ("ROPE", int(rope_base is not None))],
        grid=(B * heads * (d // 32) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, 1, heads * d), state.shape],
        output_dtypes=[y.dtype, mx.float32],
    )  # fmt: skip
    return o, new_state


def step_shared_bytes(d: int) -> int:
    """The decode step kernel's shared memory: q and k, the warps' sums and parts of o."""
    return 4 * (2 * d + 8 + 4 * 32)


@functools.cache
def _kernel(name: str, shared: int):
    """The kernel `name` (the prefill's "states", "scan" and "out", the decode step's "step")
    for `shared` bytes of dynamic shared memory, made on first use (there is none without a
    CUDA backend); MLX compiles it once per template."""
    inputs, outputs, source, header = {
        "states": (STATES_INPUTS, ["chunk_states"], _STATES, HEADER),
        "scan": (SCAN_INPUTS, ["starts", "final_state"], _SCAN, ""),
        "out": (OUT_INPUTS, ["out"], _OUT, HEADER),
        "step": (STEP_INPUTS, ["out", "new_state"], _STEP, ""),
    }[name]
    return mx.fast.cuda_kernel(
        name=f"salabatch_gla_{name}",
        input_names=list(inputs),
        output_names=outputs,
        source=source,
        header=header,
        shared_memory=shared,
    )
