"""The decode step's InfLLM-v2 attention as three CUDA kernels (`mx.fast.cuda_kernel`) for the
GPU path's compiled step. A decode step's sparse layer works on a few thousand numbers a (row,
kv head): on a GPU its time is the launches of a chain of small kernels, not their bytes (its
~31 kernels of attention took ~0.39 ms on an H100, where a lightning layer's 16 kernels
stream 570 MB in ~0.33).

* `top_k`, the block selection (stage 1), for rows forked from shared keys: what
  `sparse_decode.select_step_ref` computes with MLX ops after the shared chunks' scores (two
  matmuls, kept): the rows' own chunks from their keys and their scores, the level-2
  normaliser, each level-1 entry's probability summed over the G heads, the pooling into
  blocks, the forced and excluded blocks and the top-k, in one launch instead of eighteen.
* `attend`, stage 2 (what `sparse_decode._attend_step` does with MLX ops: index arithmetic,
  four gathers, a mask and an SDPA, eleven kernels), in two launches: a warp a (row, kv head,
  split of the slots) reads each selected block in place from the shared keys or the row's
  own (`stage2_cuda.BLOCK_ATTENTION`), then the splits' sum.

The selection, a thread block of 512 threads a (row, kv head): the own chunks (float32 sums
of each half, the mean rounded to the keys' dtype, as the cache makes them) and their scores,
rounded to q's dtype as a matmul's are; each head's level-2 log-sum-exp (a warp a head); each
block's pooled score and its top-k key, in shared memory (4 bytes a block); an exact radix
select of the k largest (key, complement of the id) pairs, eight passes of 8 bits; the chosen
ids written in ascending order (a block-wide scan), the order `decode_attention` sorts them
into.

The selection's layout (the step's, `sparse_decode._select_step`):
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

On by default on CUDA (`attention.DEFAULT_CUDA_KERNELS`): their parity tests
(`tests/engine/kernels/test_decode_cuda.py`, marked `gpu`) passed on an H100 (2026-11-27), where
`bench long` decoded batch 8 at 471-486 tok/s with them against 385-405 the day before without
(batch 1 about even). `SALABATCH_CUDA_KERNELS` without `decode` switches them off.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from salabatch.engine.kernels.attention import cuda_kernel
from salabatch.engine.kernels.stage2_cuda import BLOCK_ATTENTION

_SELECT = """
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

# Stage 2, a warp a thread block: split sp of a (row, kv head)'s slots (every splits-th), each
# block read from the shared keys (ids before `first`) or the row's own and attended as the
# prefill kernel attends one (`stage2_cuda.BLOCK_ATTENTION`); the split's unnormalised output,
# max and sum → `part`.
_ATTEND = """
    constexpr int SP = BLOCK + 4, OP = D + 4;
    const float NEG_INF = __int_as_float(0xff800000);
    const int K = dims[0], R = dims[1], S = dims[2], Hk = dims[3], splits = dims[4];
    const int width = dims[5];
    const int sp = blockIdx.x % splits, bh = blockIdx.x / splits, b = bh / Hk, h = bh % Hk;
    const int lane = threadIdx.x;
    const long long qpos = info[b * width];
    const int own0 = first[0];
    const float a = scale[0] * 1.4426950408889634f;  // exp(x·scale) = 2^(x·a)

    extern __shared__ __align__(32) unsigned char smem[];
    T* Ks = reinterpret_cast<T*>(smem);
    T* Vs = Ks + BLOCK * D;
    float* Sw = reinterpret_cast<float*>(Vs + BLOCK * D);
    float* Ow = Sw + 16 * SP;
    T* Pw = reinterpret_cast<T*>(Ow + 16 * OP);

    salabatch::QueryFragments<T, D> qf;
    salabatch::load_query<T, D>(qf, q + (long long)bh * G * D, G, reinterpret_cast<T*>(Ow), Ow,
                                lane);
    float m = NEG_INF, l = 0.0f;
    for (int j = sp; j < K; j += splits) {
        const int id = idx[(long long)bh * K + j];
        if (id < 0 || (long long)id * BLOCK > qpos) {
            continue;  // no block, or one after the query (a padded slot)
        }
        const long long at = id < own0
            ? ((long long)h * S + (long long)id * BLOCK) * D
            : (((long long)b * Hk + h) * R + (long long)(id - own0) * BLOCK) * D;
        const uint4* ksrc = reinterpret_cast<const uint4*>((id < own0 ? shared_k : rows_k) + at);
        const uint4* vsrc = reinterpret_cast<const uint4*>((id < own0 ? shared_v : rows_v) + at);
        constexpr int VEC = BLOCK * D * (int)sizeof(T) / 16;
        for (int i = lane; i < VEC; i += 32) {
            reinterpret_cast<uint4*>(Ks)[i] = ksrc[i];
            reinterpret_cast<uint4*>(Vs)[i] = vsrc[i];
        }
        __syncwarp();
        salabatch::attend_block<T, D, BLOCK>(qf, Ks, Vs, Sw, Ow, Pw, (long long)id * BLOCK, qpos,
                                             a, lane, m, l);
    }
    // the split's unnormalised rows, then each row's max and sum
    const int r = lane >> 1, half = lane & 1;
    if (r < G) {
        float* out = part + (((long long)bh * splits + sp) * G + r) * (D + 2);
        for (int c = half; c < D; c += 2) {
            out[c] = Ow[r * OP + c];
        }
        if (half == 0) {
            out[D] = m;
            out[D + 1] = l;
        }
    }
"""

# The splits of each (row, head) combined: a thread an output element.
_COMBINE = """
    const float NEG_INF = __int_as_float(0xff800000);
    const int splits = dims[0], rows = dims[1];  // rows: B · Hk · G
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * D) {
        return;
    }
    const int row = i / D, c = i % D, bh = row / G, g = row % G;
    float M = NEG_INF;
    for (int s = 0; s < splits; ++s) {
        M = fmaxf(M, part[(((long long)bh * splits + s) * G + g) * (D + 2) + D]);
    }
    float L = 0.0f, o = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float* p = part + (((long long)bh * splits + s) * G + g) * (D + 2);
        if (p[D] != NEG_INF) {
            const float w = exp2f(p[D] - M);
            L += p[D + 1] * w;
            o += p[c] * w;
        }
    }
    out[i] = static_cast<T>(L > 0.0f ? o / L : 0.0f);
"""

ATTEND_INPUTS = ("q", "idx", "info", "rows_k", "rows_v", "shared_k", "shared_v", "first",
                 "dims", "scale")  # fmt: skip
SELECT_INPUTS = ("q", "keys", "s1s", "s2s", "numbers0", "numbers1", "pool", "info", "dims", "scale")
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
    (top,) = _kernel("select", shared_bytes(needed))(
        inputs=[qg, keys, s1s, s2s, tables["numbers0"], tables["numbers1"], pool, info,
                mx.array(dims, dtype=mx.int32), mx.array([scale], dtype=mx.float32)],
        template=[("T", keys.dtype), ("G", G), ("D", d), ("R1", r1)],
        grid=(B * Hk * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, Hk, k)],
        output_dtypes=[mx.int32],
    )  # fmt: skip
    return top


def attend_bytes(d: int, block: int, itemsize: int) -> int:
    """The attention kernel's dynamic shared memory: a block's keys and values, the scores and
    output (float32) and weights of 16 rows, strides padded as the source (under 48 KB at
    head dim 128 and 64-key blocks)."""
    return (
        2 * block * d * itemsize
        + 16 * (block + 4) * 4
        + 16 * (d + 4) * 4
        + 16 * (block + 8) * itemsize
    )


def splits_for(rows: int, slots: int) -> int:
    """Splits of each (row, kv head)'s slots: ~128 thread blocks in all, at most 16."""
    return max(1, min(16, slots, -(-128 // rows)))


def attend(q, idx, info, rows_kv, shared_kv, first, scale: float, block: int) -> mx.array:
    """Stage 2 of `sparse_decode._attend_step`: q [B, H, 1, d] against the blocks idx [B, Hk,
    slots] (-1: none), each from the shared keys (ids before first [1]) or the row's own,
    causal by position → [B, H, 1, d] in q's dtype. Two launches: the splits, their sum."""
    B, H, _, d = q.shape
    rows_k, rows_v = rows_kv
    Hk, R = rows_k.shape[1], rows_k.shape[2]
    G, slots = H // Hk, idx.shape[-1]
    shared_k, shared_v = shared_kv if shared_kv else rows_kv  # not read without shared keys
    S = shared_k.shape[2] if shared_kv else 0
    splits = splits_for(B * Hk, slots)
    dims = mx.array([slots, R, S, Hk, splits, info.shape[1]], dtype=mx.int32)
    template = [("T", q.dtype), ("D", d), ("G", G), ("BLOCK", block)]
    (part,) = _kernel("attend", attend_bytes(d, block, q.dtype.size))(
        inputs=[q.reshape(B, Hk, G, d), idx.astype(mx.int32), info, rows_k, rows_v, shared_k,
                shared_v, first, dims, mx.array([scale], dtype=mx.float32)],
        template=template,
        grid=(B * Hk * splits * 32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(B, Hk, splits, G, d + 2)],
        output_dtypes=[mx.float32],
    )  # fmt: skip
    n = B * H * d
    (out,) = _kernel("combine", 0)(
        inputs=[part, mx.array([splits, B * H], dtype=mx.int32)],
        template=[("T", q.dtype), ("D", d), ("G", G)],
        grid=(-(-n // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(B, H, 1, d)],
        output_dtypes=[q.dtype],
    )
    return out


@functools.cache
def _kernel(name: str, shared: int):
    """The kernel `name` ("select", "attend", "combine") for `shared` bytes of dynamic shared
    memory, made on first use (there is none without a CUDA backend); MLX compiles it once
    per template (and size: it sets a kernel's shared memory limit when it first loads it)."""
    inputs, outputs, source = {
        "select": (SELECT_INPUTS, ["top"], _SELECT),
        "attend": (ATTEND_INPUTS, ["part"], _ATTEND),
        "combine": (("part", "dims"), ["out"], _COMBINE),
    }[name]
    return mx.fast.cuda_kernel(
        name=f"salabatch_decode_{name}_{shared}",
        input_names=list(inputs),
        output_names=outputs,
        source=source,
        header=BLOCK_ATTENTION if name == "attend" else "",
        shared_memory=shared,
    )
