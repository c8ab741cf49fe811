"""The lightning layer's CUDA kernels (`kernels/gla_cuda.py`), their own sources run on the CPU
through `cuda_emu` (a CUDA thread a fiber; WMMA as whole matrices, TF32 operands cut to
their 19 bits): the prefill's three (each chunk's own state, the scan across the chunks, each
chunk's outputs) against the float32 chunked form `gla_chunked` (decays, causal mask, partial
last chunk, state in and out, synchronisation), and the dispatcher `gla.gla` taking them as on
CUDA; the decode step's against its MLX ops. Their speed, the real tensor cores and NVRTC's
build are a GPU's to test (`test_gla_cuda.py`, marked `gpu`; `test_cuda_sources.py` builds
them)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import gla_cuda
from salabatch.engine.kernels.gla import gla, gla_chunked
from tests.engine.kernels import cuda_emu
from tests.engine.kernels.test_stage2_cuda import relative_error

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")

# a prefill call's launches: the chunks' own states, the scan over them, the outputs
PREFILL = ["salabatch_gla_states", "salabatch_gla_scan", "salabatch_gla_out"]


def lightning_case(B, H, T, d, seed, state=True, dtype=mx.bfloat16):
    """q, k, v [B, H, T, d] in `dtype`, log-decays from slow to fast, a random state or None."""
    rng = np.random.default_rng(seed)
    q, k, v = (mx.array(rng.normal(size=(B, H, T, d)) * 0.5).astype(dtype) for _ in range(3))
    g = mx.array(-np.geomspace(0.002, 0.7, H), dtype=mx.float32)
    S = mx.array(rng.normal(size=(B, H, d, d)), dtype=mx.float32) if state else None
    return q, k, v, g, S


def reference(q, k, v, g, scale, S):
    """The float32 chunked form on the same (rounded) inputs."""
    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    return gla_chunked(*f32, g, scale, S)


@pytest.mark.parametrize(
    ("B", "H", "T", "d", "state", "out"),
    [
        (2, 2, 150, 64, False, mx.bfloat16),  # two whole chunks and 22 tokens, from zeros
        (1, 3, 64, 32, True, mx.float32),  # one whole chunk, a state given, float32 out
        (1, 1, 5, 128, True, mx.bfloat16),  # fewer tokens than a chunk, the 9B's head dim
    ],
    ids=["partial-last", "one-chunk", "short"],
)
def test_the_kernel_matches_the_float32_chunked_form(monkeypatch, B, H, T, d, state, out):
    q, k, v, g, S = lightning_case(B, H, T, d, seed=T + d, state=state)
    scale = d**-0.5
    with cuda_emu.emulated_kernels(monkeypatch, gla_cuda) as launched:
        o, final = gla_cuda.gla(q, k, v, g, scale, S, out)
        mx.eval(o, final)
    assert launched == PREFILL
    want_o, want_S = reference(q, k, v, g, scale, S)
    assert o.shape == (B, H, T, d) and o.dtype == out and final.dtype == mx.float32
    # TF32 operands (~5e-4 each), and o rounded once to bf16 (~2e-3)
    assert relative_error(o, want_o) < (4e-3 if out == mx.bfloat16 else 2e-3)
    assert relative_error(final, want_S) < 2e-3


def test_the_dispatcher_takes_it_on_cuda_and_chains_calls(monkeypatch):
    """`gla.gla` on the GPU path with the kernel on: two calls (a prefill's chunks), the second
    from the first's state, as one call over both; float32 inputs stay on the MLX-op form."""
    q, k, v, g, _ = lightning_case(1, 2, 200, 32, seed=7, state=False)
    scale = 32**-0.5
    with cuda_emu.emulated_kernels(monkeypatch, gla_cuda) as launched:
        o1, S1 = gla(q[:, :, :70], k[:, :, :70], v[:, :, :70], g, scale, None, mx.bfloat16)
        o2, S2 = gla(q[:, :, 70:], k[:, :, 70:], v[:, :, 70:], g, scale, S1, mx.bfloat16)
        mx.eval(o1, o2, S2)
        assert launched == PREFILL * 2
        f32 = [a.astype(mx.float32) for a in (q, k, v)]
        gla(*f32, g, scale, None, mx.float32)
        assert launched == PREFILL * 2
    want_o, want_S = reference(q, k, v, g, scale, None)
    assert relative_error(mx.concatenate([o1, o2], axis=2), want_o) < 4e-3
    assert relative_error(S2, want_S) < 2e-3


def test_a_lightning_layer_prefills_through_it_as_through_the_mlx_ops(monkeypatch):
    """A small lightning layer (bf16, 2 heads of dim 32 sharing one kv head) over 150 tokens
    then 50 more on the GPU path: with the kernel (emulated) as with `gla_parallel`, its
    output to bf16's rounding and its state closer."""
    from salabatch.bench.long import random_init
    from salabatch.demo.checkpoint import sala_config
    from salabatch.engine.cache import LightningCache
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.lightning import LightningAttention

    raw = sala_config(vocab=64, hidden=64, intermediate=64, layers=2, sparse_layers=(0,),
                      heads=2, kv_heads=1, head_dim=32)  # fmt: skip
    layer = random_init(LightningAttention(ModelConfig.from_dict(raw)), mx.bfloat16, seed=1)
    x = (mx.random.normal((1, 200, 64), key=mx.random.key(4)) * 0.5).astype(mx.bfloat16)

    def prefill():
        cache = LightningCache(None)
        y = mx.concatenate([layer(x[:, :150], cache, 0), layer(x[:, 150:], cache, 150)], axis=1)
        mx.eval(y, cache.state)
        return y, cache.state

    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    y_ops, s_ops = prefill()
    with cuda_emu.emulated_kernels(monkeypatch, gla_cuda) as launched:
        y, s = prefill()
    assert launched == PREFILL * 2
    assert relative_error(y, y_ops) < 1e-2
    assert relative_error(s, s_ops) < 2e-3


def small_layer(heads: int, kv_heads: int, d: int, seed: int):
    """A lightning layer of `kv_heads` shared by its heads (bf16, random weights and norms, its
    projections fused as for the decode step)."""
    from salabatch.bench.long import random_init
    from salabatch.demo.checkpoint import sala_config
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.lightning import LightningAttention

    raw = sala_config(vocab=64, hidden=64, intermediate=64, layers=2, sparse_layers=(0,),
                      heads=heads, kv_heads=kv_heads, head_dim=d)  # fmt: skip
    raw["lightning_nkv"] = kv_heads
    layer = random_init(LightningAttention(ModelConfig.from_dict(raw)), mx.bfloat16, seed=seed)
    for i, norm in enumerate((layer.q_norm, layer.k_norm)):
        norm.weight = mx.random.uniform(0.5, 1.5, (d,), key=mx.random.key(seed + i))
        norm.weight = norm.weight.astype(mx.bfloat16)
    layer.fuse()
    return layer


@pytest.mark.parametrize(
    ("positions", "state_error"),
    [([5, 10, 20], 1e-5), ([5, 1000, 70_001], 1e-3)],
    ids=["near", "far"],
)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 4, 32), (4, 2, 128)])
def test_the_decode_step_kernel_matches_its_mlx_ops(
    monkeypatch, heads, kv_heads, d, positions, state_error
):
    """A lightning layer's decode step for 3 rows, from a random state: the kernel (emulated)
    on the fused projection's output against `_step_ops` on its q, k, v (both before o_norm,
    which would hide a scale), the output to bf16's rounding and the state to float32's. Far
    from the start the rotation angles (~70K radians) differ in their float32 rounding
    between MLX's CPU rope and the CUDA formula the kernel follows (MLX's: θ = pos ·
    2^(−(i / (d/2)) · log2 base)): there the state agrees to ~1e-4. Then the layer's step
    (the dispatcher) launches it."""
    layer = small_layer(heads, kv_heads, d, seed=heads + d)
    rng = np.random.default_rng(d)
    x = mx.array(rng.normal(size=(3, 1, 64))).astype(mx.bfloat16)
    state = mx.array(rng.normal(size=(3, heads, d, d)), dtype=mx.float32)
    pos = mx.array(positions, dtype=mx.int32)
    weights = layer.fused.arrays()
    y = layer.fused.product(x, weights)
    qk, v = (
        y[..., : (heads + kv_heads) * d],
        y[..., (heads + kv_heads) * d : (heads + 2 * kv_heads) * d],
    )
    want_o, want_s = layer._step_ops(qk, v, pos, state)
    mx.eval(want_o, want_s)
    with cuda_emu.emulated_kernels(monkeypatch, gla_cuda) as launched:
        o, s = gla_cuda.step(
            y, (layer.q_norm.weight, layer.k_norm.weight), pos, layer._decay, state,
            heads=heads, kv_heads=kv_heads, d=d, scale=layer.scale, eps=layer.eps,
            rope_base=layer.rope_theta,
        )  # fmt: skip
        mx.eval(o, s)
        assert o.shape == want_o.shape and o.dtype == want_o.dtype and s.shape == want_s.shape
        assert relative_error(o, want_o) < 1e-2
        assert relative_error(s, want_s) < state_error
        gated, s2 = layer.step(x, state, pos, weights)
        mx.eval(gated, s2)
    assert launched == ["salabatch_gla_step"] * 2
    assert mx.array_equal(s2, s).item()
