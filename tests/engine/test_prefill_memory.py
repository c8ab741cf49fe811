"""A chunked prefill's memory beyond its caches does not grow with the document: stage-1 score
tiles, stage-2 tiles and dense attention tiles are all bounded (here shrunk so that a tiny
model meets the bounds at a few thousand tokens)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.generate import prefill
from salabatch.engine.kernels import attention, sparse_attention, sparse_select
from salabatch.engine.load import load_model
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint


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
