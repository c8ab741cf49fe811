"""What a run will hold, planned before it holds it (salabatch.engine.memory): the document
cache follows the capacity buckets, a chunk's temporaries do not grow with the context, the
buffer cache is what a chunk reuses (never a share of RAM), and a plan that does not fit is
refused in one line naming both figures."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from salabatch.engine import memory
from salabatch.engine.config import ModelConfig
from salabatch.engine.load import load_model
from salabatch.engine.sparse_cache import capacity
from salabatch.errors import OutOfMemoryError
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("m"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


def test_a_document_cache_is_what_the_prefill_allocates(model):
    """The planned bytes of a document equal a prefilled cache's buffers."""
    n = 1500
    cache = model.make_cache()
    cache.plan_prefill(n)
    model(mx.zeros((1, n), dtype=mx.int32), cache)
    held = sum(c.nbytes for c in cache)
    assert memory.document_bytes(model.config, n, 4) == held
    assert capacity(n) == 1536


def test_the_chunk_and_the_buffer_cache_do_not_grow_with_the_context(model):
    cfg = model.config
    short, long = (
        memory.plan_memory(
            cfg, weights=0, doc_tokens=n, chunk=2048, batch=8, row_tokens=300, itemsize=4, gpu=False
        )  # fmt: skip
        for n in (10_000, 1_000_000)
    )
    assert short.transient == long.transient and long.document > 50 * short.document
    limit = memory.cache_limit(cfg, 2048, gpu=False)
    assert memory.MIN_CACHE <= limit < 1 << 30  # a tile per lane and the activations
    assert memory.cache_limit(cfg, 8192, gpu=False) > limit  # wider chunks, more activations


def test_a_plan_that_does_not_fit_is_refused_naming_both(model):
    plan = memory.plan_memory(
        model.config, weights=memory.weights_bytes(model), doc_tokens=50_000, chunk=2048,
        batch=8, row_tokens=400, itemsize=4, gpu=False,
    )  # fmt: skip
    memory.check(plan, free=plan.peak)  # fits: the weights are loaded already
    with pytest.raises(OutOfMemoryError, match=r"needs .* GB more .* and 0\.10 GB is free"):
        memory.check(plan, free=int(0.1 * memory.GB))
    # a shortfall under what two decimals of GB show is said in MB, never "needs X and X free"
    needs = plan.peak - plan.weights
    with pytest.raises(OutOfMemoryError) as e:
        memory.check(plan, free=needs - (1 << 20))
    needed, free = re.findall(r"needs (\S+ MB) more .* and (\S+ MB) is free", str(e.value))[0]
    assert needed != free


def test_checkpoint_weights_are_counted_without_loading(model):
    cfg = ModelConfig.from_file(model.path / "config.json")
    assert memory.checkpoint_weights_bytes(model.path, cfg, 4) == memory.weights_bytes(model)


def test_a_chunk_wider_than_the_work_is_planned_as_the_work(model):
    """prefill_chunk 2,000,000 planned its temporaries whole: short work was refused as needing
    tens of GB. No call is fed more than the document or a batch of the longest rows."""

    def plan(chunk, doc_tokens=6_000, rows=(300,) * 8):
        return memory.answer_plan(
            model.config, weights=0, doc_tokens=doc_tokens, rows=list(rows), chunk=chunk,
            batch_size=8, itemsize=4, gpu=True,
        )  # fmt: skip

    whole = memory.plan_memory(
        model.config, weights=0, doc_tokens=6_000, chunk=2_000_000, batch=8, row_tokens=300,
        itemsize=4, gpu=True,
    )  # fmt: skip
    assert plan(2_000_000).transient == plan(6_000).transient < whole.transient / 3
    pooled = plan(2_000_000, doc_tokens=0, rows=(900,) * 8)  # 8 whole prompts fed at once
    assert pooled.transient == plan(8 * 900, doc_tokens=0, rows=(900,) * 8).transient
