"""The lightning layer's prefill on a GPU rotates q and k with one rope kernel of the bf16
arrays (`attention.rotates_in_float32`) where the CPU upcasts them first: the same bits if the
GPU's rope computes in float32 and rounds once, which the tests marked `gpu` check where a GPU
is (`benchmarks/device-gpu.sh` runs them); the layer on the CPU with the switch forced on
agrees with it in float32, where the two forms are one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.bench.graph import sala_layers
from salabatch.engine.cache import LightningCache
from salabatch.engine.kernels import attention
from tests.conftest import ON_GPU

ROPE = dict(traditional=False, base=10000.0, scale=1.0)


def _lightning_prefill(dtype, rotates: bool, monkeypatch) -> tuple[mx.array, mx.array]:
    _, layer = sala_layers(dtype, hidden=128)
    x = mx.array(np.random.default_rng(0).normal(size=(1, 300, 128))).astype(dtype)
    cache = LightningCache(None)
    with monkeypatch.context() as m:
        m.setenv("SALABATCH_GPU_PATH", "1")
        m.setattr(attention, "rotates_in_float32", lambda: rotates)
        y = layer(x, cache, 40)
        mx.eval(y, cache.state)
    return y, cache.state


def test_both_rope_forms_are_one_in_float32(monkeypatch):
    a = _lightning_prefill(mx.float32, True, monkeypatch)
    b = _lightning_prefill(mx.float32, False, monkeypatch)
    assert all(mx.array_equal(p, q).item() for p, q in zip(a, b, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (Metal or CUDA)")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_gpu_rope_rounds_once(dtype):
    x = mx.array(np.random.default_rng(1).normal(size=(2, 32, 700, 128)) * 4).astype(dtype)
    for offset in (0, 8191, 262_000, mx.array([5, 100_000], dtype=mx.int32)):
        got = mx.fast.rope(x, 128, offset=offset, **ROPE)
        want = mx.fast.rope(x.astype(mx.float32), 128, offset=offset, **ROPE).astype(dtype)
        assert got.dtype == dtype and mx.array_equal(got, want).item(), f"offset {offset}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (Metal or CUDA)")
def test_gpu_lightning_prefill_is_the_upcast_one(monkeypatch):
    a = _lightning_prefill(mx.bfloat16, True, monkeypatch)
    b = _lightning_prefill(mx.bfloat16, False, monkeypatch)
    assert all(mx.array_equal(p, q).item() for p, q in zip(a, b, strict=True))
