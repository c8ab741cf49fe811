"""`benchmarks/device-profile.py`, the first thing a lent GPU runs after the kernels' parity, runs
every part on the CPU with each custom kernel switched on as a stand-in (`bench.graph.gpu_graph`:
a launch gives zeros of its output's shape, fused ops return their input): the branches that
only a GPU takes are executed, so a Python error in them cannot cost a GPU's minutes. Its log
is what `benchmarks/choose-kernels.py` reads: each kernel it compares is found there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx

from salabatch.bench import graph
from tests.bench.test_choose_kernels import choose

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "device-profile.py"


def test_every_part_runs_with_every_kernel_and_choose_kernels_reads_its_log(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("device_profile", SCRIPT)
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    # stage 2's MLX-op forms, as zeros: the gathered one is float32-only on the CPU, and both
    # take minutes here at the 9B's heads; the kernel's branch calls its wrapper directly
    monkeypatch.setattr(profile, "block_sparse_attention", lambda q, *_: mx.zeros_like(q))
    with graph.gpu_graph(graph.H100_MEMORY, cuda=True):
        profile.main([9216], hidden=64, chunk=256, dt=mx.bfloat16, decode_context=9216)
    log = capsys.readouterr().out
    for part in (
        "9216: stage 1 (select_blocks), block scores CUDA kernel",
        "9216: stage 2, CUDA kernel, 8 queries a thread block, query in shared memory",
        "9216: stage 1 pooling alone, of the scores (CUDA kernels)",
        "9216: stage 1's two score matmuls, heads folded into rows",
        "9216: stage 1, folded matmuls: 0 at most from the batched",
        "lightning layer, whole (8K chunk), recurrence CUDA kernel",
        "lightning recurrence alone, CUDA kernel",
        "1 row(s), head x8: rows kernel, 8 loads in flight",
        "8 row(s), MLP down: product, then add",
        "decode step, 8 lightning layer(s), products as MLX ops",
        "decode step, 8 sparse layer(s), selection as MLX ops",
        "decode attention, stage 2, MLX ops",
        "decode, per layer:",
    ):
        assert part in log, part
    # every kernel passed and was timed beside its MLX ops: each is judged, none "not timed"
    kernels = "stage1,scores,stage2,decode,gla,norm,rows"
    chosen = choose(f"== SALABATCH_CUDA_KERNELS={kernels}\n{log}")
    assert set(chosen) <= set(kernels.split(","))
    judged = capsys.readouterr().err
    for kernel in kernels.split(",")[1:]:  # stage1 has no MLX-op twin timed apart
        assert f"{kernel}: " in judged and f"{kernel}: not timed" not in judged, judged
