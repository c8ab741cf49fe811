"""The model's Linear: the native product of a few rows against mx.matmul (values and
gradients), and which inputs take it; a decode step's residual products (`add_product`)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from salabatch.bench.graph import nodes
from salabatch.engine.kernels import attention, native
from salabatch.engine.linear import Linear, add_product

needs_native = pytest.mark.skipif(native.missing() is not None, reason=str(native.missing()))
# A product against MLX's, by the dtype of both: float32 sums in another order (~1e-6 of values
# near 5-10); bf16's rounding of sums near 1-2.
TOL = {mx.float32: {"rtol": 1e-5, "atol": 1e-4}, mx.bfloat16: {"rtol": 0.0, "atol": 3e-2}}
# float32 results of small sums (gradients, a product added to a residual), absolute
TOL_ABS = 1e-5


def arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal(s).astype(np.float32)) for s in shapes]


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17])
@pytest.mark.parametrize("out_dim", [1, 4, 37])
@pytest.mark.parametrize("in_dim", [8, 264])
def test_rows_matmul_matches_matmul(rows, out_dim, in_dim):
    x, w = arrays((rows, in_dim), (out_dim, in_dim), seed=rows * out_dim + in_dim)
    with mx.stream(mx.cpu):
        got = native.rows_matmul(x, w)
        want = x @ w.T
    assert got.shape == (rows, out_dim)
    assert mx.allclose(got, want, **TOL[mx.float32]).item()


@needs_native
@pytest.mark.parametrize("rows", [1, 8])
def test_rows_matmul_split_over_threads_gives_the_same_bits(rows):
    """A weight large enough to be split between threads (131072+ floats), split unevenly."""
    x, w = arrays((rows, 256), (1001, 256), seed=rows)
    with mx.stream(mx.cpu):
        one = native.rows_matmul(x, w, n_threads=1)
        assert mx.allclose(one, x @ w.T, **TOL[mx.float32]).item()
        for n in (2, 3, 7):
            assert mx.array_equal(native.rows_matmul(x, w, n_threads=n), one).item()


@needs_native
def test_rows_matmul_reads_strided_inputs():
    x, w = arrays((16, 64), (24, 32), seed=3)
    with mx.stream(mx.cpu):
        got = native.rows_matmul(x[::2, ::2], w[:, :32])
        want = x[::2, ::2] @ w[:, :32].T
    assert mx.allclose(got, want, **TOL[mx.float32]).item()


@needs_native
def test_gradients_match_nn_linear():
    """Training through a layer that took the native path: the same gradients as nn.Linear."""
    x, w, g = arrays((4, 1, 32), (24, 32), (4, 1, 24), seed=5)
    mine, plain = Linear(32, 24, bias=False), nn.Linear(32, 24, bias=False)
    mine.weight = plain.weight = w

    def loss(layer, x):
        return (layer(x) * g).sum()

    with mx.stream(mx.cpu):
        got = mx.grad(loss, argnums=(0, 1))(mine, x)
        want = mx.grad(loss, argnums=(0, 1))(plain, x)
    assert mx.allclose(got[1], want[1], atol=TOL_ABS).item()
    assert mx.allclose(got[0]["weight"], want[0]["weight"], atol=TOL_ABS).item()


BIG = 1 << 17  # the split size of the real module: this test's weight (24 x 32) is under it


@pytest.mark.parametrize(
    "shape, dtype, split, native_path",
    [
        ((8, 1, 32), mx.float32, BIG, True),  # a decode batch
        ((2, 32), mx.float32, BIG, True),
        ((1, 1, 32), mx.float32, BIG, False),  # one row of a small weight: BLAS's product
        ((1, 1, 32), mx.float32, 24 * 32, True),  # one row of a weight the threads split
        ((8, 5, 32), mx.float32, BIG, True),  # a verify pass: 8 rows of 1 + 4 drafts
        ((4, 64, 32), mx.float32, BIG, False),  # 256 rows: a prefill chunk
        ((8, 1, 32), mx.bfloat16, BIG, False),
    ],
)
@needs_native
def test_which_inputs_take_the_native_product(shape, dtype, split, native_path, monkeypatch):
    calls = []
    real = native.rows_matmul
    monkeypatch.setattr(native, "rows_matmul", lambda x, w: calls.append(x.shape) or real(x, w))
    monkeypatch.setattr(native, "split_floats", lambda: split)
    mx.random.seed(3)  # the layer's initial weights: the same whatever ran before
    layer = Linear(32, 24, bias=True)
    x = arrays(shape, seed=1)[0].astype(dtype)
    layer.set_dtype(dtype)
    with mx.stream(mx.cpu):
        got = layer(x)
        want = x @ layer.weight.T + layer.bias
    assert bool(calls) == native_path
    assert got.shape == (*shape[:-1], 24)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), **TOL[dtype]).item()


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("kind", ["plain", "bias", "quantized"])
def test_add_product_is_the_residual_add_of_a_product(kind, cuda, monkeypatch):
    """h + scale · layer(x) whichever way it runs: one addmm (a float layer without bias, but
    on CUDA where `split_on_cuda` asks), or the product then the add."""
    monkeypatch.setattr(attention, "on_cuda", lambda: cuda)
    mx.random.seed(5)
    layer = nn.Linear(64, 32, bias=kind == "bias")
    if kind == "quantized":
        layer = nn.QuantizedLinear.from_linear(layer, group_size=32, bits=8)
    mx.eval(layer.parameters())
    h, x = arrays((3, 1, 32), (3, 1, 64), seed=2)
    with mx.stream(mx.cpu):
        want = h + 0.7 * layer(x)
        for split in (False, True):
            got = add_product(h, layer, x, 0.7, split_on_cuda=split)
            ops = nodes(got)  # before it is evaluated
            assert mx.allclose(got, want, atol=TOL_ABS).item(), (kind, cuda, split)
            one_addmm = kind == "plain" and not (split and cuda)
            assert ("Add" not in ops) == one_addmm, ops


def test_a_tied_head_is_the_embeddings_product_plain_or_quantized():
    """With tied embeddings the head is the embedding's product (`linear.product` for a float
    one), and a quantized embedding keeps its own quantized product."""
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.model import Model
    from tests.tiny import tiny_config_dict

    model = Model(ModelConfig.from_dict(tiny_config_dict(tie_word_embeddings=True)))
    h = mx.random.normal((2, 3, 64), key=mx.random.key(0))
    embed = model.model.embed_tokens
    want = embed.as_linear(h / model.config.logit_divisor)
    assert mx.array_equal(model.logits(h), want).item()
    model.model.embed_tokens = nn.QuantizedEmbedding.from_embedding(embed, group_size=32, bits=8)
    want = model.model.embed_tokens.as_linear(h / model.config.logit_divisor)
    assert mx.array_equal(model.logits(h), want).item()
