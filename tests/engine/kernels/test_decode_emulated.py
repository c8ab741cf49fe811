"""The decode step's selection kernel's own source (`kernels/decode_cuda.py`), run on the CPU
through `cuda_emu` (a CUDA thread a fiber), against its MLX-op reference
`select_step_ref`: the same blocks, in ascending order. Its speed and NVRTC build are a
GPU's and `test_cuda_sources.py`'s to check; its parity on a GPU, `test_decode_cuda.py`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import decode_cuda
from salabatch.engine.kernels.sparse_decode import select_step_ref
from salabatch.engine.kernels.stage2_cuda import BLOCK_ATTENTION
from tests.engine.kernels import cuda_emu
from tests.engine.kernels.test_decode_cuda import (
    BLOCK,
    COMPRESSION,
    attend_case,
    attend_reference,
    shared_scores,
    step_case,
)
from tests.engine.kernels.test_stage2_cuda import relative_error

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")


@pytest.mark.parametrize(
    ("document", "own", "lengths", "k", "local"),
    [
        (5_000, 192, [17, 40, 150], 20, 4),
        (5_000, 192, [1, 3, 40], 20, 0),
        (5_000, 1024, [300, 700, 1000], 24, 2),
        (40_000, 128, [3], 96, 32),
    ],
    ids=["three-rows", "no-window", "long-answers", "9b-selection"],
)
def test_the_kernel_source_matches_the_reference(document, own, lengths, k, local):
    qg, keys, chunks, tables, info = step_case(document, own, lengths, seed=k)
    B, Hk, G, d = qg.shape
    s1, s2 = shared_scores(qg, chunks)
    pool = tables["pool"]
    n_blocks, r1 = pool.shape
    scale = 128**-0.5
    dims = [s1.shape[-1], s2.shape[-1], own, n_blocks, k, Hk, 1, local, info.shape[1],
            COMPRESSION[0][1], COMPRESSION[1][1]]  # fmt: skip
    bf16 = [("q", qg), ("keys", keys), ("s1s", s1), ("s2s", s2)]
    ints = [("numbers0", tables["numbers0"]), ("numbers1", tables["numbers1"]),
            ("pool", pool), ("info", info)]  # fmt: skip
    needed = decode_cuda.needed_bytes(n_blocks, G, own, d, 2, [s for _, s in COMPRESSION])
    got = cuda_emu.run(
        decode_cuda._SELECT,
        [(n, "bf16", cuda_emu.to_numpy(a, "bf16")) for n, a in bf16]
        + [(n, "i32", np.array(a)) for n, a in ints]
        + [("dims", "i32", np.array(dims)), ("scale", "f32", np.array([scale]))],
        ("top", "i32", (B, Hk, k)),
        [("T", "bf16"), ("G", G), ("D", d), ("R1", r1)],
        blocks=B * Hk,
        threads=decode_cuda.THREADS,
        shared_bytes=decode_cuda.shared_bytes(needed),
    )
    kw = dict(k=k, scale=scale, init=1, local=local)
    want = select_step_ref(qg, keys, chunks, tables, info, COMPRESSION, **kw)
    want = np.array(mx.sort(want, axis=-1))
    assert (got == want).all(), f"{(got != want).sum()} of {got.size} ids differ"
    assert (np.diff(got, axis=-1) > 0).all()  # ascending, distinct


@pytest.mark.parametrize(
    ("start", "lengths", "K", "G", "d"),
    [
        (1_024, [1, 70, 200], 8, 16, 128),
        (0, [300, 90], 6, 16, 128),
        (4_096, [17], 96, 16, 128),
        (512, [40, 3], 6, 4, 64),
    ],
    ids=["forked", "own-keys-only", "9b-slots", "small-heads"],
)
def test_the_attention_kernels_source_matches_the_reference(start, lengths, K, G, d):
    """Stage 2's two launches (the splits, their sum) against the float32 reference: blocks
    from the shared keys and the rows' own, -1 slots, the query's own block cut at the query."""
    q, rows, shared, positions, idx = attend_case(start, lengths, K=K, G=G, d=d, seed=K)
    S, R = shared[0].shape[2], rows[0].shape[2]
    B, H, _, d = q.shape
    Hk, G = rows[0].shape[1], H // rows[0].shape[1]
    splits = decode_cuda.splits_for(B * Hk, K)
    info = np.array([[p, p - start] for p in positions], dtype=np.int32)
    kinds = [("q", "bf16", q.reshape(B, Hk, G, d)), ("idx", "i32", idx), ("info", "i32", info),
             ("rows_k", "bf16", rows[0]), ("rows_v", "bf16", rows[1]),
             ("shared_k", "bf16", shared[0]), ("shared_v", "bf16", shared[1]),
             ("first", "i32", np.array([start // BLOCK])),
             ("dims", "i32", np.array([K, R, S, Hk, splits, 2])),
             ("scale", "f32", np.array([d**-0.5]))]  # fmt: skip
    part = cuda_emu.run(
        decode_cuda._ATTEND,
        [(n, k, cuda_emu.to_numpy(a, k) if isinstance(a, mx.array) else a) for n, k, a in kinds],
        ("part", "f32", (B, Hk, splits, G, d + 2)),
        [("T", "bf16"), ("D", d), ("G", G), ("BLOCK", BLOCK)],
        blocks=B * Hk * splits,
        threads=32,
        shared_bytes=decode_cuda.attend_bytes(d, BLOCK, 2),
        header=BLOCK_ATTENTION,
    )
    out = cuda_emu.run(
        decode_cuda._COMBINE,
        [("part", "f32", part), ("dims", "i32", np.array([splits, B * H]))],
        ("out", "bf16", (B, H, 1, d)),
        [("T", "bf16"), ("D", d), ("G", G)],
        blocks=-(-B * H * d // 256),
        threads=256,
        shared_bytes=0,
    )
    got = cuda_emu.from_numpy(out, "bf16").astype(mx.float32)
    want = attend_reference(q, rows, shared, positions, idx, start)
    assert relative_error(got, want) < 6e-3


@pytest.mark.parametrize("dense_len", [0, 1150], ids=["sparse", "mixed"])
def test_the_decode_step_runs_the_selection_kernel_as_on_cuda(monkeypatch, dense_len):
    """`decode_attention` for rows forked from a document (float32: stage 2 stays MLX ops),
    the selection's launch emulated: exactly the reference's blocks, attended as it attends."""
    from tests.engine.kernels import test_sparse_kernels

    with cuda_emu.emulated_kernels(monkeypatch, decode_cuda) as launched:
        test_sparse_kernels.test_gpu_decode_step_matches_the_references(True, dense_len)
    assert launched and set(launched) == {"salabatch_decode_select_16384"}, launched


def test_the_attention_wrapper_runs_its_kernels_as_on_cuda(monkeypatch):
    """`decode_cuda.attend` (two launches, emulated) for forked rows, bf16."""
    q, rows, shared, positions, idx = attend_case(1_024, [1, 70, 200], K=8, seed=5)
    info = mx.array([[p, p - 1_024] for p in positions], dtype=mx.int32)
    with cuda_emu.emulated_kernels(monkeypatch, decode_cuda) as launched:
        got = decode_cuda.attend(q, idx, info, rows, shared, mx.array([1_024 // BLOCK]),
                                 128**-0.5, BLOCK).astype(mx.float32)  # fmt: skip
    assert [n.rsplit("_", 1)[0] for n in launched] == ["salabatch_decode_attend",
                                                       "salabatch_decode_combine"]  # fmt: skip
    want = attend_reference(q, rows, shared, positions, idx, 1_024)
    assert relative_error(got, want) < 6e-3
