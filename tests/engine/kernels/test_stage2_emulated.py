"""The stage-2 CUDA kernel's own source (`kernels/stage2_cuda.py`), run on the CPU through
`cuda_emu` (a CUDA thread a fiber; WMMA as whole matrices), against the float32
reference `block_sparse_attention_ref`: its indexing, its walk of each query's blocks, causal
mask, online softmax, rescaling by rows and synchronisation, checked without a GPU. Its speed,
and the real tensor cores and NVRTC build, are a GPU's to test (`test_stage2_cuda.py`, marked
`gpu`; `test_cuda_sources.py` builds it for an H100)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import sparse_attention, stage2_cuda
from salabatch.engine.kernels.sparse_attention import KVView, block_sparse_attention_ref
from tests.engine.kernels import cuda_emu
from tests.engine.kernels.test_stage2_cuda import BLOCK, prefill_case, relative_error

# The kernel's bf16 output against the float32 reference: relative (~2e-3 measured: bf16 weights
# and output), and absolute
TOL_BF16 = 6e-3
TOL_BF16_ABS = 0.05

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")


@pytest.mark.parametrize(
    ("G", "d", "tile", "start", "T", "qreg"),
    [(16, 128, 4, 300, 37, 1), (4, 64, 2, 700, 21, 1), (8, 128, 8, 500, 19, 0)],
    ids=["9b-heads", "small", "eight-warps-query-in-shared-memory"],
)
def test_the_kernel_source_matches_the_reference(G, d, tile, start, T, qreg):
    """Two rows at their own starts, 6 slots a query (its own block, the first, random others,
    in any order), a last thread block with fewer queries than warps; the query's tiles in
    registers or read from shared memory."""
    q, kv, idx, starts = prefill_case(G, d, 6, start, T, mx.bfloat16, seed=G + d, B=2)
    B, Hk, R, _ = kv.rows_k.shape
    scale = d**-0.5
    got = cuda_emu.run(
        stage2_cuda._SOURCE,
        [
            ("q", "bf16", cuda_emu.to_numpy(q.transpose(0, 2, 1, 3), "bf16")),
            ("keys", "bf16", cuda_emu.to_numpy(kv.rows_k, "bf16")),
            ("values", "bf16", cuda_emu.to_numpy(kv.rows_v, "bf16")),
            ("idx", "i32", np.array(idx)),
            ("first", "i32", np.array(starts)),
            ("dims", "i32", np.array([T, Hk * G, Hk, R, 6, B])),
            ("scale", "f32", np.array([scale])),
        ],
        ("out", "bf16", (B, T, Hk * G, d)),
        [("T", "bf16"), ("D", d), ("G", G), ("QT", tile), ("BLOCK", BLOCK), ("QREG", qreg)],
        blocks=stage2_cuda.thread_blocks(B, Hk, T, tile),
        threads=32 * tile,
        shared_bytes=stage2_cuda.shared_bytes(d, BLOCK, tile, 2, bool(qreg)),
        header=stage2_cuda.BLOCK_ATTENTION,
    )
    got = cuda_emu.from_numpy(got, "bf16").transpose(0, 2, 1, 3)
    f32 = KVView(None, None, 0, *(a.astype(mx.float32) for a in (kv.rows_k, kv.rows_v)),
                 kv.lengths)  # fmt: skip
    want = block_sparse_attention_ref(q.astype(mx.float32), f32, idx, starts, scale, BLOCK)
    assert relative_error(got, want) < TOL_BF16
    assert mx.abs(got.astype(mx.float32) - want).max().item() < TOL_BF16_ABS


def test_the_dispatcher_and_wrapper_run_it_as_on_cuda(monkeypatch):
    """`block_sparse_attention_gpu` with the kernel on, its launch emulated: the wrapper's
    layout, sort, grid and shared memory as MLX would get them, two rows at their own starts
    (the kernel taken at any number of keys)."""
    monkeypatch.setattr(sparse_attention, "STAGE2_KERNEL_KEYS", 0)
    q, kv, idx, starts = prefill_case(16, 128, 12, 2_000, 23, mx.bfloat16, seed=3, B=2)
    with cuda_emu.emulated_kernels(monkeypatch, stage2_cuda) as launched:
        got = sparse_attention.block_sparse_attention_gpu(q, kv, idx, starts, 128**-0.5, BLOCK)
        got = got.astype(mx.float32)
    assert launched == ["salabatch_stage2_queries"]
    f32 = KVView(None, None, 0, *(a.astype(mx.float32) for a in (kv.rows_k, kv.rows_v)),
                 kv.lengths)  # fmt: skip
    want = block_sparse_attention_ref(q.astype(mx.float32), f32, idx, starts, 128**-0.5, BLOCK)
    assert relative_error(got, want) < TOL_BF16


def test_the_dispatcher_takes_it_only_past_its_crossover(monkeypatch):
    """With the kernel on, queries whose keys are at most STAGE2_KERNEL_KEYS take the masked
    form, to the bit as with the kernel off; one bucket more and they take the kernel."""
    q, kv, idx, starts = prefill_case(16, 128, 12, 2_000, 23, mx.bfloat16, seed=3, B=2)
    args = (q, kv, idx, starts, 128**-0.5, BLOCK)
    keys = sparse_attention._masked_keys(kv, max(starts) + q.shape[2])
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    masked = sparse_attention.block_sparse_attention_gpu(*args)
    monkeypatch.setattr(sparse_attention, "STAGE2_KERNEL_KEYS", keys)
    with cuda_emu.emulated_kernels(monkeypatch, stage2_cuda) as launched:
        below = sparse_attention.block_sparse_attention_gpu(*args)
        assert launched == []
        monkeypatch.setattr(sparse_attention, "STAGE2_KERNEL_KEYS", keys - 1)
        past = sparse_attention.block_sparse_attention_gpu(*args)
        assert launched == ["salabatch_stage2_queries"]
    assert mx.array_equal(below, masked)
    f32 = KVView(None, None, 0, *(a.astype(mx.float32) for a in (kv.rows_k, kv.rows_v)),
                 kv.lengths)  # fmt: skip
    want = block_sparse_attention_ref(q.astype(mx.float32), f32, idx, starts, 128**-0.5, BLOCK)
    assert relative_error(past.astype(mx.float32), want) < TOL_BF16
