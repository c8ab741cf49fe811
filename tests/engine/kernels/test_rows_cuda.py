"""The decode step's product kernel (`kernels/rows_cuda.py`) on a GPU, against MLX's matmul it
replaces: run where MLX's CUDA backend has a GPU (`-m gpu`), skipped elsewhere (its source runs
on the CPU in `test_rows_emulated.py`). Off by default until these pass on a GPU and it wins
there; `benchmarks/device-gpu.sh` runs them and switches it on for the timings that follow when
they do."""

from __future__ import annotations

import mlx.core as mx
import pytest

from salabatch.engine.kernels import rows_cuda
from tests.engine.kernels.test_norm_cuda import assert_step_as_close_with
from tests.engine.kernels.test_stage2_cuda import ON_CUDA, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    ("M", "N", "K"),
    [(1, 32768, 4096), (8, 4096, 16384), (3, 73448, 4096)],
    ids=["gate-up", "down-batch-8", "head"],
)
def test_the_kernel_matches_the_matmul_at_the_9b_shapes(dtype, M, N, K):
    x = mx.random.normal((M, 1, K), key=mx.random.key(M)).astype(dtype)
    w = (mx.random.normal((N, K), key=mx.random.key(K)) * 0.02).astype(dtype)
    got = rows_cuda.product(x, w)
    want = x.astype(mx.float32) @ w.astype(mx.float32).T
    assert got.shape == (M, 1, N) and got.dtype == dtype
    assert relative_error(got, want) < 4e-3  # each output rounded once: ~2e-3
    assert relative_error(x @ w.T, want) < 4e-3  # as MLX's own product


def test_a_decode_step_gives_the_same_tokens_with_it(monkeypatch):
    assert_step_as_close_with(monkeypatch, "stage1,decode", "stage1,decode,rows")
