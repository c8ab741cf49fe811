"""The gated activations' native CPU form (salabatch/engine/native/gates.cpp) against the MLX-op
references: values, special values, thread counts, gradients and which inputs take it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import gates, native

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=str(native.missing()))

FORMS = {
    "silu": (lambda z, x: gates.silu_mul(z, x), gates.silu_mul_ref),
    "sigmoid": (lambda z, x: gates.sigmoid_mul(x, z), lambda z, x: gates.sigmoid_mul_ref(x, z)),
}


def pair(shape, seed, spread=6.0):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal(shape) * spread).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    return mx.array(z), mx.array(x)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (3, 1, 1027), (2, 40, 1024)])
def test_native_matches_the_reference(form, shape):
    fast, ref = FORMS[form]
    z, x = pair(shape, seed=len(shape) + shape[-1])
    got, want = np.array(fast(z, x)), np.array(ref(z, x))
    assert got.shape == want.shape
    # relative to the values, down to where the reference reaches float32's subnormals
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("form", FORMS)
def test_special_values_as_the_reference(form):
    fast, ref = FORMS[form]
    z = mx.array([0.0, -0.0, 1e-30, 30.0, -30.0, 87.0, -87.0, 200.0, -200.0, mx.inf, -mx.inf])
    z = mx.concatenate([z, mx.array([mx.nan])])
    x = mx.full(z.shape, 1.5)
    got, want = np.array(fast(z, x)), np.array(ref(z, x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)  # NaN where the reference has


def test_long_inputs_split_between_threads_give_the_same_bits():
    z, x = pair((5, 70001), seed=3)  # several spans, an uneven last one
    for silu in (False, True):
        one = native.gate(z, x, silu=silu, n_threads=1)
        for n in (2, 3):
            assert mx.array_equal(native.gate(z, x, silu=silu, n_threads=n), one).item()


@pytest.mark.parametrize("form", FORMS)
def test_gradients_match_the_reference(form):
    fast, ref = FORMS[form]
    z, x = pair((4, 300), seed=5, spread=3.0)
    cot = mx.array(np.random.default_rng(6).standard_normal((4, 300)).astype(np.float32))

    def loss(f):
        return lambda z, x: (f(z, x) * cot).sum()

    got = mx.grad(loss(fast), argnums=(0, 1))(z, x)
    want = mx.grad(loss(ref), argnums=(0, 1))(z, x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6)


def test_only_float32_of_one_shape_goes_native(monkeypatch):
    calls = []
    real = native.gate

    def counted(z, x, **kwargs):
        calls.append(z.dtype)
        return real(z, x, **kwargs)

    monkeypatch.setattr(native, "gate", counted)
    z, x = pair((2, 16), seed=7)
    mx.eval(gates.silu_mul(z, x), gates.sigmoid_mul(x, z))
    assert calls == [mx.float32, mx.float32]
    mx.eval(gates.silu_mul(z.astype(mx.bfloat16), x.astype(mx.bfloat16)))
    mx.eval(gates.sigmoid_mul(x, z[:1]))  # broadcast: the MLX ops
    assert calls == [mx.float32, mx.float32]
