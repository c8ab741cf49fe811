"""Stage 1's block-score kernel (`kernels/scores_cuda.py`) on a GPU, against the matmuls and the
pooling it replaces: run where MLX's CUDA backend has a GPU (`-m gpu`), skipped elsewhere (its
source runs on the CPU in `test_scores_emulated.py`). It is off by default until these pass on
a GPU; `benchmarks/device-gpu.sh` runs them and switches it on for the timings that follow when
they do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import scores_cuda
from tests.engine.kernels.test_scores_emulated import reference, scores_case, selection_case
from tests.engine.kernels.test_stage2_cuda import ON_CUDA, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")]


@pytest.mark.parametrize(
    ("B", "T", "N1", "N2", "shared"),
    [(1, 1024, 2047, 511, True), (2, 300, 8191, 2047, False)],
    ids=["32k", "128k-rows"],
)
def test_the_kernel_matches_the_matmuls_and_the_pooling_at_the_9b_shapes(B, T, N1, N2, shared):
    """2 kv heads of 16 query heads, head dim 128 (the 9B's), bf16, a 32K and a 128K context's
    chunks: against the raw scores as matmuls then `_pooled`'s MLX ops (TF32 off)."""
    q, c1, c2, seen1, seen2 = scores_case(B, 2, 16, T, 128, N1, N2, shared, seed=N1)
    scale, r = 128**-0.5, 4
    n_blocks = -(-(N1 + 1) // r)
    want = reference(q, c1, c2, seen1, seen2, scale, n_blocks, r)
    got = scores_cuda.pooled_scores(q, c1, c2, seen1, seen2, scale, n_blocks, r)
    assert relative_error(got, want) < 2e-3
    assert mx.all((got == 0) == (want == 0)).item()
    # the blocks each query would rank first agree but for near ties
    top = np.argsort(-np.array(got), axis=-1)[..., :32]
    top_want = np.argsort(-np.array(want), axis=-1)[..., :32]
    assert np.mean(np.sort(top, -1) == np.sort(top_want, -1)) > 0.98


def test_a_sparse_layer_selects_the_same_blocks_with_it(monkeypatch):
    """`select_blocks_gpu` at the 9B's settings, 2 rows of 512 queries 30K tokens in, the kernel
    on and off: the same blocks but for near ties."""
    from salabatch.engine.kernels import sparse_select

    q, c1, c2, starts, kw = selection_case(2, 2, 16, 512, 128, 30_000, seed=4)
    picked = {}
    for kernels in ("stage1", "stage1,scores"):
        monkeypatch.setenv("SALABATCH_CUDA_KERNELS", kernels)
        assert scores_cuda.available() == ("scores" in kernels)
        idx = sparse_select.select_blocks_gpu(q, c1, c2, starts, **kw)
        picked[kernels] = np.sort(np.array(idx), -1)
    assert np.mean(picked["stage1"] == picked["stage1,scores"]) > 0.99
