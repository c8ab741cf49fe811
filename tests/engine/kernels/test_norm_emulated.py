"""The decode step's residual add and norm kernel (`kernels/norm_cuda.py`), its own source run
on the CPU through `cuda_emu`, against the MLX ops it replaces (the add, then `nn.RMSNorm`), and
through the model's compiled decode step as on CUDA. The real GPU's run is
`test_norm_cuda.py` (marked `gpu`); `test_cuda_sources.py` builds it with NVRTC."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from salabatch.engine.kernels import norm_cuda
from tests.engine.kernels import cuda_emu
from tests.engine.kernels.test_stage2_cuda import relative_error

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")


def add_norm_case(rows: int, n: int, seed: int):
    """h, y [rows, 1, n] bf16 and an RMSNorm of random weights."""
    rng = np.random.default_rng(seed)
    h, y = (mx.array(rng.normal(size=(rows, 1, n)) * 3).astype(mx.bfloat16) for _ in range(2))
    norm = nn.RMSNorm(n, eps=1e-6)
    norm.weight = mx.array(rng.uniform(0.5, 1.5, n)).astype(mx.bfloat16)
    return h, y, norm


@pytest.mark.parametrize(("rows", "n"), [(3, 300), (1, 1024)])
def test_the_kernel_matches_the_add_and_the_norm(monkeypatch, rows, n):
    """The sum to the bit (s·y and the sum rounded to bf16, as the MLX ops round them); the
    norm to bf16's rounding (its sum of squares in another order)."""
    h, y, norm = add_norm_case(rows, n, seed=n)
    want_h = h + 1.4 * y
    want = norm(want_h)
    with cuda_emu.emulated_kernels(monkeypatch, norm_cuda) as launched:
        got_h, got = norm_cuda.add_rms_norm(h, y, 1.4, norm.weight, norm.eps)
        mx.eval(got_h, got)
    assert launched == ["salabatch_add_rms_norm"]
    assert mx.array_equal(got_h, want_h).item()
    assert relative_error(got, want) < 4e-3


def test_the_decode_step_runs_it_after_each_product(monkeypatch):
    """The model's decode step (`Model.step`; a small model of 4 layers, bf16, 2 rows forked
    from a 300-token document of zeros) with the kernel on: two launches a layer, the logits
    as the MLX ops give them to bf16's rounding, the same greedy tokens."""
    from salabatch.bench.graph import filled_model_cache
    from salabatch.bench.long import random_init
    from salabatch.demo.checkpoint import sala_config
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.decode import DecodeStep
    from salabatch.engine.model import Model

    raw = sala_config(vocab=512, hidden=128, intermediate=256, layers=4, sparse_layers=(1,),
                      heads=4, kv_heads=2, head_dim=32)  # fmt: skip
    model = random_init(Model(ModelConfig.from_dict(raw)), mx.bfloat16, seed=0)
    model.fuse()
    ids = mx.array([5, 9], dtype=mx.int32)

    def step():  # `Model.step` as the compiled step runs it, uncompiled (the emulator evaluates)
        cache = filled_model_cache(model, 300).fork(2)
        info, tables, layers, mode = DecodeStep(model).inputs(cache)
        logits = model.step(ids, info, tables, layers, mode)[0]
        mx.eval(logits)
        return logits

    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    want = step()
    with cuda_emu.emulated_kernels(monkeypatch, norm_cuda) as launched:
        got = step()
    assert launched == ["salabatch_add_rms_norm"] * 8
    assert relative_error(got, want) < 2e-2
    assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()
