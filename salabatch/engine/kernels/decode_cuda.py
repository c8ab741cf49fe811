"""A decode step's block selection (stage 1 after its scores) as one CUDA kernel
(`mx.fast.cuda_kernel`) for the GPU path's compiled step: what `sparse_decode._select_step`
computes with MLX ops from the raw chunk scores, the level-2 normaliser, each level-1 entry's
probability summed over the G heads, the pooling into blocks, the forced and excluded blocks
and the top-k, in one launch instead of eleven (two concatenations, the normaliser, the
probabilities, their head sum, the pooling's gather and max, the top-k's key, partition and
decode). A decode step's selection works on a few thousand numbers a (row, kv head): on a GPU
its time is the launches of a chain of small kernels, not their bytes (a sparse layer's
decode attention, ~31 kernels, took ~0.39 ms on an H100; a lightning layer's 16 kernels
stream 570 MB in ~0.33).

One thread block a (row, kv head), 1024 threads: each head's level-2 log-sum-exp (a warp a
head), then each block's pooled score and its top-k key, kept in shared memory (4 bytes a
block), then an exact radix select of the k largest (key, complement of the id) pairs, eight
passes of 8 bits, and the chosen ids written in ascending order (a block-wide scan), which is
also the order `decode_attention` sorts them into.

Layout (the step's, `sparse_decode._select_step`):
  s1s, s1o   [B, Hk, G, S1], [B, Hk, G, O1]  q·c1 for the shared and the row's own level-1
             entries (q's dtype, unscaled); entry e of the level is s1s's e, then s1o's
  s2s, s2o   the same for level 2, S2 and O2 entries
  numbers0, numbers1  [E_l] int32: each entry's chunk number (`step_tables`), seen where it is
             below the row's count; entries past S + O (the level-1 zero entry) score 0
  pool       [n_blocks, r + 1] int32: the level-1 entries each block pools
  info       [B, w] int32: `step_rows` (position, own offset, block, chunks seen per level)
  →          [B, Hk, k] int32, ascending: the k blocks `_top_k` picks

Off by default until its parity test (`tests/engine/kernels/test_decode_cuda.py`, marked
`gpu`) has passed on a GPU: `SALABATCH_CUDA_KERNELS=stage1,decode` switches it on.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from salabatch.engine.kernels.attention import cuda_kernel

_SOURCE = """
    const int S1 = dims[0], O1 = dims[1], S2 = dims[2], O2 = dims[3], nb = dims[4], k = dims[5];
    const int Hk = dims[6], init = dims[7], local = dims[8], width = dims[9];
    const float NEG_INF = __int_as_float(0xff800000);
    const int bh = blockIdx.x, b = bh / Hk;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
    const int q_blk = info[b * width + 2], seen1 = info[b * width + 3];
    const int seen2 = info[b * width + 4];
    const float a = scale[0] * 1.4426950408889634f;  // exp(x·scale) = 2^(x·a)

    extern __shared__ __align__(16) unsigned char smem[];
    unsigned long long* chosen = reinterpret_cast<unsigned long long*>(smem);  // [2]
    int* hist = reinterpret_cast<int*>(chosen + 2);                          // [256]
    int* sums = hist + 256;                                                  // [32]
    float* lse = reinterpret_cast<float*>(sums + 32);  // [G], log2 domain
    unsigned* key = reinterpret_cast<unsigned*>(lse + G);  // [nb]

    // each head's level-2 normaliser over the entries the row sees
    for (int g = warp; g < G; g += warps) {
        const T* xs = s2s + ((long long)bh * G + g) * S2;
        const T* xo = s2o + ((long long)bh * G + g) * O2;
        float m = NEG_INF;
        for (int e = lane; e < S2 + O2; e += 32) {
            if (numbers1[e] < seen2) {
                m = fmaxf(m, static_cast<float>(e < S2 ? xs[e] : xo[e - S2]) * a);
            }
        }
        for (int o = 16; o > 0; o /= 2) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        }
        float s = 0.0f;
        if (m != NEG_INF) {
            for (int e = lane; e < S2 + O2; e += 32) {
                if (numbers1[e] < seen2) {
                    s += exp2f(static_cast<float>(e < S2 ? xs[e] : xo[e - S2]) * a - m);
                }
            }
        }
        for (int o = 16; o > 0; o /= 2) {
            s += __shfl_xor_sync(0xffffffffu, s, o);
        }
        if (lane == 0) {
            lse[g] = m == NEG_INF ? 0.0f : m + log2f(s);
        }
    }
    __syncthreads();

    // each block's key: forced the largest, after the query 0, else its pooled score's bits + 1
    for (int blk = tid; blk < nb; blk += blockDim.x) {
        unsigned kk;
        if (blk < init || (blk >= q_blk - local && blk <= q_blk)) {
            kk = 0xffffffffu;
        } else if (blk > q_blk) {
            kk = 0u;
        } else {
            float best = 0.0f;
            for (int j = 0; seen2 > 0 && j < R1; ++j) {
                const int e = pool[blk * R1 + j];
                if (e < S1 + O1 && numbers0[e] < seen1) {
                    float p = 0.0f;
                    for (int g = 0; g < G; ++g) {
                        const long long row = (long long)bh * G + g;
                        const float x = static_cast<float>(
                            e < S1 ? s1s[row * S1 + e] : s1o[row * O1 + e - S1]);
                        p += exp2f(x * a - lse[g]);
                    }
                    best = fmaxf(best, p);
                }
            }
            kk = __float_as_uint(best) + 1u;
        }
        key[blk] = kk;
    }
    __syncthreads();

    // the k-th largest (key, nb - 1 - id), unique, by its digits from the top, 8 bits a pass
    unsigned long long prefix = 0;
    int rem = k;
    for (int pass = 0; pass < 8; ++pass) {
        const int shift = 56 - 8 * pass;
        for (int i = tid; i < 256; i += blockDim.x) {
            hist[i] = 0;
        }
        __syncthreads();
        for (int blk = tid; blk < nb; blk += blockDim.x) {
            const unsigned long long c =
                ((unsigned long long)key[blk] << 32) | (unsigned)(nb - 1 - blk);
            if (pass == 0 || (c >> (shift + 8)) == (prefix >> (shift + 8))) {
                atomicAdd(&hist[(c >> shift) & 255], 1);
            }
        }
        __syncthreads();
        if (tid == 0) {
            int above = 0, digit = 255;
            while (above + hist[digit] < rem) {
                above += hist[digit];
                --digit;
            }
            chosen[0] = prefix | ((unsigned long long)digit << shift);
            chosen[1] = (unsigned long long)(rem - above);
        }
        __syncthreads();
        prefix = chosen[0];
        rem = (int)chosen[1];
        __syncthreads();
    }

    // the blocks at or above it, in ascending order: a thread a run of blocks, then a scan
    const int per = (nb + blockDim.x - 1) / blockDim.x;
    const int lo = min(nb, tid * per), hi = min(nb, lo + per);
    int count = 0;
    for (int blk = lo; blk < hi; ++blk) {
        count += (((unsigned long long)key[blk] << 32) | (unsigned)(nb - 1 - blk)) >= prefix;
    }
    int x = count;
    for (int o = 1; o < 32; o *= 2) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) {
            x += y;
        }
    }
    if (lane == 31) {
        sums[warp] = x;
    }
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? sums[lane] : 0;
        for (int o = 1; o < 32; o *= 2) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) {
                w += y;
            }
        }
        __syncwarp();
        sums[lane] = w;
    }
    __syncthreads();
    int at = x - count + (warp > 0 ? sums[warp - 1] : 0);
    for (int blk = lo; blk < hi; ++blk) {
        if ((((unsigned long long)key[blk] << 32) | (unsigned)(nb - 1 - blk)) >= prefix) {
            top[(long long)bh * k + at] = blk;
            ++at;
        }
    }
"""

INPUTS = ("s1s", "s1o", "s2s", "s2o", "numbers0", "numbers1", "pool", "info", "dims", "scale")
THREADS = 1024
MAX_SHARED = 227 * 1024  # an H100's shared memory a thread block can have


def available() -> bool:
    """Whether the kernel may run: CUDA, and `SALABATCH_CUDA_KERNELS` names "decode"."""
    return cuda_kernel("decode")


MAX_BLOCKS = 32768  # 2M tokens of 64-key blocks: what one thread block's shared memory holds
MAX_HEADS = 64


def shared_bytes(n_blocks: int = MAX_BLOCKS, heads: int = MAX_HEADS) -> int:
    """Dynamic shared memory: the pass's prefix, the histogram, a warp's count, a normaliser a
    head, a key a block. The kernel always asks for the most (one size: MLX sets a kernel's
    shared memory limit once, when it first loads it)."""
    return 16 + 4 * (256 + 32 + heads + n_blocks)


def supports(n_blocks: int, heads: int, k: int) -> bool:
    return 0 < k <= n_blocks <= MAX_BLOCKS and heads <= MAX_HEADS


def top_k(
    scores1: tuple[mx.array, mx.array],
    scores2: tuple[mx.array, mx.array],
    tables: dict[str, mx.array],
    info: mx.array,
    *,
    k: int,
    scale: float,
    init: int,
    local: int,
) -> mx.array:
    """The selection of `_select_step` from its raw scores (layout above) → [B, Hk, k]."""
    (s1s, s1o), (s2s, s2o) = scores1, scores2
    B, Hk, G, S1 = s1s.shape
    pool = tables["pool"]
    n_blocks, r1 = pool.shape
    dims = [S1, s1o.shape[-1], s2s.shape[-1], s2o.shape[-1], n_blocks, k, Hk, init, local,
            info.shape[1]]  # fmt: skip
    (top,) = _kernel()(
        inputs=[s1s, s1o, s2s, s2o, tables["numbers0"], tables["numbers1"], pool, info,
                mx.array(dims, dtype=mx.int32), mx.array([scale], dtype=mx.float32)],
        template=[("T", s1s.dtype), ("G", G), ("R1", r1)],
        grid=(B * Hk * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, Hk, k)],
        output_dtypes=[mx.int32],
    )  # fmt: skip
    return top


@functools.cache
def _kernel():
    """The kernel object, made on first use (there is none without a CUDA backend); MLX
    compiles it once per template."""
    return mx.fast.cuda_kernel(
        name="salabatch_decode_top_k",
        input_names=list(INPUTS),
        output_names=["top"],
        source=_SOURCE,
        shared_memory=shared_bytes(),
    )
