"""Stage 1's block-score kernel (`kernels/scores_cuda.py`), its own source run on the CPU through
`cuda_emu` (a CUDA thread a fiber; WMMA as whole matrices), against what it replaces: the
raw scores as matmuls in q's dtype, then `sparse_select._pooled`'s MLX ops; and the dispatcher
`select_blocks_gpu` taking it as on CUDA. Its speed, the real tensor cores and NVRTC's build
are a GPU's to test (`test_scores_cuda.py`, marked `gpu`; `test_cuda_sources.py` builds it)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import scores_cuda, sparse_select
from salabatch.engine.kernels.sparse_select import _pooled
from tests.engine.kernels import cuda_emu
from tests.engine.kernels.test_stage2_cuda import relative_error

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")


def scores_case(B, Hk, G, T, d, N1, N2, shared, seed):
    """Queries and compressed keys of both levels (one shared copy or one a row), and what each
    query sees: most see many chunks, the first all of them, one none at level 2, one none at
    level 1."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.normal(size=(B, Hk, G, T, d))).astype(mx.bfloat16)
    b = 1 if shared else B
    c1, c2 = (mx.array(rng.normal(size=(b, Hk, n, d)) * 0.3).astype(mx.bfloat16) for n in (N1, N2))
    seen1 = rng.integers(N1 // 2, N1 + 1, size=(B, T))
    seen1[0, 0] = N1
    seen2 = np.minimum(seen1 // 4, N2)
    seen2[0, 1], seen1[-1, -1] = 0, 0
    return q, c1, c2, mx.array(seen1, dtype=mx.int32), mx.array(seen2, dtype=mx.int32)


def reference(q, c1, c2, seen1, seen2, scale, n_blocks, r):
    s1, s2 = (q @ c[:, :, None].swapaxes(-1, -2) for c in (c1, c2))  # in q's dtype
    return _pooled(s1, s2, seen1, seen2, scale, n_blocks, r)


@pytest.mark.parametrize(
    ("B", "Hk", "G", "T", "d", "N1", "N2", "shared"),
    [
        (2, 2, 4, 13, 64, 150, 37, True),  # a partial last tile of queries and of chunks
        (2, 1, 16, 9, 128, 256, 64, False),  # the 9B's 16 heads a kv group, whole tiles, keys a row
        (1, 1, 16, 5, 64, 400, 130, True),  # passes of several tiles each, loaded while scored
    ],
    ids=["small", "9b-heads", "many-tiles"],
)
def test_the_kernel_matches_the_matmuls_and_the_pooling(monkeypatch, B, Hk, G, T, d, N1, N2,
                                                         shared):  # fmt: skip
    q, c1, c2, seen1, seen2 = scores_case(B, Hk, G, T, d, N1, N2, shared, seed=N1 + d)
    scale, r = d**-0.5, 4
    n_blocks = N1 // r + 3  # blocks past the chunks too
    want = reference(q, c1, c2, seen1, seen2, scale, n_blocks, r)
    with cuda_emu.emulated_kernels(monkeypatch, scores_cuda) as launched:
        got = scores_cuda.pooled_scores(q, c1, c2, seen1, seen2, scale, n_blocks, r)
        mx.eval(got)
    assert launched == ["salabatch_stage1_scores"]
    assert got.shape == want.shape == (B, Hk, T, n_blocks)
    # the raw scores rounded to bf16 as the matmul's are, summed in another order: a score may
    # land one bf16 step away (~0.4 %), which moves its exp by as much
    assert relative_error(got, want) < 2e-3
    assert mx.all((got == 0) == (want == 0)).item()  # the same blocks seen and unseen


def selection_case(B, Hk, G, T, d, start, seed):
    """`select_blocks_gpu`'s arguments at the 9B's InfLLM-v2 settings: B rows of T queries, the
    first at `start`, the next 37 before, over one shared copy of both levels' compressed keys
    (random) → (q, c1, c2, starts, keywords)."""
    from salabatch.engine.config import SparseConfig

    sc = SparseConfig()
    rng = np.random.default_rng(seed)
    q = mx.array(rng.normal(size=(B, Hk * G, T, d))).astype(mx.bfloat16)
    parts = []
    for size, stride in sc.compression:
        n = (start + T - size) // stride + 1
        parts.append((mx.array(rng.normal(size=(1, Hk, n, d)) * 0.3).astype(mx.bfloat16),))
    n_blocks = -(-(start + T) // sc.block_size)
    kw = dict(prefill_len=start + T, n_blocks=n_blocks, k=min(sc.topk_eff, n_blocks),
              scale=d**-0.5, init_blocks=sc.init_blocks, local_blocks=sc.local_blocks,
              block=sc.block_size, compression=sc.compression)  # fmt: skip
    return q, *parts, [start - 37 * b for b in range(B)], kw


def test_the_dispatcher_selects_the_same_blocks(monkeypatch):
    """`select_blocks_gpu` with the kernel on (emulated) picks the blocks the MLX-op form
    picks: 2 rows of 40 queries at 3,000 tokens, the 9B's settings at a small head count."""
    q, c1, c2, starts, kw = selection_case(2, 1, 4, 40, 64, 3000, seed=3)
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    want = sparse_select.select_blocks_gpu(q, c1, c2, starts, **kw)
    with cuda_emu.emulated_kernels(monkeypatch, scores_cuda) as launched:
        got = sparse_select.select_blocks_gpu(q, c1, c2, starts, **kw)
        mx.eval(got)
    assert launched == ["salabatch_stage1_scores"]
    same = np.mean(np.sort(np.array(got), -1) == np.sort(np.array(want), -1))
    assert same > 0.99, same  # a near tie may swap a block where a score moved a bf16 step
