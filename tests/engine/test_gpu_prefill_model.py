"""The model's invariants on the GPU path, run on any device (`SALABATCH_GPU_PATH=1`): chunked
sparse prefill equal to one call (the stage-1 quirk lengths too, and chunks below a dense_len
where sparse is not dense) and questions prefilled on forks of a sparse document equal to each
alone. Their CPU path twins are in test_model and test_batching; the golden vectors and the
no-host-sync tests run on both paths themselves."""

from __future__ import annotations

import mlx.core as mx
import pytest

from salabatch.engine.generate import prefill
from tests.engine import test_batching as batching
from tests.engine import test_model
from tests.engine import test_no_host_sync as host_sync


@pytest.fixture(autouse=True)
def gpu_path(monkeypatch):
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")


sparse_model = test_model.sparse_model
sparse_from_512 = test_model.sparse_from_512
model = host_sync.model  # the same tiny sparse-from-256 checkpoint as test_batching's


@pytest.mark.parametrize(
    ("length", "chunk"),
    [(700, 100), (655, 64), (703, 250), (641, 333)],
    ids=["odd", "quirk-16", "quirk-64", "block-edge+1"],
)
def test_sparse_chunked_prefill_equals_one_call(sparse_model, length, chunk):
    test_model.test_sparse_chunked_prefill_equals_one_call(sparse_model, length, chunk)


@pytest.mark.parametrize(("length", "chunk"), [(700, 100), (1000, 128)], ids=["odd", "store"])
def test_sparse_chunks_below_dense_len_run_sparse_as_one_call(sparse_from_512, length, chunk):
    test_model.test_sparse_chunks_below_dense_len_run_sparse_as_one_call(
        sparse_from_512, length, chunk
    )


def test_shared_prefix_batch_equals_each_alone(model):
    batching.test_shared_prefix_batch_equals_each_alone(model, 700, "sparse")


def test_prefill_queues_each_layer_and_gives_the_same_logits(sparse_model, monkeypatch):
    """On the GPU path `prefill` queues every layer of a chunk as it is built (the device runs
    it while the host builds the next), and the queued chunks give one call's logits."""
    ids = test_model.prompt(700, seed=8)
    whole = sparse_model(ids)[0, -1]
    queued = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: queued.append(len(a)) or real(*a))
    logits = prefill(sparse_model, ids[0].tolist(), sparse_model.make_cache(), chunk=256)
    assert len(queued) == 3 * len(sparse_model.layers)  # three chunks, every layer
    assert mx.abs(logits - whole).max().item() < test_model.TOL_CHUNKED
