"""The decode step's product kernel (`kernels/rows_cuda.py`), its own source run on the CPU
through `cuda_emu` (a CUDA thread a fiber), against MLX's matmul: its indexing (a warp a
row of the weight, four 16-byte loads a lane, a partial last stride of the columns, spare warps
of the last thread block), float32 sums and rounding; and the dispatcher `linear.product`
taking it as on CUDA for a few rows only. Its speed and NVRTC's build are a GPU's to test
(`test_rows_cuda.py`, marked `gpu`; `test_cuda_sources.py` builds it)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from salabatch.engine import linear
from salabatch.engine.kernels import rows_cuda
from tests.engine.kernels import cuda_emu
from tests.engine.kernels.test_stage2_cuda import relative_error

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")


def rows_case(M: int, N: int, K: int, seed: int):
    x = mx.random.normal((M, K), key=mx.random.key(seed)).astype(mx.bfloat16)
    w = (mx.random.normal((N, K), key=mx.random.key(seed + 1)) * 0.05).astype(mx.bfloat16)
    return x, w


@pytest.mark.parametrize(
    ("M", "N", "K", "in_flight"),
    [(1, 19, 2048, 4), (3, 8, 1032, 4), (8, 13, 264, 4), (2, 9, 3000, 8), (1, 9, 776, 2)],
    ids=["one-row", "partial-stride", "eight-rows", "eight-in-flight", "two-in-flight"],
)
def test_the_kernel_matches_the_matmul(monkeypatch, M, N, K, in_flight):
    x, w = rows_case(M, N, K, seed=M + K)
    want = (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(mx.bfloat16)
    with cuda_emu.emulated_kernels(monkeypatch, rows_cuda) as launched:
        got = rows_cuda.product(x, w, in_flight)
        mx.eval(got)
    assert launched == ["salabatch_rows"]
    assert got.shape == (M, N) and got.dtype == mx.bfloat16
    # float32 sums in another order, each output rounded once to bf16: at most a step apart
    assert relative_error(got, want) < 4e-3
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 0.02


def test_the_dispatcher_takes_a_few_rows_only(monkeypatch):
    """`linear.product` sends up to 8 rows (any leading axes) to the kernel, more to MLX's
    matmul; a layer of the model's `Linear` and a fused projection go through it."""
    _, w = rows_case(1, 24, 64, seed=5)
    few = mx.random.normal((2, 1, 64), key=mx.random.key(6)).astype(mx.bfloat16)
    many = mx.random.normal((9, 64), key=mx.random.key(7)).astype(mx.bfloat16)
    layer = linear.Linear(64, 24, bias=False)
    layer.weight = w
    other = linear.Linear(64, 8, bias=False)
    other.weight = other.weight.astype(mx.bfloat16)
    fused = linear.Fused([layer, other])
    with cuda_emu.emulated_kernels(monkeypatch, rows_cuda) as launched:
        y_few = linear.product(few, w)
        y_many = linear.product(many, w)
        y_layer = layer(few)
        y_fused = fused.product(few, fused.arrays())
        mx.eval(y_few, y_many, y_layer, y_fused)
    assert launched == ["salabatch_rows"] * 3
    assert y_few.shape == (2, 1, 24) and y_many.shape == (9, 24) and y_fused.shape == (2, 1, 32)
    assert relative_error(y_few, few @ w.T) < 4e-3
    assert mx.array_equal(y_layer, y_few).item()
    assert relative_error(y_fused[..., :24], few @ w.T) < 4e-3
