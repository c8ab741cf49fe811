"""A decode step's block selection (stage 1) as one CUDA kernel (`mx.fast.cuda_kernel`) for
the GPU path's compiled step, for rows forked from shared keys: what
`sparse_decode.select_step_ref` computes with MLX ops after the shared chunks' scores (two
matmuls, kept): the rows' own chunks from their keys and their scores, the level-2
normaliser, each level-1 entry's probability summed over the G heads, the pooling into
blocks, the forced and excluded blocks and the top-k, in one launch instead of eighteen (the
own chunks' cast, sums and means, their two matmuls, two concatenations, the normaliser, the
probabilities, their head sum, the pooling's gather and max, the top-k's key, partition and
decode). A decode step's selection works on a few thousand numbers a (row, kv head): on a
GPU its time is the launches of a chain of small kernels, not their bytes (a sparse layer's
decode attention, ~31 kernels, took ~0.39 ms on an H100, where a lightning layer's 16
kernels stream 570 MB in ~0.33).

One thread block a (row, kv head), 512 threads: the own chunks (float32 sums of each half,
the mean rounded to the keys' dtype, as the cache makes them) and their scores, rounded to
q's dtype as a matmul's are; each head's level-2 log-sum-exp (a warp a head); each block's
pooled score and its top-k key, in shared memory (4 bytes a block); an exact radix select of
the k largest (key, complement of the id) pairs, eight passes of 8 bits; the chosen ids
written in ascending order (a block-wide scan), the order `decode_attention` sorts them into.

Layout (the step's, `sparse_decode._select_step`):
  q          [B, Hk, G, d]   the rows' queries (the keys' dtype)
  keys       [B, Hk, R, d]   the rows' own keys, whole buffers (positions past a row's hold
             anything: their chunks are unseen)
  s1s, s2s   [B, Hk, G, S_l] q·c for the shared chunk buffers' entries of each level (q's
             dtype, unscaled); a level's entry e is the shared buffer's e, then the own chunk
             e - S_l (R / stride_l - 1 of them), then, at level 1, one scoring 0
  numbers0, numbers1  [E_l] int32: each entry's chunk number (`step_tables`), seen where it is
             below the row's count
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
    const int S1 = dims[0], S2 = dims[1], R = dims[2], nb = dims[3], k = dims[4];
    const int Hk = dims[5], init = dims[6], local = dims[7], width = dims[8];
    const int stride1 = dims[9], stride2 = dims[10];
    const int O1 = R / stride1 - 1, O2 = R / stride2 - 1, O = O1 + O2;
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
    float* own = lse + G;                              // [G, O]: the own chunks' scores
    T* chunk = reinterpret_cast<T*>(own + G * O);      // [O1, D]: one level's own chunks
    unsigned* key = reinterpret_cast<unsigned*>(chunk + O1 * D + 2);  // [nb]

    // the own chunks of each level from the keys, then each head's score of them
    const T* kb = keys + (long long)bh * R * D;
    const T* qb = q + (long long)bh * G * D;
    for (int level = 0; level < 2; ++level) {
        const int stride = level ? stride2 : stride1, n = level ? O2 : O1;
        for (int i = tid; i < n * D; i += blockDim.x) {
            const T* x = kb + (long long)(i / D) * stride * D + i % D;
            float lo = 0.0f, hi = 0.0f;
            for (int t = 0; t < stride; ++t) {
                lo += static_cast<float>(x[t * D]);
                hi += static_cast<float>(x[(t + stride) * D]);
            }
            chunk[i] = static_cast<T>((lo + hi) / (2 * stride));
        }
        __syncthreads();
        for (int i = tid; i < G * n; i += blockDim.x) {
            const int g = i / n, e = i % n;
            float dot = 0.0f;
            for (int c = 0; c < D; ++c) {
                dot += static_cast<float>(qb[g * D + c]) * static_cast<float>(chunk[e * D + c]);
            }
            own[g * O + (level ? O1 : 0) + e] = static_cast<float>(static_cast<T>(dot));
        }
        __syncthreads();
    }

    // each head's level-2 normaliser over the entries the row sees
    for (int g = warp; g < G; g += warps) {
        const T* xs = s2s + ((long long)bh * G + g) * S2;
        const float* xo = own + g * O + O1 - S2;  // entry e >= S2: own chunk e - S2
        float m = NEG_INF;
        for (int e = lane; e < S2 + O2; e += 32) {
            if (numbers1[e] < seen2) {
                m = fmaxf(m, (e < S2 ? static_cast<float>(xs[e]) : xo[e]) * a);
            }
        }
        for (int o = 16; o > 0; o /= 2) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        }
        float s = 0.0f;
        if (m != NEG_INF) {
            for (int e = lane; e < S2 + O2; e += 32) {
                if (numbers1[e] < seen2) {
                    s += exp2f((e < S2 ? static_cast<float>(xs[e]) : xo[e]) * a - m);
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
                        const float x = e < S1
                            ? static_cast<float>(s1s[((long long)bh * G + g) * S1 + e])
                            : own[g * O + e - S1];
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

INPUTS = ("q", "keys", "s1s", "s2s", "numbers0", "numbers1", "pool", "info", "dims", "scale")
THREADS = 512  # 1,024 would leave 64 registers a thread: the float32 build needs 66
MAX_SHARED = 227 * 1024  # an H100's shared memory a thread block can have


def available() -> bool:
    """Whether the kernel may run: CUDA, and `SALABATCH_CUDA_KERNELS` names "decode"."""
    return cuda_kernel("decode")


def shared_bytes(needed: int) -> int:
    """The dynamic shared memory a launch asks for: what it needs rounded up to a power of two
    from 16 KB (at most MAX_SHARED), one kernel each (MLX sets a kernel's shared memory limit
    once, when it first loads it; a few sizes cover every context)."""
    return min(MAX_SHARED, max(16384, 1 << (needed - 1).bit_length()))


def needed_bytes(n_blocks: int, heads: int, own: int, d: int, itemsize: int, strides) -> int:
    """What a launch uses, as the source lays it out: the pass's prefix, the histogram, a
    warp's count, a normaliser a head, the own chunks' scores, one level's own chunks (the
    keys' dtype), a key a block."""
    o1, o2 = (own // s - 1 for s in strides)
    return 16 + 4 * (256 + 32 + heads + heads * (o1 + o2)) + itemsize * (o1 * d + 2) + 4 * n_blocks


def supports(n_blocks: int, heads: int, k: int, own: int, d: int, itemsize: int, strides) -> bool:
    return 0 < k <= n_blocks and needed_bytes(n_blocks, heads, own, d, itemsize, strides) <= (
        MAX_SHARED
    )


def top_k(
    qg: mx.array,
    keys: mx.array,
    shared: list[mx.array],
    tables: dict[str, mx.array],
    info: mx.array,
    compression: tuple[tuple[int, int], tuple[int, int]],
    *,
    k: int,
    scale: float,
    init: int,
    local: int,
) -> mx.array:
    """The selection of `sparse_decode._select_step` (layout above) → [B, Hk, k]."""
    B, Hk, G, d = qg.shape
    R = keys.shape[2]
    pool = tables["pool"]
    n_blocks, r1 = pool.shape
    (_, stride1), (_, stride2) = compression
    s1s, s2s = shared
    dims = [s1s.shape[-1], s2s.shape[-1], R, n_blocks, k, Hk, init, local, info.shape[1],
            stride1, stride2]  # fmt: skip
    needed = needed_bytes(n_blocks, G, R, d, keys.dtype.size, (stride1, stride2))
    (top,) = _kernel(shared_bytes(needed))(
        inputs=[qg, keys, s1s, s2s, tables["numbers0"], tables["numbers1"], pool, info,
                mx.array(dims, dtype=mx.int32), mx.array([scale], dtype=mx.float32)],
        template=[("T", keys.dtype), ("G", G), ("D", d), ("R1", r1)],
        grid=(B * Hk * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, Hk, k)],
        output_dtypes=[mx.int32],
    )  # fmt: skip
    return top


@functools.cache
def _kernel(shared: int):
    """The kernel object for `shared` bytes of dynamic shared memory, made on first use (there
    is none without a CUDA backend); MLX compiles it once per template and size."""
    return mx.fast.cuda_kernel(
        name=f"salabatch_decode_top_k_{shared}",
        input_names=list(INPUTS),
        output_names=["top"],
        source=_SOURCE,
        shared_memory=shared,
    )
