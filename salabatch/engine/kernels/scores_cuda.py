"""Stage 1's block scores for a prefill chunk as one CUDA kernel (`mx.fast.cuda_kernel`),
straight from the queries and the compressed keys: what `sparse_select._select_tile` computes as
two matmuls (every query's raw scores against every chunk of both levels, materialised in q's
dtype) and the two kernels of `stage1_cuda` (the level-2 normaliser, then the head sum and the
pooling). At 128K keys those raw scores are ~1 GB a chunk and layer, written and read back; here
they stay in shared memory.

A thread block takes QT neighbouring queries of one (row, kv head); a warp is one query, its G
heads the rows of 16×16 tensor-core tiles (WMMA, q's dtype, float32 sums), the chunks the
columns, CT chunks' keys loaded into shared memory once for the QT warps, the next tile's loads
in flight while the warps score this one (two buffers, one barrier a tile: on an H100 the first
form, a tile loaded between two barriers with nothing in flight, was about even with the MLX
ops at 32K, 2026-11-27). Pass 1 runs over the
level-2 chunks for each head's log-sum-exp (online, in float32); pass 2 over the level-1
chunks: each score rounded to q's dtype (as the matmul's output is), scaled, exp(· − lse2)
summed over the G heads, then maxed over the r + 1 chunks overlapping each block (r·b − 1 …
r·b + r − 1), written once. The scores are those of `stage1_cuda.pooled_scores`, which with
the matmuls before it is the reference.

Layout:
  q       [B, Hk, G, T, d]  the chunk's queries (bfloat16 or float16), G ≤ 16
  c1, c2  [b, Hk, N, d]     the compressed keys of each level (b: 1, shared by the rows, or B)
  seen1, seen2  [B, T] int32  the chunks each query sees at each level
  →       [B, Hk, T, n_blocks] float32

Off by default until its parity test (`tests/engine/kernels/test_scores_cuda.py`, marked
`gpu`) has passed on a GPU: `SALABATCH_CUDA_KERNELS=stage1,scores` switches it on; the
dispatcher (`sparse_select.select_blocks_gpu`) then takes it where `supports` says.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from salabatch.engine.kernels.attention import cuda_kernel
from salabatch.engine.kernels.stage2_cuda import BLOCK_ATTENTION

CHUNKS = 64  # chunks a tile of compressed keys
QUERIES = 8  # warps (queries) a thread block
INPUTS = ("q", "c1", "c2", "seen1", "seen2", "dims", "scale")

# Shared memory: Cs [CT][D] (a tile of compressed keys), Qs [QT][16][D] (each warp's query
# rows), Sw [QT][16][CT + 4] float (its scores), Lw [QT][16] (its rows' lse), Pw [QT][CT]
# (its chunks' head sums), seen [QT][2] int, then (32-byte aligned) a second tile of keys.
_SOURCE = """
    using namespace nvcuda;
    constexpr int CT = 64, SP = CT + 4;
    const int Tq = dims[0], Hk = dims[1], G = dims[2], N1 = dims[3], N2 = dims[4];
    const int n_blocks = dims[5], r = dims[6], cb = dims[7];
    const int tiles = (Tq + QT - 1) / QT;
    const int tile = blockIdx.x % tiles, h = (blockIdx.x / tiles) % Hk;
    const int b = blockIdx.x / (tiles * Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = tile * QT + warp;
    const bool active = t < Tq;
    const float a = scale[0];

    extern __shared__ __align__(32) unsigned char smem[];
    T* Cs = reinterpret_cast<T*>(smem);
    T* Qs = Cs + CT * D + warp * 16 * D;
    float* Sw = reinterpret_cast<float*>(Cs + CT * D + QT * 16 * D) + warp * 16 * SP;
    float* Lw = reinterpret_cast<float*>(Cs + CT * D + QT * 16 * D) + QT * 16 * SP + warp * 16;
    float* Pw = Lw - warp * 16 + QT * 16 + warp * CT;
    int* seen = reinterpret_cast<int*>(Pw - warp * CT + QT * CT);

    const int s1 = active ? min(seen1[b * Tq + t], N1) : 0;
    const int s2 = active ? min(seen2[b * Tq + t], N2) : 0;
    if (lane == 0) {
        seen[2 * warp] = s1;
        seen[2 * warp + 1] = s2;
    }
    // the warp's query: its G heads as rows (the rest zero)
    const long long q0 = (((long long)b * Hk + h) * G * Tq + t) * D;
    for (int i = lane; i < 16 * D; i += 32) {
        const int g = i / D;
        Qs[i] = active && g < G ? q[q0 + (long long)g * Tq * D + i % D] : static_cast<T>(0.0f);
    }
    __syncthreads();
    int L1 = 0, L2 = 0;  // the chunks any query of the block sees
    for (int w = 0; w < QT; ++w) {
        L1 = max(L1, seen[2 * w]);
        L2 = max(L2, seen[2 * w + 1]);
    }
    salabatch::QueryFragments<T, D> qf;
    for (int kt = 0; kt < D / 16; ++kt) {
        wmma::load_matrix_sync(qf[kt], Qs + kt * 16, D);
    }
    const long long cbase = (long long)min(b, cb - 1) * Hk + h;

    // The tiles of CT chunks, pass 1's (level 2) then pass 2's (level 1), in two buffers: while
    // the warps score tile i, the block's loads of tile i + 1 are in flight (16 bytes a thread
    // at a time, in registers), stored into the other buffer after; one barrier a tile.
    constexpr int BASE = (CT + QT * 16) * D * (int)sizeof(T) + 4 * QT * (16 * SP + 16 + CT + 2);
    T* const alt = reinterpret_cast<T*>(smem + (BASE + 31) / 32 * 32);
    auto buffer = [&](int i) { return i % 2 ? alt : Cs; };  // tile i's (no array: no stack)
    constexpr int VEC = 16 / sizeof(T), PER = CT * D / VEC, MINE = (PER + 32 * QT - 1) / (32 * QT);
    const int n2 = (L2 + CT - 1) / CT, n1 = (L1 + CT - 1) / CT;
    uint4 next[MINE];
    auto fetch = [&](int i) {  // tile i's chunks into `next`, zeros past the level's N
        const bool two = i < n2;
        const int N = two ? N2 : N1, j0 = (two ? i : i - n2) * CT;
        const T* src = (two ? c2 : c1) + (cbase * N + j0) * D;
#pragma unroll
        for (int u = 0; u < MINE; ++u) {
            const int v = threadIdx.x + u * 32 * QT;
            next[u] = make_uint4(0, 0, 0, 0);
            if (v < PER && j0 + v * VEC / D < N) {
                next[u] = reinterpret_cast<const uint4*>(src)[v];
            }
        }
    };
    auto stash = [&](T* buffer) {
#pragma unroll
        for (int u = 0; u < MINE; ++u) {
            const int v = threadIdx.x + u * 32 * QT;
            if (v < PER) {
                reinterpret_cast<uint4*>(buffer)[v] = next[u];
            }
        }
    };

    const int row = lane / 2;
    float m = __int_as_float(0xff800000), l = 0.0f;  // -inf, 0: the lane's row's lse so far
    // each head's log-sum-exp over the level-2 chunks (two lanes a row), into Lw
    auto finish_lse = [&]() {
        const float m_o = __shfl_xor_sync(0xffffffffu, m, 1);
        const float l_o = __shfl_xor_sync(0xffffffffu, l, 1);
        const float top = fmaxf(m, m_o);
        float sum = l > 0.0f ? l * expf(m - top) : 0.0f;
        sum += l_o > 0.0f ? l_o * expf(m_o - top) : 0.0f;
        if (lane % 2 == 0) {
            Lw[row] = top + logf(sum);
        }
        __syncwarp();
    };
    const long long out0 = (((long long)b * Hk + h) * Tq + t) * n_blocks;
    float carry = 0.0f;  // pass 2: chunk j0 − 1's sum
    if (n2 == 0) {
        finish_lse();
    }
    if (n2 + n1 > 0) {
        fetch(0);
        stash(buffer(0));
    }
    __syncthreads();
    for (int i = 0; i < n2 + n1; ++i) {
        if (i + 1 < n2 + n1) {
            fetch(i + 1);
        }
        salabatch::score_tiles<T, D, CT, SP>(qf, buffer(i), Sw);
        if (i < n2) {
            // pass 1: the online log-sum-exp of each head over the level-2 chunks it sees
            const int j0 = i * CT;
            for (int c = lane % 2; c < CT; c += 2) {
                if (j0 + c < s2) {
                    const float x = static_cast<float>(static_cast<T>(Sw[row * SP + c])) * a;
                    const float top = fmaxf(m, x);
                    l = l * expf(m - top) + expf(x - top);
                    m = top;
                }
            }
            __syncwarp();
            if (i == n2 - 1) {
                finish_lse();
            }
        } else {
            // pass 2: each level-1 chunk's head sum, then each block's max over its r + 1
            const int j0 = (i - n2) * CT;
            for (int c = lane; c < CT; c += 32) {
                float p = 0.0f;
                if (j0 + c < s1 && s2 > 0) {
                    for (int g = 0; g < G; ++g) {
                        const float x = static_cast<float>(static_cast<T>(Sw[g * SP + c])) * a;
                        p += expf(x - Lw[g]);
                    }
                }
                Pw[c] = p;
            }
            __syncwarp();
            for (int k = lane; k < CT / r; k += 32) {
                const int blk = j0 / r + k;
                float best = k == 0 ? carry : Pw[r * k - 1];
                for (int x = 0; x < r; ++x) {
                    best = fmaxf(best, Pw[r * k + x]);
                }
                if (active && blk < n_blocks) {
                    pooled[out0 + blk] = best;
                }
            }
            carry = Pw[CT - 1];
            __syncwarp();
        }
        if (i + 1 < n2 + n1) {
            stash(buffer(i + 1));  // its last readers were done at the last barrier
        }
        __syncthreads();
    }
    // the blocks past the last tile: the first holds its last chunk, the rest see none
    const int done = (L1 + CT - 1) / CT * CT / r;
    for (int blk = done + lane; active && blk < n_blocks; blk += 32) {
        pooled[out0 + blk] = blk == done ? carry : 0.0f;
    }
"""

HEADER = BLOCK_ATTENTION  # its tensor-core tiles: QueryFragments, score_tiles


def available() -> bool:
    """Whether the kernel may run: CUDA, and `SALABATCH_CUDA_KERNELS` names "scores"."""
    return cuda_kernel("scores")


def supports(q: mx.array, c1: mx.array, r: int) -> bool:
    """The shapes the kernel takes: q [B, Hk, G, T, d] in bfloat16 or float16 with at most 16
    heads a kv group and d a multiple of 16 up to 128, keys of q's dtype, r dividing CHUNKS."""
    d = q.shape[-1]
    return (
        q.dtype in (mx.bfloat16, mx.float16)
        and c1.dtype == q.dtype
        and q.shape[2] <= 16
        and d % 16 == 0
        and d <= 128
        and CHUNKS % r == 0
    )


def shared_bytes(d: int, itemsize: int, tile: int = QUERIES) -> int:
    """Dynamic shared memory of a thread block (the layout above)."""
    keys = (CHUNKS + tile * 16) * d * itemsize
    base = keys + 4 * tile * (16 * (CHUNKS + 4) + 16 + CHUNKS + 2)
    return -(-base // 32) * 32 + CHUNKS * d * itemsize  # the second tile of keys, 32-byte aligned


def pooled_scores(
    q: mx.array,
    c1: mx.array,
    c2: mx.array,
    seen1: mx.array,
    seen2: mx.array,
    scale: float,
    n_blocks: int,
    r: int,
    tile: int = QUERIES,
) -> mx.array:
    """q [B, Hk, G, T, d]; c1, c2 [b, Hk, N, d]; seen1, seen2 [B, T] → the pooled block scores
    [B, Hk, T, n_blocks] float32 (layout above)."""
    B, Hk, G, T, d = q.shape
    N1, N2 = c1.shape[2], c2.shape[2]
    dims = mx.array([T, Hk, G, N1, N2, n_blocks, r, c1.shape[0]], dtype=mx.int32)
    (pooled,) = _kernel(shared_bytes(d, q.dtype.size, tile))(
        inputs=[q, c1, c2.astype(q.dtype), seen1.astype(mx.int32), seen2.astype(mx.int32), dims,
                mx.array([scale], dtype=mx.float32)],
        template=[("T", q.dtype), ("D", d), ("QT", tile)],
        grid=(B * Hk * -(-T // tile) * 32 * tile, 1, 1),
        threadgroup=(32 * tile, 1, 1),
        output_shapes=[(B, Hk, T, n_blocks)],
        output_dtypes=[mx.float32],
    )  # fmt: skip
    return pooled


@functools.cache
def _kernel(shared: int):
    """The kernel object for `shared` bytes of dynamic shared memory, made on first use (there
    is none without a CUDA backend); MLX compiles it once per template."""
    return mx.fast.cuda_kernel(
        name="salabatch_stage1_scores",
        input_names=list(INPUTS),
        output_names=["pooled"],
        source=_SOURCE,
        header=HEADER,
        shared_memory=shared,
    )
