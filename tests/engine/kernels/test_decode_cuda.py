"""The decode step's selection kernel (`kernels/decode_cuda.py`) on a GPU, against its MLX-op
reference (`sparse_decode.select_step_ref`) and, through `decode_attention`, the
float32 InfLLM-v2 references: run where MLX's CUDA backend has a GPU (`-m gpu`), skipped
elsewhere (its source runs on the CPU in `test_decode_emulated.py`). Off by default until
these pass on a GPU; `benchmarks/device-gpu.sh` runs them and switches it on for the timings
that follow when they do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import decode_cuda
from salabatch.engine.kernels.sparse_attention import KVView, block_sparse_attention_ref
from salabatch.engine.kernels.sparse_decode import select_step_ref, step_rows, step_tables
from tests.engine.kernels.test_stage2_cuda import relative_error

ON_CUDA = (
    mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()
)
COMPRESSION = ((32, 16), (128, 64))  # the 9B's levels
BLOCK = 64


def step_case(document: int, own: int, lengths, G=16, Hk=2, d=128, dtype=mx.bfloat16, seed=0):
    """A decode step's inputs for rows forked from a `document`-token prefix, each with `own`
    positions of room, at the given lengths past it, laid out as the compiled step makes them
    (`DecodeStep.inputs`): queries qg [B, Hk, G, d], the rows' own keys [B, Hk, own, d], the
    shared chunk buffers of both levels, the batch's tables and the rows' info. What a row
    does not see holds garbage that would win if counted (keys along the row's first query
    head): the chunk buffers past their counts, the own keys past each row's length."""
    rng = np.random.default_rng(seed)
    counts = tuple((document - size) // stride + 1 for size, stride in COMPRESSION)
    start = COMPRESSION[1][1] * counts[1]
    entries = tuple(-(-c // 64) * 64 for c in counts)  # the chunk buffers' capacities
    shared_keys = -(-document // 4096) * 4096
    n_blocks = (own + shared_keys) // BLOCK
    tables = step_tables(start, counts, entries, own, n_blocks, BLOCK, COMPRESSION)
    positions = [document + n - 1 for n in lengths]
    info = step_rows(positions, start, BLOCK, [s for _, s in COMPRESSION])
    B = len(lengths)
    qg = rng.normal(size=(B, Hk, G, d))
    chunks = []
    for level, (size, _) in enumerate(COMPRESSION):  # means of `size` keys, as own chunks are
        c = rng.normal(size=(1, Hk, entries[level], d)) / np.sqrt(size)
        c[0, :, counts[level] :] = 8 * qg[0, :, :1]
        chunks.append(mx.array(c).astype(dtype))
    keys = rng.normal(size=(B, Hk, own, d))
    for b, n in enumerate(lengths):
        keys[b, :, document - start + n :] = 8 * qg[b, :, :1]
    return mx.array(qg).astype(dtype), mx.array(keys).astype(dtype), chunks, tables, info


def shared_scores(qg, chunks):
    """The shared chunks' scores, as `sparse_decode._select_step` makes them for the kernel."""
    return [qg @ c.swapaxes(-1, -2) for c in chunks]


def attend_case(start, lengths, K=8, G=16, Hk=2, d=128, dtype=mx.bfloat16, seed=0):
    """Rows forked at `start` (a multiple of the block) from shared keys [1, Hk, S, d], each
    with its own keys [B, Hk, R, d] after it, at the given lengths past `start`; each row's
    slots: its own block, blocks from the shared part and its own, -1 for the rest, in any
    order."""
    rng = np.random.default_rng(seed)
    S, R = max(start, BLOCK) + 4 * BLOCK, 4 * BLOCK * (1 + max(lengths) // (4 * BLOCK))
    B = len(lengths)
    shared = [mx.array(rng.normal(size=(1, Hk, S, d))).astype(dtype) for _ in range(2)]
    rows = [mx.array(rng.normal(size=(B, Hk, R, d))).astype(dtype) for _ in range(2)]
    q = mx.array(rng.normal(size=(B, Hk * G, 1, d)) * 2).astype(dtype)
    positions = [start + n - 1 for n in lengths]
    idx = np.full((B, Hk, K), -1, dtype=np.int32)
    for b, pos in enumerate(positions):
        for h in range(Hk):
            own = pos // BLOCK
            others = rng.choice(own, size=min(K - 2, own), replace=False)
            chosen = np.array([own, *others], dtype=np.int32)
            idx[b, h, : len(chosen)] = rng.permutation(chosen)
    return q, rows, shared, positions, mx.array(idx)


def attend_reference(q, rows, shared, positions, idx, start):
    """The float32 InfLLM-v2 stage 2 of `attend_case`'s rows (shared keys only where forked)."""
    f32 = [a.astype(mx.float32) for a in (*shared, *rows)]
    lengths = tuple(p + 1 for p in positions)
    kv = (
        KVView(*f32[:2], start, *f32[2:], lengths)
        if start
        else KVView(None, None, 0, *f32[2:], lengths)
    )
    d = q.shape[-1]
    return block_sparse_attention_ref(
        q.astype(mx.float32), kv, idx[:, :, None], positions, d**-0.5, BLOCK
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize(
    ("document", "k", "local"), [(5_000, 20, 4), (40_000, 96, 32), (250_000, 96, 32)]
)
def test_the_kernel_matches_its_reference(dtype, document, k, local):
    qg, keys, chunks, tables, info = step_case(document, 192, [17, 40, 150], dtype=dtype, seed=k)
    kw = dict(k=k, scale=128**-0.5, init=1, local=local)
    got = decode_cuda.top_k(qg, keys, shared_scores(qg, chunks), tables, info, COMPRESSION, **kw)
    want = mx.sort(select_step_ref(qg, keys, chunks, tables, info, COMPRESSION, **kw), axis=-1)
    assert mx.array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dense_len", [0, 1150, 1 << 20], ids=["sparse", "mixed", "dense"])
@pytest.mark.parametrize("shared", [False, True], ids=["own rows", "shared keys"])
def test_the_decode_step_with_it_matches_the_references(monkeypatch, shared, dense_len):
    from tests.engine.kernels import test_sparse_kernels

    monkeypatch.setenv("SALABATCH_CUDA_KERNELS", "stage1,decode")
    assert decode_cuda.available()
    test_sparse_kernels.test_gpu_decode_step_matches_the_references(shared, dense_len)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    ("start", "lengths", "K"),
    [(1_024, [1, 70, 200], 8), (0, [300, 90], 6), (4_096, [17], 96), (8_192, [5] * 8, 96)],
    ids=["forked", "own-keys-only", "9b-slots", "batch-8"],
)
def test_the_attention_kernels_match_the_reference(dtype, start, lengths, K):
    q, rows, shared, positions, idx = attend_case(start, lengths, K=K, dtype=dtype, seed=K)
    info = mx.array([[p, p - start] for p in positions], dtype=mx.int32)
    first = mx.array([start // BLOCK], dtype=mx.int32)
    got = decode_cuda.attend(q, idx, info, rows, shared if start else (), first,
                             q.shape[-1] ** -0.5, BLOCK)  # fmt: skip
    want = attend_reference(q, rows, shared, positions, idx, start)
    assert got.dtype == dtype
    assert relative_error(got, want) < 6e-3
