"""A lightning layer's prefill recurrence as one CUDA kernel (`mx.fast.cuda_kernel`): simple
GLA over whole 64-token chunks in sequence, the state kept in tensor-core accumulators.

The MLX-op form on the GPU path (`gla.gla_parallel`) casts q, k and v to float32 copies,
materialises every chunk's start state ([B, H, N, dk, dv] float32, 268 MB an 8K chunk of the
9B) and reads them back: 2.5 ms a layer and 8K chunk on an H100, about three times its bytes'
time. Here a thread block takes one (row, head, 32 columns of dv) and walks the chunks in
order: each chunk's q, k and v come into shared memory once (as float32), and

    P   = (q kᵀ) · scale · γ^(τ−σ)  for σ ≤ τ, else 0          (the chunk's own tokens)
    o_τ = (q_τ · scale · γ^(τ+1)) S + Σ_σ P[τ, σ] v_σ          (S: the state at the chunk's start)
    S  ← γ^C' S + Σ_σ (k_σ γ^(C'−1−σ)) v_σᵀ                    (C': the chunk's tokens)

with γ = exp(g_h), the products on tensor cores in TF32 (m16n16k8) with float32 accumulation,
as MLX's own float32 matmuls run on CUDA by default (TF32 on): q, k and v come from bf16 or
fp16, which TF32 holds exactly; the decayed operands and S are rounded to TF32 as they enter a
product. o is written once, in the layout [B, T, H, dv] the layer reads next, in `out_dtype`.

Layout:
  q, k, v  [B, H, T, d]    bfloat16 or float16 (row-contiguous; d a multiple of 32, ≤ 128)
  g        [H]             float32 log-decays
  state    [B, H, d, d]    float32, or None for zeros
  →        o [B, T, H, d] in out_dtype, the final state [B, H, d, d] float32

Off by default until its parity test (`tests/engine/kernels/test_gla_cuda.py`, marked `gpu`)
has passed on a GPU: `SALABATCH_CUDA_KERNELS=stage1,gla` switches it on; the dispatcher
(`gla.gla`) then takes it where `supports` says.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from salabatch.engine.kernels.attention import cuda_kernel

CHUNK = 64  # tokens a chunk: 16 rows of a tensor-core tile per warp, 4 warps
COLUMNS = 32  # dv columns a thread block
THREADS = 128
INPUTS = ("q", "k", "v", "g", "state", "dims", "scale")
STEP_INPUTS = ("y", "wq", "wk", "pos", "decay", "state", "params")

# One thread block: (row b, head h, columns j·COLUMNS …). Shared memory, float32, strides
# padded by 8 (rows stay 32-byte aligned for WMMA, and neighbouring rows start in other
# banks): Qs, Ks [CHUNK][D + 8], Vs [CHUNK][COLUMNS + 8], Ps [CHUNK][CHUNK + 8], Ss [D][COLUMNS
# + 8], the decays γ^0 … γ^CHUNK. Warp w owns the chunk's rows 16w … 16w + 15 of Qs, Ps (and
# the output), and S's tiles w, w + 4, ... (row tile t / NC, column tile t % NC) in registers.
_SOURCE = """
    using namespace nvcuda;
    constexpr int C = 64, DV = 32, QL = D + 8, VL = DV + 8, PL = C + 8, NC = DV / 16;
    constexpr int TILES = (D / 16) * NC / 4;  // S's tiles a warp
    using A8 = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
    using AT8 = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
    using B8 = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
    using BT8 = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
    using Acc = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

    const int T = dims[0], H = dims[1];
    const int NT = D / DV;
    const int bh = blockIdx.x / NT, j = blockIdx.x % NT, h = bh % H, b = bh / H;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float sc = scale[0];

    extern __shared__ __align__(32) unsigned char smem[];
    float* Qs = reinterpret_cast<float*>(smem);
    float* Ks = Qs + C * QL;
    float* Vs = Ks + C * QL;
    float* Ps = Vs + C * VL;
    float* Ss = Ps + C * PL;
    float* dec = Ss + D * VL;  // γ^x, x = 0 … C
    for (int x = threadIdx.x; x <= C; x += blockDim.x) {
        dec[x] = expf(g[h] * (float)x);
    }

    Acc S[TILES];
    for (int i = 0; i < TILES; ++i) {
        const int t = warp + 4 * i, r0 = (t / NC) * 16, c0 = (t % NC) * 16;
        if (FRESH) {
            wmma::fill_fragment(S[i], 0.0f);
        } else {
            const float* s0 = state + ((long long)bh * D + r0) * D + j * DV + c0;
            wmma::load_matrix_sync(S[i], s0, D, wmma::mem_row_major);
        }
    }
    const long long base = (long long)bh * T * D;  // q, k, v [b, h, 0, 0]
    constexpr int VE = 16 / sizeof(InT);            // elements a 16-byte load
    for (int t0 = 0; t0 < T; t0 += C) {
        const int n = min(C, T - t0);
        // A: the chunk's q, k (all D columns) and v (this block's DV) as float32, zeros past n;
        // S as it stands, the state at the chunk's start
        for (int i = threadIdx.x; i < C * D / VE; i += blockDim.x) {
            const int r = i / (D / VE), c = (i % (D / VE)) * VE;
            alignas(16) InT qv[VE];
            alignas(16) InT kv[VE];
            if (r < n) {
                *reinterpret_cast<uint4*>(qv) =
                    *reinterpret_cast<const uint4*>(q + base + (long long)(t0 + r) * D + c);
                *reinterpret_cast<uint4*>(kv) =
                    *reinterpret_cast<const uint4*>(k + base + (long long)(t0 + r) * D + c);
            }
            for (int e = 0; e < VE; ++e) {
                Qs[r * QL + c + e] = r < n ? (float)qv[e] : 0.0f;
                Ks[r * QL + c + e] = r < n ? (float)kv[e] : 0.0f;
            }
        }
        for (int i = threadIdx.x; i < C * DV / VE; i += blockDim.x) {
            const int r = i / (DV / VE), c = (i % (DV / VE)) * VE;
            alignas(16) InT vv[VE];
            if (r < n) {
                *reinterpret_cast<uint4*>(vv) = *reinterpret_cast<const uint4*>(
                    v + base + (long long)(t0 + r) * D + j * DV + c);
            }
            for (int e = 0; e < VE; ++e) {
                Vs[r * VL + c + e] = r < n ? (float)vv[e] : 0.0f;
            }
        }
        for (int i = 0; i < TILES; ++i) {
            const int t = warp + 4 * i;
            wmma::store_matrix_sync(Ss + (t / NC) * 16 * VL + (t % NC) * 16, S[i], VL,
                                    wmma::mem_row_major);
        }
        __syncthreads();
        // B: the warp's 16 rows of q kᵀ, the tiles on and below the diagonal
        const int r0 = warp * 16;
        for (int ct = 0; ct <= warp; ++ct) {
            Acc acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int kk = 0; kk < D; kk += 8) {
                A8 a;
                BT8 bt;
                wmma::load_matrix_sync(a, Qs + r0 * QL + kk, QL);
                wmma::load_matrix_sync(bt, Ks + ct * 16 * QL + kk, QL);
                wmma::mma_sync(acc, a, bt, acc);  // q, k: bf16 or fp16 values, exact in TF32
            }
            wmma::store_matrix_sync(Ps + r0 * PL + ct * 16, acc, PL, wmma::mem_row_major);
        }
        __syncthreads();  // every warp has read the raw keys
        // C: the warp's rows: P causal and decayed, q scaled for S; its 16 keys decayed to the
        // chunk's end
        for (int i = lane; i < 16 * C; i += 32) {
            const int r = r0 + i / C, c = i % C;
            const float p = c <= r ? Ps[r * PL + c] * sc * dec[r - c] : 0.0f;
            Ps[r * PL + c] = wmma::__float_to_tf32(p);
        }
        for (int i = lane; i < 16 * D; i += 32) {
            const int r = r0 + i / D, c = i % D;
            Qs[r * QL + c] = wmma::__float_to_tf32(Qs[r * QL + c] * sc * dec[r + 1]);
            Ks[r * QL + c] = r < n ? wmma::__float_to_tf32(Ks[r * QL + c] * dec[n - 1 - r]) : 0.0f;
        }
        __syncthreads();
        // D: the warp's rows of o = (q·scale·γ^(τ+1)) S + P v, written once
        Acc o[NC];
        for (int ct = 0; ct < NC; ++ct) {
            wmma::fill_fragment(o[ct], 0.0f);
            for (int kk = 0; kk < D; kk += 8) {
                A8 a;
                B8 s;
                wmma::load_matrix_sync(a, Qs + r0 * QL + kk, QL);
                wmma::load_matrix_sync(s, Ss + kk * VL + ct * 16, VL);
                for (int e = 0; e < s.num_elements; ++e) {
                    s.x[e] = wmma::__float_to_tf32(s.x[e]);
                }
                wmma::mma_sync(o[ct], a, s, o[ct]);
            }
            for (int kk = 0; kk < r0 + 16; kk += 8) {
                A8 p;
                B8 vb;
                wmma::load_matrix_sync(p, Ps + r0 * PL + kk, PL);
                wmma::load_matrix_sync(vb, Vs + kk * VL + ct * 16, VL);
                wmma::mma_sync(o[ct], p, vb, o[ct]);
            }
        }
        __syncwarp();  // the warp's rows of P are read: they take its output
        for (int ct = 0; ct < NC; ++ct) {
            wmma::store_matrix_sync(Ps + r0 * PL + ct * 16, o[ct], PL, wmma::mem_row_major);
        }
        __syncwarp();
        for (int i = lane; i < 16 * DV; i += 32) {
            const int r = r0 + i / DV, c = i % DV;
            if (r < n) {
                out[(((long long)b * T + t0 + r) * H + h) * D + j * DV + c] = (OutT)Ps[r * PL + c];
            }
        }
        // E: S ← γ^n S + (k γ^(n−1−σ))ᵀ v, the warp's tiles
        for (int i = 0; i < TILES; ++i) {
            const int t = warp + 4 * i, rt = (t / NC) * 16, ct = (t % NC) * 16;
            for (int e = 0; e < S[i].num_elements; ++e) {
                S[i].x[e] *= dec[n];
            }
            for (int kk = 0; kk < C; kk += 8) {
                AT8 kt;
                B8 vb;
                wmma::load_matrix_sync(kt, Ks + kk * QL + rt, QL);
                wmma::load_matrix_sync(vb, Vs + kk * VL + ct, VL);
                wmma::mma_sync(S[i], kt, vb, S[i]);
            }
        }
        __syncthreads();  // before the next chunk overwrites what this one read
    }
    for (int i = 0; i < TILES; ++i) {
        const int t = warp + 4 * i, r = (t / NC) * 16, c = (t % NC) * 16;
        float* dst = final_state + ((long long)bh * D + r) * D + j * DV + c;
        wmma::store_matrix_sync(dst, S[i], D, wmma::mem_row_major);
    }
"""

HEADER = "#include <mma.h>\n"

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
    """The shapes the kernel takes: q, k, v of one shape [B, H, T, d] in bfloat16 or float16
    (exact in TF32), d a multiple of 32 up to 128."""
    d = q.shape[-1]
    return (
        q.dtype in (mx.bfloat16, mx.float16)
        and k.dtype == v.dtype == q.dtype
        and q.shape == k.shape == v.shape
        and d % COLUMNS == 0
        and d <= 128
    )


def shared_bytes(d: int) -> int:
    """Dynamic shared memory of a thread block (the layout above)."""
    floats = 2 * CHUNK * (d + 8) + CHUNK * (COLUMNS + 8) + CHUNK * (CHUNK + 8)
    return 4 * (floats + d * (COLUMNS + 8) + CHUNK + 1)


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
    fresh = state is None
    dims = mx.array([T, H], dtype=mx.int32)
    g = g.astype(mx.float32)
    start = g if fresh else state.astype(mx.float32)  # a zero state is not read
    o, final = _kernel("chunks", shared_bytes(d))(
        inputs=[q, k, v, g, start, dims, mx.array([scale], dtype=mx.float32)],
        template=[("InT", q.dtype), ("OutT", out_dtype), ("D", d), ("FRESH", int(fresh))],
        grid=(B * H * (d // COLUMNS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, T, H, d), (B, H, d, d)],
        output_dtypes=[out_dtype, mx.float32],
    )  # fmt: skip
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
    """The kernel `name` ("chunks": the prefill's, "step": the decode step's) for `shared`
    bytes of dynamic shared memory, made on first use (there is none without a CUDA backend);
    MLX compiles it once per template."""
    inputs, outputs, source, header = {
        "chunks": (INPUTS, ["out", "final_state"], _SOURCE, HEADER),
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
