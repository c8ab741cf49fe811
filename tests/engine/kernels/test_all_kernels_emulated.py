"""Every custom CUDA kernel at once, their sources run on the CPU through `cuda_emu`: a small bf16
model prefills a 520-token document (InfLLM-v2 from 256 tokens: the block scores, stage 2 and
the lightning recurrence as kernels) and decodes 3 steps of 2 rows forked from it (the
selection, stage 2, the lightning step and the residual adds as kernels), as the MLX-op GPU
path does to bf16's rounding. Each kernel is tested alone beside its reference in its own
file; this is their seams: the layouts one hands the next, the dispatchers' conditions, the
cache between prefill and decode."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.bench.graph import custom_kernel_modules
from salabatch.engine.decode import DecodeStep
from salabatch.engine.generate import prefill
from salabatch.engine.kernels import sparse_attention
from salabatch.engine.kernels.sparse_decode import DENSE
from salabatch.engine.load import load_model
from tests.engine.kernels import cuda_emu
from tests.engine.kernels.test_stage2_cuda import relative_error
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Sparse, lightning, lightning, sparse layers; head dim 32 (the kernels take multiples of
    16 or 32), 2 query heads a kv head, lightning heads sharing 2 kv heads; bf16."""
    raw = tiny_config_dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        lightning_nh=4, lightning_nkv=2, lightning_head_dim=32, **SPARSE_AT_256,
    )  # fmt: skip
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("all-kernels"), raw)
    return load_model(path, dtype="bfloat16")


def step(model, tokens: mx.array, cache) -> mx.array:
    """`DecodeStep` uncompiled (the emulator evaluates its inputs): `Model.step` on the
    step's inputs, the cache advanced."""
    info, tables, layers, mode = DecodeStep(model).inputs(cache)
    logits, layers, selected = model.step(tokens, info, tables, layers, mode)
    cache.stepped(layers, selected, sparse=mode != DENSE)
    return logits


def run(model) -> list[mx.array]:
    """The document's last logits, then 3 steps' logits of 2 rows forked from it, fed the same
    tokens either way (greedy ones could part at a near tie, and the steps after with them)."""
    ids = np.random.default_rng(0).integers(3, 256, size=520).tolist()
    doc = model.make_cache()
    out = [prefill(model, ids, doc)[None]]
    rows = doc.fork(2)
    for tokens in ([7, 11], [13, 200], [19, 23]):
        logits = step(model, mx.array(tokens, dtype=mx.int32), rows)
        mx.eval(logits, rows.arrays())
        out.append(logits)
    return out


def test_every_kernel_together_as_the_mlx_ops(model, monkeypatch):
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    monkeypatch.setattr(sparse_attention, "STAGE2_KERNEL_KEYS", 0)  # stage 2's kernel at 520
    want = run(model)
    with cuda_emu.emulated_kernels(monkeypatch, *custom_kernel_modules()) as launched:
        got = run(model)
    names = set(launched)
    assert {"salabatch_stage1_scores", "salabatch_stage2_queries", "salabatch_gla_out",
            "salabatch_gla_step", "salabatch_add_rms_norm",
            "salabatch_rows"} <= names, names  # fmt: skip
    assert any(name.startswith("salabatch_decode_") for name in names), names
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 5e-2
        # each greedy token the reference's, or one tying with it to bf16's rounding
        w = w.astype(mx.float32)
        chosen = mx.take_along_axis(w, g.argmax(-1)[:, None], axis=-1)[:, 0]
        assert mx.all(w.max(-1) - chosen <= 2e-2 * mx.abs(w).max(-1)).item()
