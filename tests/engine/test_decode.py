"""The compiled decode step (salabatch.engine.decode), what a GPU runs: the same logits as the
per-layer step, one trace per shape (not per document or step), and its kernel count at the
9B's layer layout beside the dense peer's, counted as a GPU runs them (salabatch.bench.graph).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_unflatten

from salabatch.bench.graph import (
    decode_step,
    filled_model_cache,
    kernels,
    peer_decode_step,
    sala_model,
    verify_pass,
)
from salabatch.engine.cache import ModelCache
from salabatch.engine.decode import decode
from salabatch.engine.generate import Generator, Request, prefill
from salabatch.engine.load import load_model
from tests.tiny import SPARSE_AT_256, SPARSE_AT_512, tiny_config_dict, write_tiny_checkpoint

TOL = 1e-5  # float32: the two steps differ by summation order only
KERNELS_PER_STEP = 700  # the budget for one decode step at the 9B's layout


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("d"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


@pytest.fixture(scope="module")
def model_512(tmp_path_factory):
    """Sparse from 512 tokens: a query at 256-511 sees more blocks than the 4 it attends."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("d512"), tiny_config_dict(**SPARSE_AT_512))
    return load_model(path, dtype="float32")


def tokens(n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(3, 256, size=(1, n)), dtype=mx.int32)


def rows_over(model, doc_len: int | None, suffixes=(5, 17, 2)) -> ModelCache:
    """Rows forked from one prefilled document (doc_len tokens), or, without one, rows each
    with its own prompt; each continued by its own question."""
    doc = None
    if doc_len is not None:
        doc = model.make_cache()
        model(tokens(doc_len, 1), doc)
    rows = []
    for i, n in enumerate(suffixes):
        row = model.make_cache() if doc is None else doc.fork(1)
        model(tokens(n if doc is not None else 40 * n, 10 + i), row)
        rows.append(row)
    batch = ModelCache.concat(rows)
    mx.eval(batch.arrays())
    return batch


@pytest.mark.parametrize(
    "doc_len, label",
    [
        (100, "dense"),
        (230, "crosses dense_len"),
        (700, "sparse"),
        (None, "own prompts"),
        (490, "crosses dense_len 512"),  # rows at 492-507, each sparse from its token 512 on
    ],
)
def test_compiled_step_equals_the_per_layer_step(request, doc_len, label, monkeypatch):
    """The rows of `crosses dense_len 512` turn sparse at different steps, where sparse is not
    dense (`SPARSE_AT_512`); at dense_len 256 the query that turns sparse sees just the 4 blocks
    it selects, so a step that turned one token late would give the same logits."""
    model = request.getfixturevalue("model_512" if "512" in label else "model")
    per_layer, compiled = rows_over(model, doc_len), rows_over(model, doc_len)
    steps = np.random.default_rng(3).integers(3, 256, size=(40, 3))
    for t in range(40):
        ids = mx.array(steps[t], dtype=mx.int32)
        want = decode(model, ids, per_layer)
        monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
        got = decode(model, ids, compiled)
        monkeypatch.delenv("SALABATCH_GPU_PATH")
        mx.eval(want, got, per_layer.arrays(), compiled.arrays())
        assert mx.abs(got - want).max().item() < TOL, f"step {t} ({label})"
    assert compiled.positions == per_layer.positions
    # the chunks the compiled steps left uncompressed catch up where they are read
    for i in model.config.sparse_layers:
        for level in (0, 1):
            a, b = (c[i].chunk_parts(level)[-1] for c in (per_layer, compiled))
            for row, n in enumerate(per_layer[i].compressed[level].lengths):
                assert compiled[i].compressed[level].lengths[row] == n
                gap = mx.abs(a[row, :, :n] - b[row, :, :n])  # the keys differ by rounding only
                assert not n or gap.max().item() < TOL, f"layer {i} row {row}"


def test_weights_loaded_after_fusing_are_used(model, monkeypatch):
    """Loading weights drops the fused projections (they would be stale): the step then runs
    each projection on its own, with the new weights; fused again, it runs the new weights
    fused, and gives the same logits."""
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    other = load_model(model.path, dtype="float32")
    up = other.layers[1].mlp.up_proj.weight
    other.update(  # a weight the fused buffers hold, and one they do not
        tree_unflatten(
            [
                ("model.layers.1.mlp.up_proj.weight", up * 0.5),
                ("model.norm.weight", other.model.norm.weight * 0.5),
            ]
        )
    )
    assert all(layer.step_weights() == ((), ()) for layer in other.layers)
    ids = mx.array([7, 9, 11], dtype=mx.int32)
    unfused = decode(other, ids, rows_over(other, 300))
    assert not mx.allclose(decode(model, ids, rows_over(model, 300)), unfused)
    other.fuse()  # fused again, from the new weights: the same step as the unfused one
    fused = decode(other, ids, rows_over(other, 300))
    assert all(layer.step_weights() != ((), ()) for layer in other.layers)
    assert mx.abs(fused - unfused).max().item() < TOL


@pytest.fixture(scope="module")
def nine_b_layout():
    """The 9B's 32 layers at a small width and fewer heads (8 of 32, 2 kv of 32 each): what
    these steps trace does not depend on the widths, and they run 300 of them."""
    return sala_model(mx.float32, heads=dict(heads=8, kv_heads=2, head_dim=32))


def test_one_trace_per_shape_not_per_document_or_step(nine_b_layout, monkeypatch):
    """Sparse decode past dense_len (8192): 300 steps, then a second document of another length
    (capacities in the same bucket: `sparse_cache.capacity`), add no trace; each batch size
    traces once."""
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    model = nine_b_layout
    step = model.decoder
    first = filled_model_cache(model, 9_000).fork(2)
    first.reserve(128 + 400)  # a fork's tail (< 128) and 400 more, as the Generator reserves
    ids = mx.array([5, 6], dtype=mx.int32)
    decode(model, ids, first)
    traced = step.traces
    for _ in range(300):  # built, not run: a trace depends on shapes only
        decode(model, ids, first)
    assert step.traces == traced, "300 steps retraced"
    del first
    second = filled_model_cache(model, 9_311).fork(2)
    second.reserve(128 + 400)
    mx.eval(decode(model, ids, second))
    assert step.traces == traced, "a second document retraced"
    for rows in (1, 3, 8):
        batch = filled_model_cache(model, 9_000).fork(rows)
        batch.reserve(128 + 400)
        for _ in range(3):
            mx.eval(decode(model, mx.zeros((rows,), dtype=mx.int32), batch))
        assert step.traces == traced + 1, f"batch size {rows} traced more than once"
        traced = step.traces


@pytest.mark.parametrize(("rows", "dtype"), [(1, mx.bfloat16), (8, mx.bfloat16), (1, mx.float32)])
def test_decode_step_kernels_at_the_9b_layout(rows, dtype):
    """≤ 700 kernels per step at 32K tokens (InfLLM-v2 in every sparse layer), batch 1 and 8,
    in bf16 as a GPU runs the 9B, and in float32, with MLX's ops (what Metal runs); the dense
    peer (mlx-lm's llama at Qwen3-8B's 36 layers) counted the same way builds ~615, the issue's
    count. A model of its own: a step traced under `gpu_graph` keeps its stand-in ops."""
    model = sala_model(dtype)
    batch = filled_model_cache(model, 32_768).fork(rows)
    batch.reserve(128 + 64)
    sala = kernels(decode_step(model, batch)[0])
    assert sala <= KERNELS_PER_STEP, f"{sala} kernels per step"
    peer = peer_decode_step(4096, dtype)
    if peer is not None:
        assert 550 <= kernels(peer) <= 680, f"the peer counted {kernels(peer)}, not as the issue"


def test_the_decode_kernels_take_a_chain_of_kernels_out_of_a_step():
    """On CUDA with the custom kernels (each launch one node), a sparse layer's selection
    after its shared chunks' scores is one launch instead of eighteen MLX ops, and its stage 2
    two instead of eleven; a lightning layer's q, k norms, rope, state update and read-out one
    instead of six; each residual add one launch with the norm after it: at the 9B's layout
    and 32K, bf16 (as a GPU runs it), 27 kernels fewer a sparse layer and 6 a lightning layer
    than CUDA's MLX ops, and under the budget. With MLX's ops, CUDA's MLP residual add is a
    kernel of its own (`linear.add_product`): one a layer more than on Metal."""
    model = sala_model(mx.bfloat16)
    batch = filled_model_cache(model, 32_768).fork(1)
    batch.reserve(128 + 64)
    metal = kernels(decode_step(model, batch)[0])
    mlx_ops = kernels(decode_step(model, batch, cuda=True, custom_kernels=False)[0])
    cuda = kernels(decode_step(model, batch, cuda=True)[0])
    assert mlx_ops == metal + len(model.layers)
    sparse = len(model.config.sparse_layers)
    assert cuda <= mlx_ops - 27 * sparse - 6 * (len(model.layers) - sparse)
    assert cuda <= KERNELS_PER_STEP


def test_a_verify_pass_is_counted_as_the_gpu_runs_it():
    """A speculative verify pass of 5 positions builds under `gpu_graph` without evaluating a
    stand-in op, leaves the cache it forks as it was, and costs more kernels than a step (its
    per-layer graphs are not the compiled step's: what `bench long --graph` reports)."""
    model = sala_model(mx.float32)
    cache = filled_model_cache(model, 4096).fork(1)
    cache.reserve(128 + 64)
    before = (list(cache.positions), [a.shape for a in cache.arrays()])
    counts, _ = verify_pass(model, cache)
    assert (list(cache.positions), [a.shape for a in cache.arrays()]) == before
    assert kernels(counts) > kernels(decode_step(model, cache)[0])


def test_generator_on_the_gpu_path_answers_as_on_the_cpu(model, monkeypatch):
    """Greedy answers of a batch over a sparse document: the same tokens either way."""
    doc = model.make_cache()
    prefill(model, tokens(600, 4)[0].tolist(), doc)
    lengths = [5, 17, 1, 9]
    requests = [
        Request(f"q{i}", tuple(tokens(n, 40 + i)[0].tolist()), max_tokens=24)
        for i, n in enumerate(lengths)
    ]

    def answers():
        return {
            g.request.id: g.tokens for g in Generator(model, batch_size=3).generate(requests, doc)
        }

    native = answers()
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    assert answers() == native


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_decodes_in_sparse_mode_on_the_cpu(tmp_path, dtype):
    """MLX's CPU gather_mm takes float32 only, and `exp2_poly`'s rounding trick is float32's: a
    bf16 or f16 model on the CPU (asked for by `engine.dtype`) decodes sparse rows all the same
    (`attention.gather_products`, the softmax in float32), as the float32 model does to half
    precision's rounding (f16 gave NaN, bf16 1.5 % off before)."""
    path = write_tiny_checkpoint(tmp_path, tiny_config_dict(**SPARSE_AT_256))
    logits = {}
    for name in (dtype, "float32"):
        model = load_model(path, dtype=name)
        doc = model.make_cache()
        prefill(model, tokens(600, 1)[0].tolist(), doc)
        request = Request("q", tuple(tokens(5, 2)[0].tolist()), max_tokens=6)
        (g,) = Generator(model, batch_size=1).generate([request], doc)
        assert len(g.tokens) == 6
        cache = model.make_cache()
        prefill(model, tokens(600, 1)[0].tolist(), cache)
        logits[name] = np.array(decode(model, mx.array([7]), cache).astype(mx.float32))
    scale = np.abs(logits["float32"]).max()
    tol = {"float16": 0.01, "bfloat16": 0.04}[dtype]  # 1.5 % measured in bf16, 0.12 % in f16
    assert np.abs(logits[dtype] - logits["float32"]).max() < tol * scale
