"""Stage 1's two CUDA kernels' sources (`kernels/stage1_cuda.py`, on by default on CUDA since
their parity passed on an H100), run on the CPU through `cuda_emu` against their MLX-op
reference (`sparse_select._pooled` off CUDA): a change to their sources is checked in
`make test`, before a GPU runs it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import sparse_select, stage1_cuda
from tests.engine.kernels import cuda_emu
from tests.engine.kernels.test_stage1_cuda import _inputs

# The kernel's float32 block scores against the MLX ops' (the same sums in another order)
TOL_F32 = {"rtol": 1e-5, "atol": 1e-6}

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")


@pytest.mark.parametrize(
    ("B", "t", "N1", "N2", "n_blocks"), [(1, 7, 40, 9, 10), (2, 5, 255, 63, 64)]
)
def test_the_kernel_sources_match_the_mlx_ops(B, t, N1, N2, n_blocks):
    Hk, G, scale, r = 2, 16, 0.088, 4
    s1, s2, seen1, seen2 = _inputs(B, Hk, G, t, N1, N2, mx.bfloat16, seed=t)
    rows = B * Hk * G * t
    lse = cuda_emu.run(
        stage1_cuda._LSE,
        [("s2", "bf16", cuda_emu.to_numpy(s2, "bf16")), ("seen2", "i32", np.array(seen2)),
         ("dims", "i32", np.array([N2, t, Hk * G, rows])), ("scale", "f32", np.array([scale]))],
        ("lse", "f32", (rows,)),
        [],
        blocks=-(-rows * 32 // (32 * stage1_cuda._WARPS)),
        threads=32 * stage1_cuda._WARPS,
        shared_bytes=0,
    )  # fmt: skip
    total = B * Hk * t * n_blocks
    pooled = cuda_emu.run(
        stage1_cuda._POOL,
        [("s1", "bf16", cuda_emu.to_numpy(s1, "bf16")), ("lse", "f32", lse),
         ("seen1", "i32", np.array(seen1)), ("seen2", "i32", np.array(seen2)),
         ("dims", "i32", np.array([N1, t, G, Hk, n_blocks, r, B * Hk * t])),
         ("scale", "f32", np.array([scale]))],
        ("pooled", "f32", (B, Hk, t, n_blocks)),
        [],
        blocks=-(-total // stage1_cuda._THREADS),
        threads=stage1_cuda._THREADS,
        shared_bytes=0,
    )  # fmt: skip
    want = sparse_select._pooled(s1, s2, seen1, seen2, scale, n_blocks, r)
    assert np.allclose(pooled, np.array(want), **TOL_F32)
    assert (pooled[-1, :, -1] == 0).all()  # the query that sees no level-2 chunk
