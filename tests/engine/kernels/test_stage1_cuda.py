"""Stage 1's CUDA kernels (`kernels/stage1_cuda.py`) against their MLX-op reference
(`sparse_select._pooled` off CUDA): run where MLX's CUDA backend has a GPU (`-m gpu`), skipped
elsewhere. The rest of the GPU-path tests (`test_gpu_prefill.py`: select_blocks_gpu against the
float32 reference) go through the kernels there too."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import sparse_select, stage1_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not stage1_cuda.available(), reason="needs MLX's CUDA backend and a GPU"),
]


def _inputs(B, Hk, G, t, N1, N2, dtype, seed):
    rng = np.random.default_rng(seed)
    s1 = mx.array(rng.normal(size=(B, Hk, G, t, N1)) * 3).astype(dtype)
    s2 = mx.array(rng.normal(size=(B, Hk, G, t, N2)) * 3).astype(dtype)
    seen1 = rng.integers(0, N1 + 1, size=(B, t))
    seen2 = rng.integers(0, N2 + 1, size=(B, t))
    seen1[0, 0], seen2[0, 0] = N1, N2  # every chunk seen
    seen2[-1, -1] = 0  # a query seeing no level-2 chunk scores 0
    return s1, s2, mx.array(seen1, dtype=mx.int32), mx.array(seen2, dtype=mx.int32)


def _reference(monkeypatch, *args):
    with monkeypatch.context() as m:  # `_pooled` as it runs off CUDA: its MLX ops
        m.setattr(stage1_cuda, "available", lambda: False)
        return sparse_select._pooled(*args)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    ("B", "t", "N1", "N2", "n_blocks"),
    [(1, 7, 40, 9, 10), (2, 33, 255, 63, 64), (1, 130, 2047, 511, 512)],
)
def test_pooled_scores_match_the_mlx_ops(monkeypatch, dtype, B, t, N1, N2, n_blocks):
    s1, s2, seen1, seen2 = _inputs(B, 2, 16, t, N1, N2, dtype, seed=t)
    args = (s1, s2, seen1, seen2, 0.088, n_blocks, 4)
    got = stage1_cuda.pooled_scores(*args)
    want = _reference(monkeypatch, *args)
    assert got.shape == want.shape == (B, 2, t, n_blocks) and got.dtype == mx.float32
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    assert (got[-1, :, -1] == 0).all().item()


def test_the_dispatcher_takes_the_kernels_on_cuda():
    s1, s2, seen1, seen2 = _inputs(1, 2, 16, 9, 64, 15, mx.bfloat16, seed=1)
    args = (s1, s2, seen1, seen2, 0.088, 16, 4)
    assert mx.array_equal(sparse_select._pooled(*args), stage1_cuda.pooled_scores(*args))
