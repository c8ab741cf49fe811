"""The stage-2 CUDA kernel (`kernels/stage2_cuda.py`) on a GPU, against the float32 reference
and the MLX-op forms it would replace: run where MLX's CUDA backend has a GPU (`-m gpu`),
skipped elsewhere (its source runs on the CPU in `test_stage2_emulated.py`). It is off by
default until these pass on a GPU; `benchmarks/device-gpu.sh` runs them and switches it on
for the timings that follow when they do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import sparse_attention, stage2_cuda
from salabatch.engine.kernels.sparse_attention import KVView, block_sparse_attention_ref

ON_CUDA = (
    mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()
)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")]

BLOCK = 64


def prefill_case(G, d, K, start, T, dtype, seed, B=1, Hk=2):
    """Random keys and queries of B rows at start, start + 37, ...; each query's own block,
    the first, and random earlier ones (as stage 1 picks: distinct, any order, -1 for none)."""
    rng = np.random.default_rng(seed)
    starts = [start + 37 * b for b in range(B)]
    R = -(-(starts[-1] + T) // BLOCK) * BLOCK
    keys, values = (mx.array(rng.normal(size=(B, Hk, R, d))).astype(dtype) for _ in range(2))
    q = mx.array(rng.normal(size=(B, Hk * G, T, d)) * 2).astype(dtype)
    idx = np.full((B, Hk, T, K), -1, dtype=np.int32)
    for b, s in enumerate(starts):
        for h in range(Hk):
            for t in range(T):
                own = (s + t) // BLOCK
                others = rng.choice(np.arange(1, own), size=min(K - 2, own - 1), replace=False)
                chosen = np.unique([0, own, *others])[:K]
                idx[b, h, t, : len(chosen)] = rng.permutation(chosen)
    lengths = tuple(s + T for s in starts)
    return q, KVView(None, None, 0, keys, values, lengths), mx.array(idx), starts


def relative_error(got, want) -> float:
    """RMS of got - want over the RMS of want, in float32."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return mx.sqrt(mx.mean((got - want) ** 2) / mx.mean(want**2)).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("tile", [2, 4, 8])
@pytest.mark.parametrize(
    ("G", "d", "K", "start", "T"),
    [(16, 128, 96, 8_000, 300), (16, 128, 12, 1_500, 77), (4, 64, 6, 700, 45)],
    ids=["9b", "9b-few-slots", "small"],
)
def test_the_kernel_matches_the_reference(dtype, tile, G, d, K, start, T):
    q, kv, idx, starts = prefill_case(G, d, K, start, T, dtype, seed=G + K + tile)
    scale = d**-0.5
    got = stage2_cuda.attend(
        q.transpose(0, 2, 1, 3), kv.rows_k, kv.rows_v, idx, mx.array(starts), scale, BLOCK, tile
    ).transpose(0, 2, 1, 3)
    f32 = KVView(None, None, 0, *(a.astype(mx.float32) for a in (kv.rows_k, kv.rows_v)),
                 kv.lengths)  # fmt: skip
    want = block_sparse_attention_ref(q.astype(mx.float32), f32, idx, starts, scale, BLOCK)
    assert got.dtype == dtype
    assert relative_error(got, want) < 6e-3


def test_the_dispatcher_takes_it_when_switched_on(monkeypatch):
    """Two rows at their own starts, past their first K blocks: the kernel's output is what
    the MLX-op form (the masked SDPA here) gives, to bf16 precision."""
    q, kv, idx, starts = prefill_case(16, 128, 12, 2_000, 64, mx.bfloat16, seed=3, B=2)
    args = (q, kv, idx, starts, 128**-0.5, BLOCK)
    monkeypatch.setattr(sparse_attention, "STAGE2_KERNEL_KEYS", 0)  # taken at any context
    monkeypatch.setenv("SALABATCH_CUDA_KERNELS", "stage1")
    mlx_ops = sparse_attention.block_sparse_attention_gpu(*args)
    monkeypatch.setenv("SALABATCH_CUDA_KERNELS", "stage1,stage2")
    assert stage2_cuda.available()
    kernel = sparse_attention.block_sparse_attention_gpu(*args)
    direct = stage2_cuda.attend(
        q.transpose(0, 2, 1, 3), kv.rows_k, kv.rows_v, idx, mx.array(starts), *args[-2:]
    ).transpose(0, 2, 1, 3)
    assert mx.array_equal(kernel, direct)
    assert relative_error(kernel, mlx_ops) < 6e-3
