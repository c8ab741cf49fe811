"""Batches of rows at different positions, sharing a document prefix or not: every row gets
what it would get alone, in dense and in sparse (InfLLM-v2) mode, and the shared keys are stored
once."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.cache import LightningCache, ModelCache
from salabatch.engine.load import load_model
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint

TOL = 1e-4


def tokens(n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(3, 256, size=(1, n)), dtype=mx.int32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("b"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


def alone(model, doc, suffix, steps):
    """Reference: one row, no sharing: document, its question, then one token per step."""
    cache = model.make_cache()
    model(doc, cache)
    out = [model(suffix, cache)[:, -1]]
    out += [model(t[None, None], cache)[:, -1] for t in steps]
    return out


def batched(model, doc, suffixes, steps):
    """Document once; each question prefilled on its own fork; then all decode as one batch."""
    doc_cache = model.make_cache()
    model(doc, doc_cache)
    rows, first = [], []
    for suffix in suffixes:
        row = doc_cache.fork(1)
        first.append(model(suffix, row)[:, -1])
        rows.append(row)
    batch = ModelCache.concat(rows)
    out = [mx.concatenate(first)]
    for step in zip(*steps, strict=True):
        out.append(model(mx.array(step, dtype=mx.int32)[:, None], batch)[:, -1])
    return out, batch, doc_cache


@pytest.mark.parametrize(
    ("doc_len", "label"), [(120, "dense"), (700, "sparse"), (230, "crosses dense_len")]
)
def test_shared_prefix_batch_equals_each_alone(model, doc_len, label):
    doc = tokens(doc_len, seed=doc_len)
    lengths = [3, 11, 1, 40]  # questions of different lengths
    suffixes = [tokens(n, seed=100 + i) for i, n in enumerate(lengths)]
    steps = [np.random.default_rng(7 + i).integers(3, 256, size=12).tolist() for i in range(4)]
    got, batch, _ = batched(model, doc, suffixes, steps)
    assert batch.positions == [doc_len + n + 12 for n in lengths]
    for b, suffix in enumerate(suffixes):
        want = alone(model, doc, suffix, mx.array(steps[b], dtype=mx.int32))
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            assert mx.abs(g[b] - w[0]).max().item() < TOL, f"row {b}, step {t} ({label})"


def test_shared_keys_are_stored_once(model):
    """8 rows over a 2000-token document hold the document's keys once (assert on bytes held and
    on memory allocated), plus per-row tails under 128 positions (in 256-position buffers)."""
    doc_cache = model.make_cache()
    model(tokens(2000, seed=1), doc_cache)
    sparse = model.config.sparse_layers
    doc_bytes = sum(doc_cache[i].nbytes for i in sparse)
    mx.eval(*[doc_cache[i].keys.data for i in sparse])
    before = mx.get_active_memory()
    batch = doc_cache.fork(8)
    mx.eval(*[a for i in sparse for a in (batch[i].keys.data, batch[i].shared.keys)])
    allocated = mx.get_active_memory() - before
    tails = sum(batch[i].nbytes for i in sparse)
    for i in sparse:
        assert max(batch[i].keys.lengths) < 128
        assert batch[i].shared.start == 1920  # 64 · N2(2000): whole level-2 chunks only
    assert tails < doc_bytes  # 8 rows of tails together are smaller than one document
    assert allocated < doc_bytes  # the shared keys are a view of the document's buffers
    assert (
        batch.nbytes - sum(c.nbytes for c in batch if isinstance(c, LightningCache)) < 2 * doc_bytes
    )
    for i in range(len(model.config.layer_kinds)):
        if i not in sparse:
            assert isinstance(batch[i], LightningCache) and batch[i].state.shape[0] == 8


@pytest.mark.parametrize(("doc_len", "label"), [(128, "dense"), (512, "sparse")])
def test_document_that_fills_its_buffers(model, doc_len, label):
    """A document of exactly a buffer's capacity (`sparse_cache.capacity`) is written to its
    buffers whole, which MLX does by keeping the written keys themselves (a transposed view);
    its forks read them as shared keys at every step, and the CPU's native step reads buffers
    where they lie, one contiguous run per key row. What `bench long` does at 1K tokens."""
    doc = tokens(doc_len, seed=doc_len)
    suffixes = [tokens(n, seed=300 + n) for n in (16, 5)]
    steps = [np.random.default_rng(40 + i).integers(3, 256, size=4).tolist() for i in range(2)]
    got, _, _ = batched(model, doc, suffixes, steps)
    for b, suffix in enumerate(suffixes):
        want = alone(model, doc, suffix, mx.array(steps[b], dtype=mx.int32))
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            assert mx.abs(g[b] - w[0]).max().item() < TOL, f"row {b}, step {t} ({label})"


def test_forks_of_one_document_share_one_shared_keys_object(model):
    doc_cache = model.make_cache()
    model(tokens(300, seed=2), doc_cache)
    a, b = doc_cache.fork(1), doc_cache.fork(2)
    for i in model.config.sparse_layers:
        assert a[i].shared is b[i].shared
    assert ModelCache.concat([a, b]).rows == 3


def test_rows_over_different_shared_keys_do_not_join(model):
    """A batch reads one set of shared keys: forks made after the document grew, and caches with
    no shared keys, cannot join earlier forks (concat refuses rather than mixing them)."""
    doc_cache = model.make_cache()
    model(tokens(300, seed=4), doc_cache)
    early = doc_cache.fork(1)
    model(tokens(5, seed=5), doc_cache)
    late = doc_cache.fork(1)
    for i in model.config.sparse_layers:
        assert late[i].shared is not early[i].shared
    fresh = model.make_cache()
    model(tokens(300, seed=4), fresh)
    for other in (late, fresh):
        with pytest.raises(ValueError, match="same shared keys"):
            ModelCache.concat([early, other])


def test_rows_leave_and_join(model, engine_path):
    """A finished row leaves (select) and a waiting one joins (concat) without disturbing others,
    on either path."""
    doc = tokens(500, seed=3)
    suffixes = [tokens(n, seed=200 + n) for n in (4, 9, 2)]
    steps = [np.random.default_rng(30 + i).integers(3, 256, size=6).tolist() for i in range(3)]
    doc_cache = model.make_cache()
    model(doc, doc_cache)
    rows = []
    for suffix in suffixes[:2]:
        row = doc_cache.fork(1)
        model(suffix, row)
        rows.append(row)
    batch = ModelCache.concat(rows)
    for t in range(3):
        model(mx.array([[steps[0][t]], [steps[1][t]]], dtype=mx.int32), batch)
    batch = batch.select([1])  # row 0 finished
    late = doc_cache.fork(1)
    model(suffixes[2], late)
    batch = ModelCache.concat([batch, late])  # row 2 joins
    last = None
    for t in range(3):
        ids = mx.array([[steps[1][3 + t]], [steps[2][t]]], dtype=mx.int32)
        last = model(ids, batch)[:, -1]
    want1 = alone(model, doc, suffixes[1], mx.array(steps[1], dtype=mx.int32))[-1]
    want2 = alone(model, doc, suffixes[2], mx.array(steps[2][:3], dtype=mx.int32))[-1]
    assert mx.abs(last[0] - want1[0]).max().item() < TOL
    assert mx.abs(last[1] - want2[0]).max().item() < TOL


def test_unrelated_prompts_of_different_lengths(model, engine_path):
    """Many short documents: separate prompts, one batch; rows on both sides of dense_len, on
    either path (on the GPU path rows with no shared keys that end at different lengths are
    each masked as their own, not with the fused causal mask of rows that end together)."""
    prompts = [tokens(n, seed=n) for n in (40, 250, 300, 7)]
    steps = [np.random.default_rng(50 + i).integers(3, 256, size=10).tolist() for i in range(4)]
    caches = []
    for p in prompts:
        c = model.make_cache()
        model(p, c)
        caches.append(c)
    batch = ModelCache.concat(caches)
    outs = [
        model(mx.array(s, dtype=mx.int32)[:, None], batch)[:, -1] for s in zip(*steps, strict=True)
    ]
    for b, p in enumerate(prompts):
        c = model.make_cache()
        model(p, c)
        for t, tok in enumerate(steps[b]):
            want = model(mx.array([[tok]], dtype=mx.int32), c)[:, -1]
            assert mx.abs(outs[t][b] - want[0]).max().item() < TOL, f"row {b} step {t}"


def test_a_sparse_row_beside_dense_rows_decodes_as_alone_in_bfloat16(tmp_path):
    """A decode step (T = 1) whose rows sit on both sides of dense_len: the sparse row takes the
    same kernels as its step alone, so in bfloat16 its logits do not depend on its company (it
    took the prefill's block selection and attention, 6e-3 apart: greedy speculation, whose
    passes break into such steps at dense_len, then left plain greedy decoding's tokens)."""
    path = write_tiny_checkpoint(tmp_path, tiny_config_dict(**SPARSE_AT_256))
    model = load_model(path, dtype="bfloat16")
    doc = model.make_cache()
    model(tokens(250, 1), doc)
    fed = tokens(6, 2)
    mixed, one = doc.fork(2), doc.fork(1)
    point = mixed.checkpoint()
    model(mx.concatenate([fed, fed]), mixed)
    mixed.rollback(point, [5, 0])  # row 0 at 255, its step reaches dense_len; row 1 at 250
    model(fed[:, :5], one)
    step = fed[:, 5:]
    together = model(mx.concatenate([step, tokens(1, 3)]), mixed)[0, -1]
    assert mx.array_equal(together, model(step, one)[0, -1])
