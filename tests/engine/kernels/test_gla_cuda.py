"""The lightning layer's CUDA kernels (`kernels/gla_cuda.py`) on a GPU, against the float32
chunked form and the MLX-op GPU form it would replace: run where MLX's CUDA backend has a GPU
(`-m gpu`), skipped elsewhere (its source runs on the CPU in `test_gla_emulated.py`). It is off
by default until these pass on a GPU; `benchmarks/device-gpu.sh` runs them and switches it on
for the timings that follow when they do."""

from __future__ import annotations

import mlx.core as mx
import pytest

from salabatch.bench.graph import sala_layers
from salabatch.engine.cache import LightningCache
from salabatch.engine.kernels import gla_cuda
from salabatch.engine.kernels.gla import gla_parallel
from tests.engine.kernels.test_gla_emulated import lightning_case, reference
from tests.engine.kernels.test_stage2_cuda import ON_CUDA, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")]


@pytest.mark.parametrize(
    ("dtype", "T", "state", "out"),
    [
        (mx.bfloat16, 8192 + 37, True, mx.bfloat16),
        (mx.bfloat16, 8192, False, mx.bfloat16),
        (mx.float16, 300, True, mx.float32),
    ],
)
def test_the_kernel_matches_the_references_at_the_9b_shapes(dtype, T, state, out):
    """32 heads of dim 128 (the 9B's lightning layer), an 8K chunk with a partial last chunk of
    the recurrence, from a state or zeros: against the float32 chunked form, and as close to
    the MLX-op GPU form (`gla_parallel`) as that is to it."""
    q, k, v, g, S = lightning_case(1, 32, T, 128, seed=T, state=state, dtype=dtype)
    scale = 128**-0.5
    o, final = gla_cuda.gla(q, k, v, g, scale, S, out)
    want_o, want_S = reference(q, k, v, g, scale, S)
    ops_o, ops_S = gla_parallel(q, k, v, g, scale, S, out_dtype=out)
    tolerance = 4e-3 if out != mx.float32 else 2e-3
    assert relative_error(o, want_o) < tolerance
    assert relative_error(final, want_S) < 2e-3
    assert relative_error(o, ops_o) < tolerance
    assert relative_error(final, ops_S) < 2e-3


def test_a_lightning_layer_prefills_alike_with_and_without_it(monkeypatch):
    """The 9B's lightning layer (bf16) over 700 tokens then 300 more, the kernel on and off:
    its outputs and state agree to bf16's rounding."""
    _, layer = sala_layers(mx.bfloat16)
    x = mx.random.normal((1, 1000, layer.q_proj.weight.shape[1]), key=mx.random.key(2))
    x = (x * 0.5).astype(mx.bfloat16)

    def prefill(kernels: str):
        monkeypatch.setenv("SALABATCH_CUDA_KERNELS", kernels)
        assert gla_cuda.available() == (kernels == "gla")
        cache = LightningCache(None)
        y1 = layer(x[:, :700], cache, 0)
        y2 = layer(x[:, 700:], cache, 700)
        mx.eval(y1, y2, cache.state)
        return mx.concatenate([y1, y2], axis=1), cache.state

    y_ops, s_ops = prefill("none")
    y_kernel, s_kernel = prefill("gla")
    assert relative_error(y_kernel, y_ops) < 1e-2
    assert relative_error(s_kernel, s_ops) < 2e-3


@pytest.mark.parametrize("rows", [1, 8])
def test_the_decode_step_kernel_matches_its_mlx_ops_at_the_9b_shapes(rows):
    """The 9B's lightning layer (32 heads of 128, bf16) one decode step from a random state,
    rows up to ~175K tokens in: the kernel against `_step_ops` (both before o_norm). The
    kernel follows MLX's CUDA rope formula; that far in, a float32 angle's last bits (~0.01
    radian) may still differ with the math library's cos and sin: the state to ~1e-4."""
    from tests.engine.kernels.test_gla_emulated import small_layer

    layer = small_layer(32, 32, 128, seed=3)
    x = mx.random.normal((rows, 1, 64), key=mx.random.key(5)).astype(mx.bfloat16)
    state = mx.random.normal((rows, 32, 128, 128), key=mx.random.key(6))
    pos = mx.array([7 + 25_000 * i for i in range(rows)], dtype=mx.int32)
    y = layer.fused.product(x, layer.fused.arrays())
    want_o, want_s = layer._step_ops(y[..., : 64 * 128], y[..., 64 * 128 : 96 * 128], pos, state)
    o, s = gla_cuda.step(
        y, (layer.q_norm.weight, layer.k_norm.weight), pos, layer._decay, state, heads=32,
        kv_heads=32, d=128, scale=layer.scale, eps=layer.eps, rope_base=layer.rope_theta,
    )  # fmt: skip
    assert relative_error(o, want_o) < 1e-2
    assert relative_error(s, want_s) < 1e-3
