"""The attention dispatcher against its float32 reference, on the CPU path (base-2 softmax in
query tiles and lanes) and on the GPU path (MLX's fused SDPA, exercised here through the same
dispatcher with the device check answering "GPU")."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import attention as attn
from salabatch.engine.kernels import sparse_decode
from salabatch.engine.kernels.attention import attention, attention_ref

TOL_F32 = 1e-5
# bf16 attention against the float32 reference, absolute (outputs of magnitude ~1)
TOL_BF16 = 2e-2
# a product in each dtype against float32's, relative to its largest value
TOL_PRODUCT = {mx.float32: 1e-6, mx.float16: 5e-3, mx.bfloat16: 3e-2}
B, H, HK, D = 2, 8, 2, 16


def rand(*shape, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def positions_mask(starts, t, n):
    q_pos = mx.array(starts)[:, None, None, None] + mx.arange(t)[:, None]
    return mx.arange(n) <= q_pos  # [B, 1, t, n]


CASES = {
    "causal, whole prompt": (300, 300, "causal"),
    "causal, later chunk": (1000, 129, "causal"),
    "causal, one query": (77, 1, "causal"),
    "no mask": (50, 7, None),
}


@pytest.fixture(params=["one tile", "small tiles"])
def tiles(request, monkeypatch):
    if request.param == "small tiles":  # every tiling edge, several tiles per lane
        monkeypatch.setattr(attn, "MAX_SCORE_ELEMENTS", 4000)
        monkeypatch.setattr(attn, "LANE_ROWS", 2)
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_path_matches_reference(cpu_device, tiles, case):
    n, t, mask = CASES[case]
    q, k, v = rand(B, H, t, D, seed=1), rand(B, HK, n, D, seed=2), rand(B, HK, n, D, seed=3)
    got = attention(q, k, v, D**-0.5, mask)
    assert mx.abs(got - attention_ref(q, k, v, D**-0.5, mask)).max().item() < TOL_F32


def test_rows_at_different_positions_with_shared_keys(cpu_device, tiles):
    """Keys as parts: shared keys [1, Hk, S, d] common to the rows, then each row's own keys."""
    S, R, t = 192, 40, 5
    shared_k, shared_v = rand(1, HK, S, D, seed=4), rand(1, HK, S, D, seed=5)
    rows_k, rows_v = rand(B, HK, R, D, seed=6), rand(B, HK, R, D, seed=7)
    q = rand(B, H, t, D, seed=8)
    starts = [S + 30, S + 12]  # each row's first query; row 1's later keys are spare
    mask = positions_mask(starts, t, S + R)
    got = attention(q, (shared_k, rows_k), (shared_v, rows_v), D**-0.5, mask)
    full_k = mx.concatenate([mx.broadcast_to(shared_k, (B, HK, S, D)), rows_k], axis=2)
    full_v = mx.concatenate([mx.broadcast_to(shared_v, (B, HK, S, D)), rows_v], axis=2)
    want = attention_ref(q, full_k, full_v, D**-0.5, mask)
    assert mx.abs(got - want).max().item() < TOL_F32


def test_bf16_inputs_keep_their_dtype():
    q, k, v = (
        x.astype(mx.bfloat16) for x in (rand(1, H, 9, D), rand(1, HK, 9, D), rand(1, HK, 9, D))
    )
    got = attention(q, k, v, D**-0.5, "causal")
    assert got.dtype == mx.bfloat16
    want = attention_ref(q, k, v, D**-0.5, "causal").astype(mx.float32)
    assert mx.abs(got.astype(mx.float32) - want).max().item() < TOL_BF16


@pytest.fixture
def fused_calls(monkeypatch):
    """Pretends to be on a GPU and records what reaches MLX's fused SDPA."""
    calls = []
    fused = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None):
        calls.append((q.shape, k.shape, mask if isinstance(mask, str) or mask is None else "array"))
        return fused(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(attn, "on_gpu", lambda: True)
    monkeypatch.setattr(sparse_decode, "on_gpu", lambda: True)  # no native CPU kernel
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    return calls


def test_gpu_path_is_one_fused_causal_call(fused_calls):
    """Queries aligned with their keys: one fused call with mask="causal", no tiles, no mask
    array (the CPU tile bound does not apply on a GPU)."""
    n = 3000
    q, k, v = rand(1, H, n, D, seed=1), rand(1, HK, n, D, seed=2), rand(1, HK, n, D, seed=3)
    got = attention(q, k, v, D**-0.5, "causal")
    assert fused_calls == [((1, H, n, D), (1, HK, n, D), "causal")]
    assert mx.abs(got - attention_ref(q, k, v, D**-0.5, "causal")).max().item() < TOL_F32


def test_gpu_path_masks_only_rows_at_different_positions(fused_calls):
    S, R, t = 128, 20, 3
    shared_k, rows_k = rand(1, HK, S, D, seed=4), rand(B, HK, R, D, seed=6)
    q = rand(B, H, t, D, seed=8)
    mask = positions_mask([S + 10, S + 2], t, S + R)
    got = attention(q, (shared_k, rows_k), (shared_k, rows_k), D**-0.5, mask)
    assert [c[2] for c in fused_calls] == ["array"]
    full = mx.concatenate([mx.broadcast_to(shared_k, (B, HK, S, D)), rows_k], axis=2)
    assert mx.abs(got - attention_ref(q, full, full, D**-0.5, mask)).max().item() < TOL_F32


def test_sparse_layer_below_dense_len_uses_the_fused_causal_call(fused_calls, tmp_path):
    """The model's dense mode, prefill and decode, as the GPU runs it."""
    from salabatch.engine.load import load_model
    from tests.tiny import write_tiny_checkpoint

    model = load_model(write_tiny_checkpoint(tmp_path), dtype="float32")
    ids = mx.array(np.random.default_rng(0).integers(3, 256, size=(1, 200)), dtype=mx.int32)
    cache = model.make_cache()
    model(ids[:, :199], cache)
    sparse_layers = len(model.config.sparse_layers)
    assert [c[2] for c in fused_calls] == ["causal"] * sparse_layers  # one call each
    fused_calls.clear()
    model(ids[:, 199:], cache)  # decode: one query, no mask at all
    assert [c[2] for c in fused_calls] == [None] * sparse_layers


def test_exp2_poly_matches_exp2_within_float32_rounding():
    """The compiled decode graphs' 2^x: ~1e-7 relative to float64 over the whole range a
    softmax feeds it (x ≤ 0), exactly 1 at 0 and exactly 0 for masked (−inf) scores."""
    x = mx.concatenate([mx.linspace(-126, 0, 400_001), mx.array([-mx.inf, -1e4, 0.0, -1e-9])])
    got = np.array(mx.compile(attn.exp2_poly)(x), dtype=np.float64)
    want = np.exp2(np.array(x, dtype=np.float64))
    body = slice(0, 400_001)
    assert np.max(np.abs(got[body] - want[body]) / want[body]) < 3e-7
    assert got[-4:].tolist() == [0.0, 0.0, 1.0, 1.0]
    np.testing.assert_allclose(np.array(attn.exp2(x[:-4])), want[body], rtol=3e-7)
    halves = mx.arange(-126.5, 0.0, 0.5)  # ties of the rounding step, at both of its ends
    got = np.array(mx.compile(attn.exp2_poly)(halves), dtype=np.float64)
    np.testing.assert_allclose(got, np.exp2(np.array(halves, dtype=np.float64)), rtol=3e-7)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_gather_products_are_gather_mm_in_any_dtype_on_the_cpu(cpu_device, dtype):
    """MLX's CPU gather_mm takes float32 only; the CPU's other dtypes take the matrices first.
    Both patterns the kernels use: one query row against k blocks (decode), and k weighted
    blocks summed (lhs its own slots); against float32 gather_mm of the same values."""
    rng = np.random.default_rng(0)
    n, k, G, d, block, table = 3, 4, 2, 8, 5, 11
    q = mx.array(rng.normal(size=(n, 1, G, d)), dtype=dtype)
    keys = mx.array(rng.normal(size=(table, d, block)), dtype=dtype)
    p = mx.array(rng.normal(size=(n, k, G, block)), dtype=dtype)
    values = mx.array(rng.normal(size=(table, block, d)), dtype=dtype)
    at = mx.array(rng.integers(0, table, size=(n, k)), dtype=mx.uint32)
    lhs = mx.broadcast_to(mx.arange(n, dtype=mx.uint32)[:, None], (n, k))
    slots = mx.arange(n * k, dtype=mx.uint32).reshape(n, k)
    for a, b, rows in ((q, keys, lhs), (p, values, slots)):
        got = attn.gather_products(a, b, rows, at)
        want = mx.gather_mm(a.astype(mx.float32), b.astype(mx.float32), rows, at)
        assert got.dtype == dtype and got.shape == want.shape
        err = np.abs(np.array(got.astype(mx.float32)) - np.array(want)).max()
        assert err <= TOL_PRODUCT[dtype] * np.abs(np.array(want)).max(), err
