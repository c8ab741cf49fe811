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
from salabatch.engine.kernels.sparse_decode import select_step_ref, step_rows, step_tables

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
