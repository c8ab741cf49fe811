"""The decode step's product kernel (`kernels/rows_cuda.py`) on a GPU, against MLX's matmul it
replaces: run where MLX's CUDA backend has a GPU (`-m gpu`), skipped elsewhere (its source runs
on the CPU in `test_rows_emulated.py`). Off by default until these pass on a GPU and it wins
there; `benchmarks/device-gpu.sh` runs them and switches it on for the timings that follow when
they do."""

from __future__ import annotations

import mlx.core as mx
import pytest

from salabatch.engine.kernels import rows_cuda
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
    """The compiled decode step of a model at the 9B's layout (small width, bf16), 4 rows forked
    from a 4K document of zeros, the kernel on and off, against the float32 model of the same
    weights: as close to it with the kernel as without, and the same greedy tokens but for near
    ties."""
    from salabatch.bench.graph import filled_model_cache, sala_model
    from salabatch.engine.decode import DecodeStep, decode

    ids = mx.array([3, 77, 1000, 5], dtype=mx.int32)
    logits = {}
    for name, dtype, kernels in (
        ("ops", mx.bfloat16, "stage1,decode"),
        ("kernel", mx.bfloat16, "stage1,decode,rows"),
        ("float32", mx.float32, "stage1"),
    ):
        monkeypatch.setenv("SALABATCH_CUDA_KERNELS", kernels)
        model = sala_model(dtype)
        model.decoder = DecodeStep(model)
        cache = filled_model_cache(model, 4096).fork(4)
        logits[name] = decode(model, ids, cache).astype(mx.float32)
        mx.eval(logits[name])
    exact = logits["float32"]
    assert relative_error(logits["kernel"], exact) < 1.25 * relative_error(logits["ops"], exact)
    got, want = logits["kernel"], logits["ops"]
    chosen = mx.take_along_axis(want, got.argmax(-1)[:, None], axis=-1)[:, 0]
    assert mx.all(want.max(-1) - chosen <= 1e-2 * mx.abs(want).max(-1)).item()
