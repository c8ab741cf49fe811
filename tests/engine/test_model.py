"""Model invariants on tiny random checkpoints: chunked == whole, batch == single, any layout."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.load import load_model
from tests.tiny import SPARSE_AT_256, SPARSE_AT_512, L, S, tiny_config_dict, write_tiny_checkpoint

TOL_CHUNKED = 1e-4  # issue 2: chunked prefill equals one call within 1e-4 (fp32)
TOL_DENSE_VS_SPARSE = 1e-3  # at least this apart: dense and 4-block attention (2-4e-2 measured)


def prompt(n: int, seed: int = 0, vocab: int = 256) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(3, vocab, size=(1, n)), dtype=mx.int32)


def chunked_logits(model, ids: mx.array, chunk: int) -> mx.array:
    cache = model.make_cache()
    parts = [model(ids[:, s : s + chunk], cache) for s in range(0, ids.shape[1], chunk)]
    return mx.concatenate(parts, axis=1)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, dtype="float32")


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunked_prefill_equals_one_call(tiny, chunk):
    ids = prompt(300)
    whole = tiny(ids, tiny.make_cache())
    diff = mx.abs(chunked_logits(tiny, ids, chunk) - whole).max().item()
    assert diff < TOL_CHUNKED


def test_prefill_then_decode_continues(tiny):
    """Logits at position t do not depend on how many tokens come after (causality)."""
    ids = prompt(130, seed=1)
    whole = tiny(ids)
    head = tiny(ids[:, :129])
    assert mx.abs(whole[:, :129] - head).max().item() < TOL_CHUNKED


def test_batch_equals_single(tiny):
    a, b = prompt(150, seed=2), prompt(150, seed=3)
    batch = tiny(mx.concatenate([a, b]), tiny.make_cache())
    assert mx.abs(batch[0:1] - tiny(a)).max().item() < TOL_CHUNKED
    assert mx.abs(batch[1:2] - tiny(b)).max().item() < TOL_CHUNKED
    # and continuing the batch one token at a time keeps them apart
    cache = tiny.make_cache()
    tiny(mx.concatenate([a[:, :149], b[:, :149]]), cache)
    step = tiny(mx.concatenate([a[:, 149:], b[:, 149:]]), cache)
    assert mx.abs(step[:, 0] - batch[:, 149]).max().item() < TOL_CHUNKED


@pytest.mark.parametrize(
    "mixers",
    [(L, S, L), (S, S), (L, L, L), (L, L, S, L)],
    ids=["lightning-first", "all-sparse", "all-lightning", "sparse-last"],
)
def test_any_layer_layout(tmp_path, mixers):
    model = load_model(write_tiny_checkpoint(tmp_path, tiny_config_dict(mixers)), dtype="float32")
    ids = prompt(90, seed=4)
    whole = model(ids)
    assert whole.shape == (1, 90, 256)
    assert mx.abs(chunked_logits(model, ids, 13) - whole).max().item() < TOL_CHUNKED


def test_lightning_state_is_float32_in_bf16(tiny_dir):
    model = load_model(tiny_dir, dtype="bfloat16")
    cache = model.make_cache()
    logits = model(prompt(20), cache)
    assert logits.dtype == mx.bfloat16
    states = [c.state for c in cache if hasattr(c, "state")]
    assert states and all(s.dtype == mx.float32 for s in states)
    f32 = load_model(tiny_dir, dtype="float32")(prompt(20))
    # bf16 is a coarse approximation of the float32 model, not a different one
    rel = mx.sqrt(mx.mean((logits.astype(mx.float32) - f32) ** 2) / mx.mean(f32**2)).item()
    assert rel < 0.05


# -- sparse (InfLLM-v2) mode: a config whose sparse layers switch at 256 tokens ----------------


@pytest.fixture(scope="module")
def sparse_model(tmp_path_factory):
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("sparse"), tiny_config_dict(**SPARSE_AT_256)
    )
    return load_model(path, dtype="float32")


@pytest.fixture(scope="module")
def sparse_from_512(tmp_path_factory):
    """Sparse from 512 tokens, 4 blocks a query: below dense_len InfLLM-v2 is not dense."""
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("sparse512"), tiny_config_dict(**SPARSE_AT_512)
    )
    return load_model(path, dtype="float32")


def planned_chunks(model, ids, chunk, trace=False):
    cache = model.make_cache()
    cache.plan_prefill(ids.shape[1])
    for i in model.config.sparse_layers:
        cache[i].trace = [] if trace else None
    parts = [model(ids[:, s : s + chunk], cache) for s in range(0, ids.shape[1], chunk)]
    return mx.concatenate(parts, axis=1), cache


@pytest.mark.parametrize(
    ("length", "chunk"),
    [(700, 100), (655, 64), (703, 250), (640, 1), (641, 333)],
    ids=["odd", "quirk-16", "quirk-64", "block-edge-tokenwise", "block-edge+1"],
)
def test_sparse_chunked_prefill_equals_one_call(sparse_model, length, chunk):
    """Planned chunked prefill equals one call, also at the stage-1 quirk lengths
    (L ≡ 15 mod 16, L ≡ 63 mod 64), where one call hides an extra compressed chunk."""
    ids = prompt(length, seed=length)
    whole = sparse_model(ids)
    chunked, _ = planned_chunks(sparse_model, ids, chunk)
    assert mx.abs(chunked - whole).max().item() < TOL_CHUNKED


@pytest.mark.parametrize(
    ("length", "chunk"), [(700, 100), (1000, 128), (600, 1)], ids=["odd", "store", "tokenwise"]
)
def test_sparse_chunks_below_dense_len_run_sparse_as_one_call(sparse_from_512, length, chunk):
    """A prompt of ≥ dense_len tokens runs InfLLM-v2 from its first token on (SPEC P7), in
    chunks too: its planned chunks below dense_len (512) run sparse, where a query at 256-511
    attends 4 of its 5-8 blocks; a prompt under dense_len runs dense, and that differs."""
    ids = prompt(length, seed=length)
    whole = sparse_from_512(ids)
    chunked, _ = planned_chunks(sparse_from_512, ids, chunk)
    assert mx.abs(chunked - whole).max().item() < TOL_CHUNKED
    dense = sparse_from_512(ids[:, :511])  # the same tokens as a prompt under dense_len
    assert mx.abs(dense - whole[:, :511]).max().item() > TOL_DENSE_VS_SPARSE


def test_sparse_mode_really_selects(sparse_model):
    """Above dense_len fewer blocks than the history are attended, so results differ from a
    model whose sparse layers stay dense — the sparse path is not silently dense."""
    ids = prompt(700, seed=5)
    _, cache = planned_chunks(sparse_model, ids, 700, trace=True)
    idx = cache[sparse_model.config.sparse_layers[0]].trace[0]
    assert idx.shape[-1] == 4  # topk + window/block
    last = np.array(idx)[0, :, -1]  # the last query's selection per kv head
    assert all((row >= 0).sum() == 4 for row in last)  # 4 of its 11 blocks
    assert 0 in last[0] and 10 in last[0]  # init block and its own block are forced


def test_decode_switches_to_sparse_at_dense_len(sparse_model):
    """Prompt below dense_len, then token-by-token decode: dense while the total length is
    < 256, InfLLM-v2 from a total of exactly 256 on (SPEC P7); the prompt part equals one call."""
    ids = prompt(300, seed=6)
    layer = sparse_model.config.sparse_layers[0]
    cache = sparse_model.make_cache()
    cache[layer].trace = []
    head = sparse_model(ids[:, :250], cache)
    assert mx.abs(head - sparse_model(ids[:, :250])).max().item() < TOL_CHUNKED
    assert cache[layer].trace == []
    for t in range(250, 300):
        before = len(cache[layer].trace)
        logits = sparse_model(ids[:, t : t + 1], cache)
        assert (len(cache[layer].trace) > before) == (t + 1 >= 256), f"total length {t + 1}"
        assert mx.isfinite(logits).all().item()


@pytest.mark.parametrize(
    "mixers", [(L, S, L), (S, S), (L, L, S)], ids=["lightning-first", "all-sparse", "sparse-last"]
)
def test_any_layer_layout_in_sparse_mode(tmp_path, mixers):
    raw = tiny_config_dict(mixers, **SPARSE_AT_256)
    model = load_model(write_tiny_checkpoint(tmp_path, raw), dtype="float32")
    ids = prompt(400, seed=8)
    whole = model(ids)
    chunked, _ = planned_chunks(model, ids, 150)
    assert mx.abs(chunked - whole).max().item() < TOL_CHUNKED
