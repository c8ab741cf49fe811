"""Gated activations, one dispatcher each: `silu_mul(g, u)` = silu(g)·u, the MLP's SwiGLU, and
`sigmoid_mul(x, z)` = x·σ(z), the output gate of both attention kinds.

MLX's CPU backend takes ~12 ns an element for the exp inside σ: at a decode batch of 8 the
MLP's silu alone was ~0.8 ms of a step, and ~5 % of a long prefill. On the CPU, for float32,
both run as one native primitive (salabatch/engine/native/gates.cpp, σ from a vectorised 2^x,
relative error ~3e-7); the MLX-op forms below are its reference in the tests and, compiled
into one kernel each, what a GPU, other dtypes and an unbuilt module run. Both are
differentiable either way."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.kernels import native
from salabatch.engine.kernels.attention import on_gpu


def silu_mul(g: mx.array, u: mx.array) -> mx.array:
    if _runs_native(g, u):
        return native.gate(g, u, silu=True)
    return _silu_mul(g, u)


def sigmoid_mul(x: mx.array, z: mx.array) -> mx.array:
    if _runs_native(z, x):
        return native.gate(z, x, silu=False)
    return _sigmoid_mul(x, z)


def silu_mul_ref(g: mx.array, u: mx.array) -> mx.array:
    return nn.silu(g) * u


def sigmoid_mul_ref(x: mx.array, z: mx.array) -> mx.array:
    return x * mx.sigmoid(z)


# Elsewhere the MLX-op forms run compiled, one kernel each (a GPU's prefill ran σ and the
# product as two passes over [chunk, hidden]); inside the compiled decode step they fuse anyway.
_silu_mul = mx.compile(silu_mul_ref, shapeless=True)
_sigmoid_mul = mx.compile(sigmoid_mul_ref, shapeless=True)


def _runs_native(z: mx.array, x: mx.array) -> bool:
    if on_gpu() or native.missing() or z.shape != x.shape:
        return False
    return z.dtype == x.dtype == mx.float32
