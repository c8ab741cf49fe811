"""The GPU path's prefill graphs, counted on any device (`salabatch.bench.graph`): kernels of
an 8K prefill chunk of a sparse and a lightning layer at the 9B's attention layout, tiles sized
for an H100's memory, lazily filled caches (no prefill runs); and no float32 matmul over the
keys. Decode's counts are its own tests'."""

from __future__ import annotations

import mlx.core as mx
import pytest

from salabatch.bench.graph import (
    H100_MEMORY,
    filled_sparse_cache,
    gpu_graph,
    kernels,
    prefill_chunk,
    sala_layers,
)
from salabatch.engine.cache import LightningCache
from salabatch.engine.kernels import attention, sparse_attention

CHUNK = 8192
# tokens once the chunk is in, prefill planned: stage 2's masked form at the first two, its
# gathers at the others (sparse_attention.MASKED_KEYS); with the CUDA kernels, the masked form at
# the first, stage 2's kernel at the others (STAGE2_KERNEL_KEYS)
CONTEXTS = (24 * 1024, 56 * 1024, 120 * 1024, 248 * 1024)
MAX_SPARSE_KERNELS = 1000  # issue 34: per sparse layer per 8K chunk
SAME_AT_EVERY_CONTEXT = 0.10  # issue 34: ±10 % between 24K and 248K, within each form
MAX_LIGHTNING_KERNELS = 60  # one compiled graph (the chunk loop built ~370)


@pytest.fixture(scope="module")
def layers():
    return sala_layers(mx.bfloat16)


def sparse_kernels(layer, ctx: int) -> int:
    counts, _ = prefill_chunk(layer, filled_sparse_cache(layer, ctx - CHUNK, ctx), CHUNK)
    return kernels(counts)


def test_sparse_prefill_chunk_is_under_a_thousand_kernels_at_every_context(layers):
    """Under a thousand kernels, and as many at every context of a form: the graph does not grow
    with the document (stage 2's masked form below MASKED_KEYS, its gathers above, each the same
    at every context it takes)."""
    counts = {ctx: sparse_kernels(layers[0], ctx) for ctx in CONTEXTS}
    assert max(counts.values()) <= MAX_SPARSE_KERNELS, counts
    for masked in (True, False):
        form = [n for ctx, n in counts.items() if (ctx <= sparse_attention.MASKED_KEYS) == masked]
        assert len(form) >= 2, counts
        assert max(form) <= (1 + SAME_AT_EVERY_CONTEXT) * min(form), counts


def test_with_the_cuda_kernels_a_sparse_chunk_is_the_same_at_every_context(layers):
    """On CUDA with the custom kernels (each launch one node), stage 1's softmax and pooling
    and, past STAGE2_KERNEL_KEYS, all of stage 2 are kernels: one graph at every context
    there, fewer kernels than either MLX-op form; below, stage 2 is the masked form."""
    counts = {}
    for ctx in CONTEXTS:
        cache = filled_sparse_cache(layers[0], ctx - CHUNK, ctx)
        counts[ctx] = kernels(prefill_chunk(layers[0], cache, CHUNK, cuda=True)[0])
    assert CONTEXTS[0] <= sparse_attention.STAGE2_KERNEL_KEYS < CONTEXTS[1], counts
    assert counts[CONTEXTS[1]] == counts[CONTEXTS[-1]], counts
    assert counts[CONTEXTS[-1]] < min(sparse_kernels(layers[0], ctx) for ctx in CONTEXTS[::3])
    assert counts[CONTEXTS[0]] != counts[CONTEXTS[1]], counts


def test_tiles_follow_the_device_memory():
    """Queries per tile: a power of two within the tile budget, at most TILE_ROWS."""
    budget = int(H100_MEMORY * attention.TILE_MEMORY_SHARE)
    with gpu_graph(H100_MEMORY):
        for row_bytes in (1, 10**5, 4 * 10**6, 10**8, budget + 1):
            rows = attention.tile_rows(row_bytes, 8192)
            assert rows & (rows - 1) == 0 and 1 <= rows <= attention.TILE_ROWS
            assert rows * row_bytes <= budget or rows == 1
            assert 2 * rows * row_bytes > budget or rows == attention.TILE_ROWS
        assert attention.tile_rows(1, 100) == 100  # never more than the queries


def test_lightning_prefill_is_one_graph_whatever_the_length(layers):
    def lightning_kernels(chunk: int) -> int:
        state = LightningCache(mx.zeros((1, 32, 128, 128), dtype=mx.float32))
        return kernels(prefill_chunk(layers[1], state, chunk)[0])

    count = lightning_kernels(CHUNK)
    assert count <= MAX_LIGHTNING_KERNELS
    # a length that is not whole 64-token chunks pads q, k and v (three copies), no more
    assert lightning_kernels(CHUNK // 8 + 1) == count + 3


def test_with_the_cuda_kernel_a_lightning_chunk_is_its_projections_and_norms(layers):
    """On CUDA with the recurrence's kernels (three launches: the chunks' states, the scan, the
    outputs), an 8K lightning chunk is its five projections, its q, k and output norms, its
    ropes, the gate and those launches: 14 kernels."""
    state = LightningCache(mx.zeros((1, 32, 128, 128), dtype=mx.float32))
    mx.eval(state.state)
    counts = prefill_chunk(layers[1], state, CHUNK, cuda=True)[0]
    assert kernels(counts) == 14, counts
    assert counts["Matmul"] == 5


def test_no_float32_matmul_over_the_keys(layers, monkeypatch):
    """In bf16, every matmul of a sparse layer's prefill chunk has bf16 operands, and none
    multiplies by a matrix as long as the cached keys (stage 2 reads K blocks per query, stage 1
    the compressed keys), past MASKED_KEYS where stage 2 gathers. Ops are seen as they are
    recorded: the context is one no other test builds, so the compiled tiles are traced here,
    not taken from the cache."""
    seen = []

    def spied(op):
        def record(a, b, *args, **kwargs):
            seen.append((op.__name__, a.dtype, b.dtype, b.shape[-2:]))
            return op(a, b, *args, **kwargs)

        record.__name__ = op.__name__
        return record

    monkeypatch.setattr(mx.array, "__matmul__", spied(mx.array.__matmul__))
    monkeypatch.setattr(mx, "matmul", spied(mx.matmul))
    monkeypatch.setattr(mx, "gather_mm", spied(mx.gather_mm))
    ctx = sparse_attention.MASKED_KEYS + 8 * 1024 + 128
    sparse_kernels(layers[0], ctx)
    assert any(name == "gather_mm" for name, *_ in seen)  # stage 2 was recorded
    for name, a, b, matrix in seen:
        assert (a, b) == (mx.bfloat16, mx.bfloat16), f"{name} of {a} and {b}"
        assert max(matrix) < ctx - CHUNK, f"{name} by a {matrix} matrix"
