"""The decode step's selection kernel (`kernels/decode_cuda.py`) on a GPU, against its MLX-op
reference (`sparse_decode.select_from_scores_ref`) and, through `decode_attention`, the
float32 InfLLM-v2 references: run where MLX's CUDA backend has a GPU (`-m gpu`), skipped
elsewhere (its source runs on the CPU in `test_decode_emulated.py`). Off by default until
these pass on a GPU; `benchmarks/device-gpu.sh` runs them and switches it on for the timings
that follow when they do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import decode_cuda
from salabatch.engine.kernels.sparse_decode import (
    select_from_scores_ref,
    step_rows,
    step_tables,
)

ON_CUDA = (
    mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()
)
COMPRESSION = ((32, 16), (128, 64))  # the 9B's levels
BLOCK = 64


def step_case(document: int, own: int, lengths, G=16, Hk=2, dtype=mx.bfloat16, seed=0):
    """A decode step's inputs for rows forked from a `document`-token prefix, each `own`
    positions of room and at the given lengths past it: random raw scores for the shared and
    own entries of both levels, the batch's tables and the rows' info, laid out as the
    compiled step makes them (`DecodeStep.inputs`)."""
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

    def scores(level, first, n):
        """Entries first.. of the level; those a row does not see (the buffers' spare room,
        chunks not complete yet) hold garbage that would win if counted, in half the heads."""
        x = rng.normal(size=(B, Hk, G, n)) * 3
        numbers = np.array(tables[f"numbers{level}"])[first : first + n]
        unseen = numbers[None, :] >= np.array(info)[:, 3 + level, None]  # [B, n]
        x += 40 * unseen[:, None, None, :] * (np.arange(G) % 2 == 0)[:, None]
        return mx.array(x).astype(dtype)

    scores1 = (scores(0, 0, entries[0]), scores(0, entries[0], own // 16 - 1))
    scores2 = (scores(1, 0, entries[1]), scores(1, entries[1], own // 64 - 1))
    return scores1, scores2, tables, info


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize(
    ("document", "k", "local"), [(5_000, 20, 4), (40_000, 96, 32), (250_000, 96, 32)]
)
def test_the_kernel_matches_its_reference(dtype, document, k, local):
    s1, s2, tables, info = step_case(document, 192, [17, 40, 150], dtype=dtype, seed=k)
    kw = dict(k=k, scale=128**-0.5, init=1, local=local)
    got = decode_cuda.top_k(s1, s2, tables, info, **kw)
    want = mx.sort(select_from_scores_ref(s1, s2, tables, info, **kw), axis=-1)
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
