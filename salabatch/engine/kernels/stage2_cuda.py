"""Stage 2 as one CUDA kernel (`mx.fast.cuda_kernel`) for a prefill's queries on the GPU path:
a warp takes one query of one kv head and walks the blocks it selected on its own, with no
barrier shared with other warps. Its G heads are the rows of 16×16 tensor-core tiles (WMMA);
each block's keys and values go from the cache (L2) straight into tensor-core fragments, the
scores Q·Kᵀ in float32 pass through the warp's shared memory for the online softmax (float32,
two lanes a row), the weights are rounded to q's dtype for P·V as the MLX-op forms round them,
and the output stays in accumulator fragments for the whole walk: rescaled element by element
where its row's max moved (each element's row read once from a fragment loaded with row
numbers, the layout of a fragment being the same for every fragment of its type), divided by
its row's sum at the end and written once, in q's dtype.

The MLX-op forms (`sparse_attention._masked_tile`, `_sparse_tile`) either attend every key with
the selection as a mask (19 ms a 8K chunk and layer at 32K on an H100) or gather each query's
96 blocks apart (38 ms at any context). A first kernel here had a thread block of 4 queries
walk the union of their blocks, each loaded into shared memory between two barriers: with
random keys each query's 63 top-k blocks are its own, the union ~280 blocks for ~96 each, and
it lost (~39 ms at 32K, the prefill 2.28 s against 1.81; H100, 2026-11-27). By its bytes (the
selected blocks' keys and values, ~50 GB a chunk and layer read from L2 at 32K) this form
should take ~6-9 ms there, and ~17 ms at 128K, where the keys no longer fit in L2.

Layout:
  q       [B, T, H, d]   the chunk's queries (q's dtype: bfloat16 or float16)
  keys, values [B, Hk, R, d]  the rows' own buffers, whole (no shared part: kv.start == 0)
  idx     [B, Hk, T, K]  int32, each query's blocks in any order, -1 for none
  first   [B]            int32, the position of each row's query 0
  →       [B, T, H, d]   in q's dtype

On by default on CUDA (`attention.DEFAULT_CUDA_KERNELS`): its parity tests
(`tests/engine/kernels/test_stage2_cuda.py`, marked `gpu`) passed on an H200 (2026-11-28), where
it took 18.5-19.3 ms a 8K chunk and layer at 32K and at 128K (the masked form 14.4 and 53.5, the
gathers 37.6 and 39.8); the dispatcher (`sparse_attention.block_sparse_attention_gpu`) takes it
past `STAGE2_KERNEL_KEYS`, where `supports` says. `SALABATCH_CUDA_KERNELS` without "stage2"
switches it off.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from salabatch.engine.kernels.attention import cuda_kernel

# What both stage-2 kernels (this prefill one and the decode step's, `decode_cuda`) do with one
# query's G heads, a warp: stage them as 16 rows of tensor-core fragments (rows past G zero),
# and attend one block of keys and values in shared memory. Per warp in shared memory: S (16 ×
# SP floats), O (16 × OP floats), P (16 × PP of T), strides padded so that the softmax's
# lanes read distinct banks; lane → row r = lane / 2 of the 16, columns lane % 2, + 2, ...
BLOCK_ATTENTION = """
#include <mma.h>
namespace salabatch {
using namespace nvcuda;

template <typename T, int D>
using QueryFragments = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>[D / 16];

// rows [16, D] (the first `heads` of them read, the rest zero) as fragments; O zeroed. Qs is
// scratch of 16 × D of T (O's room serves).
template <typename T, int D>
__device__ void load_query(QueryFragments<T, D>& qf, const T* rows, int heads, T* Qs, float* Ow,
                           int lane) {
    constexpr int OP = D + 4;
    for (int i = lane; i < 16 * D; i += 32) {
        Qs[i] = i / D < heads ? rows[i] : static_cast<T>(0.0f);
    }
    __syncwarp();
    for (int kt = 0; kt < D / 16; ++kt) {
        wmma::load_matrix_sync(qf[kt], Qs + kt * 16, D);
    }
    __syncwarp();
    for (int i = lane; i < 16 * OP; i += 32) {
        Ow[i] = 0.0f;
    }
    __syncwarp();
}

// S = Q·Kᵀ in float32 for N keys (Ks [N, D]): the warp's 16 rows × N columns into Sw (stride
// SP floats)
template <typename T, int D, int N, int SP>
__device__ void score_tiles(const QueryFragments<T, D>& qf, const T* Ks, float* Sw) {
    for (int nt = 0; nt < N / 16; ++nt) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kt = 0; kt < D / 16; ++kt) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
            wmma::load_matrix_sync(kf, Ks + nt * 16 * D + kt * 16, D);
            wmma::mma_sync(acc, qf[kt], kf, acc);
        }
        wmma::store_matrix_sync(Sw + nt * 16, acc, SP, wmma::mem_row_major);
    }
    __syncwarp();
}

// The online softmax of one block's scores Sw (16 rows, stride SP): each row's weights in the
// log2 domain (a: scale·log2 e; keys after qpos masked), rounded to T into Pw (stride BLOCK + 8),
// two lanes a row (lane ℓ: row ℓ / 2, columns ℓ % 2, + 2, ...); m, l the lane's row's running
// max and sum, updated → the factor by which that row's output so far is to be scaled.
template <typename T, int BLOCK, int SP>
__device__ float softmax_block(const float* Sw, T* Pw, long long base, long long qpos, float a,
                               int lane, float& m, float& l) {
    constexpr int PP = BLOCK + 8;
    const float NEG_INF = __int_as_float(0xff800000);
    const int r = lane >> 1, half = lane & 1;
    float mb = NEG_INF;
    for (int c = half; c < BLOCK; c += 2) {
        if (base + c <= qpos) {
            mb = fmaxf(mb, Sw[r * SP + c] * a);
        }
    }
    mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
    const float mn = fmaxf(m, mb);  // finite: the block's first key is not after the query
    const float alpha = exp2f(m - mn);
    float sum = 0.0f;
    for (int c = half; c < BLOCK; c += 2) {
        const float p = base + c <= qpos ? exp2f(Sw[r * SP + c] * a - mn) : 0.0f;
        const T pt = static_cast<T>(p);
        Pw[r * PP + c] = pt;
        sum += static_cast<float>(pt);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = mn;
    return alpha;
}

// One block of BLOCK keys at positions base.. (Ks, Vs [BLOCK, D]): S = Q·Kᵀ in float32, the
// online softmax of each row in the log2 domain (a: scale·log2 e; keys after qpos masked; m, l
// the lane's row's running max and sum), the weights rounded to T, O rescaled where its max
// moved, O += P·V.
template <typename T, int D, int BLOCK>
__device__ void attend_block(const QueryFragments<T, D>& qf, const T* Ks, const T* Vs, float* Sw,
                             float* Ow, T* Pw, long long base, long long qpos, float a, int lane,
                             float& m, float& l) {
    constexpr int SP = BLOCK + 4, OP = D + 4, PP = BLOCK + 8;
    const int r = lane >> 1, half = lane & 1;
    score_tiles<T, D, BLOCK, SP>(qf, Ks, Sw);
    const float alpha = softmax_block<T, BLOCK, SP>(Sw, Pw, base, qpos, a, lane, m, l);
    for (int c = half; alpha != 1.0f && c < D; c += 2) {  // a row whose max held: as is
        Ow[r * OP + c] *= alpha;
    }
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf[BLOCK / 16];
    for (int kt = 0; kt < BLOCK / 16; ++kt) {
        wmma::load_matrix_sync(pf[kt], Pw + kt * 16, PP);
    }
    for (int nt = 0; nt < D / 16; ++nt) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::load_matrix_sync(acc, Ow + nt * 16, OP, wmma::mem_row_major);
        for (int kt = 0; kt < BLOCK / 16; ++kt) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
            wmma::load_matrix_sync(vf, Vs + kt * 16 * D + nt * 16, D);
            wmma::mma_sync(acc, pf[kt], vf, acc);
        }
        wmma::store_matrix_sync(Ow + nt * 16, acc, OP, wmma::mem_row_major);
    }
    __syncwarp();
}

// Each of the first `heads` rows of O divided by its sum, in T (rows: [heads, D]).
template <typename T, int D>
__device__ void write_rows(T* rows, int heads, const float* Ow, float l, int lane) {
    constexpr int OP = D + 4;
    const int r = lane >> 1, half = lane & 1;
    if (r < heads) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int c = half; c < D; c += 2) {
            rows[r * D + c] = static_cast<T>(Ow[r * OP + c] * inv);
        }
    }
}
}  // namespace salabatch
"""

# A warp a (row, kv head, query), QT warps a thread block (neighbouring queries: their windows'
# blocks are the same, read from L1 or L2 by each). Constants: T (q's dtype), D (head dim), G,
# QT, BLOCK (keys a block), QREG (the query's tiles in registers for the whole walk, or read
# from shared memory for each product: ~180 or ~150 registers a thread, the occupancy the
# profile weighs). Per warp in shared memory: Sw [16][SP] float (scores, then the output staged
# for its write; at the start the row numbers, and with QREG the query's rows), Pw [16][PP] of
# T (weights), Aw [16] float (each row's rescale, then 1 / its sum), without QREG the query's
# rows [16][D] of T.
_SOURCE = """
    using namespace nvcuda;
    using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
    constexpr int SP = (BLOCK > D ? BLOCK : D) + 4, PP = BLOCK + 8;
    constexpr int QBYTES = QREG ? 0 : 16 * D * (int)sizeof(T);  // the query's rows, kept
    constexpr int WARP_BYTES = 16 * SP * 4 + 16 * PP * (int)sizeof(T) + 16 * 4 + QBYTES;
    const float NEG_INF = __int_as_float(0xff800000);
    const int n = dims[0], H = dims[1], Hk = dims[2], R = dims[3], K = dims[4], B = dims[5];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long w = (long long)blockIdx.x * QT + warp;  // (b, h, t), t fastest
    if (w >= (long long)B * Hk * n) {
        return;  // a last thread block's spare warps (no barrier is shared across warps)
    }
    const int t = w % n, h = (w / n) % Hk, b = w / ((long long)n * Hk);
    const long long qpos = (long long)first[b] + t;
    const float a = scale[0] * 1.4426950408889634f;  // exp(x·scale) = 2^(x·a)

    extern __shared__ __align__(32) unsigned char smem[];
    float* Sw = reinterpret_cast<float*>(smem + warp * WARP_BYTES);
    T* Pw = reinterpret_cast<T*>(smem + warp * WARP_BYTES + 16 * SP * 4);
    float* Aw = reinterpret_cast<float*>(smem + warp * WARP_BYTES + 16 * SP * 4 +
                                         16 * PP * (int)sizeof(T));
    const int r = lane >> 1, half = lane & 1;  // the lane's row of the softmax, its columns

    // each accumulator element's row: a fragment loaded from a matrix of row numbers
    for (int i = lane; i < 256; i += 32) {
        Sw[(i / 16) * SP + i % 16] = (float)(i / 16);
    }
    __syncwarp();
    Acc rows;
    wmma::load_matrix_sync(rows, Sw, SP, wmma::mem_row_major);
    __syncwarp();
    // the query's G heads as the rows of fragments (the rest zero)
    const long long head0 = ((long long)b * n + t) * H + (long long)h * G;
    T* Qs = QREG ? reinterpret_cast<T*>(Sw) : reinterpret_cast<T*>(Aw + 16);
    for (int i = lane; i < 16 * D; i += 32) {
        Qs[i] = i / D < G ? q[head0 * D + i] : static_cast<T>(0.0f);
    }
    __syncwarp();
    salabatch::QueryFragments<T, D> qf;  // QREG: in registers for the whole walk
#pragma unroll
    for (int kt = 0; QREG && kt < D / 16; ++kt) {
        wmma::load_matrix_sync(qf[kt], Qs + kt * 16, D);
    }
    __syncwarp();
    Acc o[D / 16];
#pragma unroll
    for (int nt = 0; nt < D / 16; ++nt) {
        wmma::fill_fragment(o[nt], 0.0f);
    }
    float m = NEG_INF, l = 0.0f;  // the lane's row's running max (log2 domain) and sum

    const int* list = idx + (((long long)b * Hk + h) * n + t) * K;
    const T* kbase = keys + ((long long)b * Hk + h) * R * D;
    const T* vbase = values + ((long long)b * Hk + h) * R * D;
    int upcoming = K > 0 ? list[0] : -1;  // the next slot's block, read a block ahead
    for (int slot = 0; slot < K; ++slot) {
        const int blk = upcoming;
        if (slot + 1 < K) {
            upcoming = list[slot + 1];
        }
        const long long base = (long long)blk * BLOCK;
        if (blk < 0 || base > qpos) {
            continue;  // no block, or one after the query: the same for every lane
        }
        // S = Q·Kᵀ, float32, tile by tile into Sw
        const T* kb = kbase + base * D;
#pragma unroll
        for (int nt = 0; nt < BLOCK / 16; ++nt) {
            Acc acc;
            wmma::fill_fragment(acc, 0.0f);
#pragma unroll
            for (int kt = 0; kt < D / 16; ++kt) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, kb + nt * 16 * D + kt * 16, D);
                if (QREG) {
                    wmma::mma_sync(acc, qf[kt], kf, acc);
                } else {  // 32 registers fewer a thread, a tile of the query from shared memory
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa;
                    wmma::load_matrix_sync(qa, Qs + kt * 16, D);
                    wmma::mma_sync(acc, qa, kf, acc);
                }
            }
            wmma::store_matrix_sync(Sw + nt * 16, acc, SP, wmma::mem_row_major);
        }
        __syncwarp();
        // the online softmax of each row (keys after the query masked), weights rounded to T
        const float alpha =
            salabatch::softmax_block<T, BLOCK, SP>(Sw, Pw, base, qpos, a, lane, m, l);
        if (half == 0) {
            Aw[r] = alpha;
        }
        __syncwarp();
        // O rescaled where its row's max moved, then O += P·V
        float scale_e[Acc::num_elements];
#pragma unroll
        for (int e = 0; e < Acc::num_elements; ++e) {
            scale_e[e] = Aw[(int)rows.x[e]];
        }
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf[BLOCK / 16];
#pragma unroll
        for (int kt = 0; kt < BLOCK / 16; ++kt) {
            wmma::load_matrix_sync(pf[kt], Pw + kt * 16, PP);
        }
        const T* vb = vbase + base * D;
#pragma unroll
        for (int nt = 0; nt < D / 16; ++nt) {
#pragma unroll
            for (int e = 0; e < Acc::num_elements; ++e) {
                o[nt].x[e] *= scale_e[e];
            }
#pragma unroll
            for (int kt = 0; kt < BLOCK / 16; ++kt) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
                wmma::load_matrix_sync(vf, vb + kt * 16 * D + nt * 16, D);
                wmma::mma_sync(o[nt], pf[kt], vf, o[nt]);
            }
        }
        __syncwarp();  // every lane has read Sw, Pw and Aw before the next block writes them
    }
    // each row divided by its sum, staged in Sw, the first G rows written in T
    if (half == 0) {
        Aw[r] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < D / 16; ++nt) {
#pragma unroll
        for (int e = 0; e < Acc::num_elements; ++e) {
            o[nt].x[e] *= Aw[(int)rows.x[e]];
        }
        wmma::store_matrix_sync(Sw + nt * 16, o[nt], SP, wmma::mem_row_major);
    }
    __syncwarp();
    for (int i = lane; i < G * D; i += 32) {
        out[head0 * D + i] = static_cast<T>(Sw[(i / D) * SP + i % D]);
    }
"""

INPUTS = ("q", "keys", "values", "idx", "first", "dims", "scale")
QUERIES_PER_TILE = 4  # warps (queries) a thread block (the profile times 2, 4 and 8)
QUERY_IN_REGISTERS = True  # QREG (the profile times both)
MAX_SHARED = 227 * 1024  # an H100's shared memory a thread block can have


def available() -> bool:
    """Whether the kernel may run: CUDA, and `SALABATCH_CUDA_KERNELS` names "stage2"."""
    return cuda_kernel("stage2")


def block_attention_takes(q: mx.array, heads_per_group: int, block: int) -> bool:
    """The shapes BLOCK_ATTENTION (both stage-2 kernels) takes: q in bfloat16 or float16, a head
    dim of 16·k up to 128, at most 16 heads a kv group (the rows of a tensor-core tile), blocks
    of 16·k keys."""
    d = q.shape[-1]
    return (
        q.dtype in (mx.bfloat16, mx.float16)
        and d % 16 == 0
        and d <= 128
        and 0 < heads_per_group <= 16
        and block % 16 == 0
    )


def supports(q: mx.array, heads_per_group: int, block: int) -> bool:
    """The shapes this kernel takes: BLOCK_ATTENTION's, within a thread block's shared memory."""
    d, itemsize = q.shape[-1], q.dtype.size
    return (
        block_attention_takes(q, heads_per_group, block)
        and shared_bytes(d, block, QUERIES_PER_TILE, itemsize, QUERY_IN_REGISTERS) <= MAX_SHARED
    )


def shared_bytes(d: int, block: int, tile: int, itemsize: int, qreg: bool = True) -> int:
    """Dynamic shared memory of a thread block: per warp its scores (or output) in float32,
    its weights in q's dtype and its rows' factors, strides padded as the source, and without
    `qreg` its query's rows."""
    per_warp = 16 * (max(block, d) + 4) * 4 + 16 * (block + 8) * itemsize + 16 * 4
    return tile * (per_warp + (0 if qreg else 16 * d * itemsize))


def thread_blocks(rows: int, kv_heads: int, queries: int, tile: int) -> int:
    """Thread blocks of `tile` warps for a warp each (row, kv head, query)."""
    return -(-rows * kv_heads * queries // tile)


def attend(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    idx: mx.array,
    first: mx.array,
    scale: float,
    block: int,
    tile: int = QUERIES_PER_TILE,
    qreg: bool = QUERY_IN_REGISTERS,
) -> mx.array:
    """q [B, T, H, d]; keys, values [B, Hk, R, d]; idx [B, Hk, T, K] (any order, -1: none);
    first [B] → [B, T, H, d] in q's dtype (layout above)."""
    B, T, H, d = q.shape
    Hk, R = keys.shape[1], keys.shape[2]
    K = idx.shape[-1]
    dims = mx.array([T, H, Hk, R, K, B], dtype=mx.int32)
    # ascending: a thread block's warps (neighbouring queries) then reach the blocks their
    # windows share at about the same time, the later ones from L1
    ordered = mx.sort(idx.astype(mx.int32), axis=-1)
    (out,) = _kernel(shared_bytes(d, block, tile, q.dtype.size, qreg))(
        inputs=[q, keys, values, ordered, first.astype(mx.int32), dims,
                mx.array([scale], dtype=mx.float32)],
        template=[("T", q.dtype), ("D", d), ("G", H // Hk), ("QT", tile), ("BLOCK", block),
                  ("QREG", int(qreg))],
        grid=(thread_blocks(B, Hk, T, tile) * 32 * tile, 1, 1),
        threadgroup=(32 * tile, 1, 1),
        output_shapes=[(B, T, H, d)],
        output_dtypes=[q.dtype],
    )  # fmt: skip
    return out


@functools.cache
def _kernel(shared: int):
    """The kernel object for a thread block of `shared` bytes of dynamic shared memory, made on
    first use (there is none without a CUDA backend); MLX compiles it once per template."""
    return mx.fast.cuda_kernel(
        name="salabatch_stage2_queries",
        input_names=list(INPUTS),
        output_names=["out"],
        source=_SOURCE,
        header=BLOCK_ATTENTION,
        shared_memory=shared,
    )
