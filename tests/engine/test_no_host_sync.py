"""The forward pass never waits on the device: no `np.array`, `.item()` or `.tolist()` of a
device array, in a long sparse prefill (every InfLLM-v2 path) and in decode.

The model runs under `mx.compile`'s tracer, which raises on any evaluation of an array, so any
host round trip anywhere in the forward pass fails these tests. Only the trace is checked: the
traced graph is never run (the caches mutate in place, which a compiled graph need not honour).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.cache import ModelCache
from salabatch.engine.decode import decode
from salabatch.engine.kernels import sparse_attention
from salabatch.engine.load import load_model
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint

# the stage-2 paths, each forced in turn (see tests/engine/kernels/test_sparse_kernels.py)
PATHS = {
    "default": {},
    "gathered": {"SCORED_KEYS_PER_SLOT": 0, "MAX_GATHER_BYTES": 1 << 16},
    "scored": {"SCORED_KEYS_PER_SLOT": 1 << 20, "MAX_SCORE_ELEMENTS": 1 << 14},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("s"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


def tokens(n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(3, 256, size=(1, n)), dtype=mx.int32)


def traced(fn, *args) -> None:
    """Traces fn: raises if fn evaluates any array. The outputs are dropped unevaluated."""
    mx.compile(fn)(*args)


def test_the_tracer_catches_a_host_round_trip():
    def reads_back(x):
        return x + float(np.array(x).sum())

    with pytest.raises(ValueError, match="eval"):
        traced(reads_back, mx.ones(3))


@pytest.mark.parametrize("engine_path", ["native-path", "gpu-path"], indirect=True)
@pytest.mark.parametrize("path", list(PATHS))
def test_chunked_sparse_prefill_and_decode_stay_on_the_device(
    model, monkeypatch, path, engine_path
):
    for name, value in PATHS[path].items():
        monkeypatch.setattr(sparse_attention, name, value)
    n = 700  # sparse from 256 tokens: stage 1 and every stage-2 path run

    def forward(ids):
        cache = model.make_cache()
        cache.plan_prefill(n)
        for s in range(0, n, 300):
            model(ids[:, s : s + 300], cache)
        steps = [decode(model, ids[:, n + i], cache) for i in range(3)]
        return mx.stack(steps, axis=1)

    traced(forward, tokens(n + 3, seed=1))


def test_batched_decode_over_a_shared_prefix_stays_on_the_device(model, engine_path):
    doc = model.make_cache()
    model(tokens(600, seed=2), doc)
    rows = []
    for i, n in enumerate((5, 17, 2)):
        row = doc.fork(1)
        model(tokens(n, seed=10 + i), row)
        rows.append(row)
    mx.eval(*[a for r in rows for a in r.arrays()])

    def step(ids):
        batch = ModelCache.concat(rows)
        return decode(model, ids, batch)

    traced(step, mx.array([3, 4, 5], dtype=mx.int32))
