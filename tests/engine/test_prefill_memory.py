"""A chunked prefill's memory beyond its caches does not grow with the document: stage-1 score
tiles, stage-2 tiles and dense attention tiles are all bounded (here shrunk so that a tiny
model meets the bounds at a few thousand tokens)."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine import memory
from salabatch.engine.generate import prefill
from salabatch.engine.kernels import attention, gla, sparse_attention, sparse_select
from salabatch.engine.load import load_model
from tests.tiny import SPARSE_AT_256, L, S, tiny_config_dict, write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("m"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


def transient_peak(model, n: int) -> int:
    """Peak bytes of a chunked prefill of n tokens above the weights and the final caches."""
    ids = np.random.default_rng(n).integers(3, 256, size=n).tolist()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = model.make_cache()
    prefill(model, ids, cache, chunk=512)
    held = mx.get_active_memory() - base  # the caches (and the last logits)
    return mx.get_peak_memory() - base - held


def test_transient_memory_is_flat_in_the_document_length(model, monkeypatch):
    monkeypatch.setattr(sparse_select, "MAX_SCORE_ELEMENTS", 1 << 16)
    monkeypatch.setattr(sparse_attention, "MAX_SCORE_ELEMENTS", 1 << 16)
    monkeypatch.setattr(sparse_attention, "MAX_GATHER_BYTES", 1 << 18)
    monkeypatch.setattr(attention, "MAX_SCORE_ELEMENTS", 1 << 16)
    short, long = transient_peak(model, 2048), transient_peak(model, 8192)
    assert long < 1.5 * short, (short, long)


def test_a_calls_tiles_are_taken_in_turn_within_the_limit(monkeypatch):
    """Dense attention at the 9B's heads in 1 MB tiles, within a limit of three tiles: one tile
    per lane at a time, so MLX's peak stays within the limit, one tile allocated past it, and
    the output (the tiles' and their concatenation). MLX's breadth-first order, with the tiles
    independent, started every tile's scores first: about 20 tiles."""
    monkeypatch.setattr(attention, "MAX_SCORE_ELEMENTS", 1 << 18)
    tile = 4 << 18
    H, Hk, d, T = 32, 2, 16, 1024
    q, k, v = (mx.random.normal((1, h, T, d), key=mx.random.key(h)) for h in (H, Hk, Hk + 1))
    v = v[:, :Hk]
    mx.eval(q, k, v)
    plan = memory.MemoryPlan(weights=0, document=0, rows=0, transient=4 * tile, overshoot=tile)
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    with memory.bounded(plan) as limit:
        o = attention.attention(q, k, v, 0.25, "causal")
        mx.eval(o)
    assert limit == base + 3 * tile
    assert mx.get_peak_memory() <= limit + tile + 2 * o.nbytes, (mx.get_peak_memory() - base) / tile
    ref = attention.attention_ref(q, k, v, 0.25, "causal")
    assert mx.allclose(o, ref, atol=1e-5).item()


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-path", "gpu-path"])
def test_a_prefill_holds_no_more_than_its_plan(tmp_path, monkeypatch, gpu):
    """The 9B's attention heads (32 query, 2 kv) at a tiny width, its tiles shrunk: a chunked
    prefill within `memory.bounded` peaks within the plan, as does its necessary memory alone
    (a 1-byte limit: MLX waits for all earlier work after every op)."""
    if gpu:  # the GPU path's tiles for a 64 MB device, every stage-2 tile gathering its blocks
        monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
        monkeypatch.setattr(attention, "device_memory", lambda: 1 << 26)
        monkeypatch.setattr(sparse_attention, "MASKED_KEYS", 0)
    else:
        monkeypatch.setattr(sparse_select, "MAX_SCORE_ELEMENTS", 1 << 16)
        monkeypatch.setattr(sparse_attention, "MAX_SCORE_ELEMENTS", 1 << 16)
        monkeypatch.setattr(sparse_attention, "MAX_GATHER_BYTES", 1 << 18)
        monkeypatch.setattr(attention, "MAX_SCORE_ELEMENTS", 1 << 16)
    heads = dict(num_attention_heads=32, head_dim=16, lightning_nh=32, lightning_nkv=32)
    raw = tiny_config_dict(**SPARSE_AT_256, **heads, lightning_head_dim=16)
    model = load_model(write_tiny_checkpoint(tmp_path, raw), dtype="float32")
    n, chunk = 2048, 512
    plan = memory.plan_memory(
        model.config, weights=memory.weights_bytes(model), doc_tokens=n, chunk=chunk, batch=0,
        row_tokens=0, itemsize=4, gpu=gpu,
    )  # fmt: skip
    ids = np.random.default_rng(n).integers(3, 256, size=n).tolist()
    added = []  # beyond what MLX held before: the weights, and other tests' arrays
    for bound in (lambda: memory.bounded(plan), lambda: _limit(1)):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        with bound():
            prefill(model, ids, model.make_cache(), chunk=chunk)
        added.append(mx.get_peak_memory() - base)
    assert max(added) <= plan.peak - plan.weights, ([a / 2**20 for a in added], plan)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-path", "gpu-path"])
def test_a_layers_cache_writes_are_computed_with_it(tmp_path, monkeypatch, gpu):
    """What a layer writes to its cache (a lightning layer's new state) is computed with the
    layer, so the temporaries it reads are freed with the layer's: MLX computes a branch that no
    later op reads after all the others, and held each lightning layer's chunk states until the
    last layer (at the 9B's heads: 67 MB a layer and 2K chunk on the CPU path, 0.5 GB a layer
    and 8K chunk on the GPU path's). A prefill's necessary memory (a 1-byte limit) with 24
    lightning layers before its sparse one is that with 2 (was ~5 and ~11 MB more)."""
    if gpu:
        monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    heads = dict(num_attention_heads=32, head_dim=16, lightning_nh=32, lightning_nkv=32)
    ids = np.random.default_rng(0).integers(3, 256, size=1024).tolist()
    added = []
    for n in (2, 24):
        raw = tiny_config_dict(mixers=(L,) * n + (S,), **heads, lightning_head_dim=16)
        model = load_model(write_tiny_checkpoint(tmp_path / str(n), raw), dtype="float32")
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        cache = model.make_cache()
        with _limit(1):
            prefill(model, ids, cache, chunk=512)
        held = mx.get_active_memory() - base  # the caches and the last logits
        added.append(mx.get_peak_memory() - base - held)
    chunk_states = 2 * (512 // gla.CHUNK) * 32 * 16 * 16 * 4  # a layer's start states, own parts
    assert added[1] - added[0] < 4 * chunk_states, [a / 2**20 for a in added]


@contextmanager
def _limit(n: int):
    previous = mx.set_memory_limit(n)
    try:
        yield
    finally:
        mx.set_memory_limit(previous)
