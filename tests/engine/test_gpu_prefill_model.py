"""The model's invariants on the GPU path, run on any device (`SALABATCH_GPU_PATH=1`): golden
vectors in float32 in one call and in planned chunks, chunked sparse prefill equal to one call
(the stage-1 quirk lengths too), questions prefilled on forks of a sparse document equal to each
alone, and no host round trip in a chunked sparse prefill. Their CPU path twins are test_golden,
test_model, test_batching and test_no_host_sync."""

from __future__ import annotations

import pytest

from salabatch.engine.load import load_model
from tests.engine import test_batching as batching
from tests.engine import test_golden as golden
from tests.engine import test_model
from tests.engine import test_no_host_sync as host_sync


@pytest.fixture(autouse=True)
def gpu_path(monkeypatch):
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")


@pytest.fixture(scope="module")
def golden_model(golden_dir):
    return load_model(golden_dir, dtype="float32")


def test_golden_short_dense(golden_model, golden_dir):
    golden.test_short_dense(golden_model, golden_dir)


def test_golden_cross_dense_len(golden_model, golden_dir):
    golden.test_cross_dense_len(golden_model, golden_dir)


@pytest.mark.parametrize("chunk", [None, 1000], ids=["one-call", "1000"])
def test_golden_long_sparse(golden_model, golden_dir, chunk):
    golden.test_long_sparse(golden_model, golden_dir, chunk)


sparse_model = test_model.sparse_model
model = host_sync.model  # the same tiny sparse-from-256 checkpoint as test_batching's


@pytest.mark.parametrize(
    ("length", "chunk"),
    [(700, 100), (655, 64), (703, 250), (641, 333)],
    ids=["odd", "quirk-16", "quirk-64", "block-edge+1"],
)
def test_sparse_chunked_prefill_equals_one_call(sparse_model, length, chunk):
    test_model.test_sparse_chunked_prefill_equals_one_call(sparse_model, length, chunk)


def test_shared_prefix_batch_equals_each_alone(model):
    batching.test_shared_prefix_batch_equals_each_alone(model, 700, "sparse")


def test_chunked_sparse_prefill_and_decode_stay_on_the_device(model, monkeypatch):
    host_sync.test_chunked_sparse_prefill_and_decode_stay_on_the_device(
        model, monkeypatch, "default"
    )
