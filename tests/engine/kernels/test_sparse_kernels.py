"""InfLLM-v2 kernels against their float32 references: compression, visibility, selection,
block-sparse attention — on odd lengths, block boundaries ±1 and compression-chunk boundaries."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.config import SparseConfig
from salabatch.engine.kernels import sparse_attention, sparse_select
from salabatch.engine.kernels.sparse_attention import (
    block_sparse_attention,
    block_sparse_attention_ref,
)
from salabatch.engine.kernels.sparse_select import (
    select_blocks,
    select_blocks_ref,
    visible_chunks,
    visible_count,
)
from salabatch.engine.sparse_cache import SparseKVCache

TOL_F32 = 1e-5
SC = SparseConfig()  # the 9B's block and compression levels
BLOCK = SC.block_size
GEOMETRY = dict(block=BLOCK, compression=SC.compression)
B, H, HK, D = 2, 8, 2, 16
INIT, LOCAL = 1, 2  # forced: block 0 and the query's block with 2 before it


def random_cache(n: int, seed: int, pieces: tuple[int, ...] = ()) -> SparseKVCache:
    """A sparse-layer cache holding n random keys/values, appended in the given piece sizes."""
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((B, HK, n, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, HK, n, D)).astype(np.float32))
    cache = SparseKVCache(SC)
    start = 0
    for size in [*pieces, n - sum(pieces)]:
        cache.append(k[:, :, start : start + size], v[:, :, start : start + size])
        start += size
    return cache


@pytest.mark.parametrize("n", [31, 32, 47, 48, 127, 128, 129, 191, 192, 500, 1087])
def test_compressed_keys_are_window_means(n):
    cache = random_cache(n, seed=n, pieces=(1, 14, 17, 63) if n > 95 else ())
    keys = np.array(cache.keys.view())
    for (size, stride), buf in zip(((32, 16), (128, 64)), cache.compressed, strict=True):
        count = max(0, (n - size) // stride + 1)
        assert buf.lengths == [count] * B
        if count:
            want = np.stack(
                [keys[:, :, stride * j : stride * j + size].mean(2) for j in range(count)], 2
            )
            np.testing.assert_allclose(np.array(buf.view()), want, atol=TOL_F32)


def test_visible_chunks_rule_and_length_quirk():
    pos = mx.arange(0, 400)[None]
    # ordinary length: a chunk is visible once its last token is at or before the query
    seen = np.array(visible_chunks(pos, prefill_len=400, stride=16))[0]
    for p in (0, 30, 31, 32, 46, 47, 399):
        assert seen[p] == sum(16 * j + 31 <= p for j in range(100))
    # L ≡ 15 (mod 16): one more chunk hidden for every prefill query, none for later ones
    quirky = np.array(visible_chunks(mx.arange(0, 400)[None], prefill_len=399, stride=16))[0]
    assert all(quirky[p] == max(seen[p] - 1, 0) for p in range(399))
    assert quirky[399] == seen[399]
    # level 2: L ≡ 63 (mod 64)
    seen2 = np.array(visible_chunks(pos, prefill_len=400, stride=64))[0]
    quirky2 = np.array(visible_chunks(pos, prefill_len=383, stride=64))[0]
    assert seen2[127] == 1 and seen2[126] == 0
    assert all(quirky2[p] == max(seen2[p] - 1, 0) for p in range(383))
    # the host-side count the query tiles use agrees with the device rule everywhere
    for prefill_len, stride, want in ((400, 16, seen), (399, 16, quirky), (383, 64, quirky2)):
        assert [visible_count(p, prefill_len, stride) for p in range(400)] == want.tolist()


def selection_inputs(n: int, t: int, seed: int):
    """Queries at the last t positions of an n-token cache, with everything selection needs."""
    cache = random_cache(n, seed)
    rng = np.random.default_rng(seed + 1)
    q = mx.array(rng.standard_normal((B, H, t, D)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(n - t, n, dtype=mx.int32), (B, t))
    c1, c2 = cache.chunk_parts(0), cache.chunk_parts(1)
    return cache, q, pos, (q, c1, c2, [n - t] * B)


@pytest.mark.parametrize(
    ("n", "t", "k"),
    [
        (700, 700, 6),  # one-call prefill, odd length
        (640, 640, 6),  # length on a block boundary
        (641, 641, 6),  # … +1
        (639, 639, 6),  # … -1
        (655, 655, 6),  # L ≡ 15 (mod 16): the quirk
        (703, 703, 6),  # L ≡ 63 (mod 64): the quirk at level 2
        (1000, 333, 8),  # a later chunk of a chunked prefill
        (1000, 1, 8),  # decode
        (1088, 1, 8),  # decode on a block boundary
        (300, 300, 12),  # more slots than past blocks: -1 padding
    ],
)
def test_select_blocks_matches_reference(monkeypatch, n, t, k):
    _, _, _, args = selection_inputs(n, t, seed=n + t)
    n_blocks = -(-n // BLOCK)
    kw = dict(
        prefill_len=n if t == n else 0,
        n_blocks=n_blocks,
        k=min(k, n_blocks),
        scale=D**-0.5,
        init_blocks=INIT,
        local_blocks=LOCAL,
        **GEOMETRY,
    )
    want = select_blocks_ref(*args, **kw)
    monkeypatch.setattr(sparse_select, "MAX_SCORE_ELEMENTS", 5000)  # force many query tiles
    got = select_blocks(*args, **kw)
    assert got.shape == want.shape
    assert mx.array_equal(got, want)


def test_selection_ties_go_to_the_lowest_block():
    """Equal pooled scores: the K-th slot goes to the lowest block id (CUDA topk rule)."""
    scores = mx.array([[[[5.0, 1.0, 3.0, 3.0, 3.0, 3.0, 0.5, 2.0]]]])
    q_blk = mx.array([[7]])
    got = sparse_select.top_k_lowest_index(scores, 3, q_blk)
    assert got.tolist() == [[[[0, 2, 3]]]]


# Both stage-2 paths, forced: gather each query's blocks, or score every key and keep the
# selected blocks' (tiles of a few rows each, so every tiling edge is crossed).
PATHS = {
    "gathered": {"SCORED_KEYS_PER_SLOT": 0, "MAX_GATHER_BYTES": 1},
    "scored": {"SCORED_KEYS_PER_SLOT": 1 << 20, "MAX_SCORE_ELEMENTS": 1},
    "default": {},
}


def force(monkeypatch, path: str) -> None:
    for name, value in PATHS[path].items():
        monkeypatch.setattr(sparse_attention, name, value)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("n", "t"), [(700, 700), (1000, 333), (1000, 1), (1087, 1), (129, 65)])
def test_block_sparse_attention_matches_reference(monkeypatch, n, t, path):
    cache, q, pos, args = selection_inputs(n, t, seed=7 * n + t)
    starts = args[-1]
    n_blocks = -(-n // BLOCK)
    idx = select_blocks(
        *args,
        prefill_len=0,
        n_blocks=n_blocks,
        k=min(5, n_blocks),
        scale=D**-0.5,
        init_blocks=INIT,
        local_blocks=LOCAL,
        **GEOMETRY,
    )
    kv = cache.kv_view()
    want = block_sparse_attention_ref(q, kv, idx, starts, D**-0.5, BLOCK)
    force(monkeypatch, path)
    got = block_sparse_attention(q, kv, idx, starts, D**-0.5, BLOCK)
    assert mx.abs(got - want).max().item() < TOL_F32


@pytest.mark.parametrize("path", list(PATHS))
def test_all_blocks_selected_equals_dense(monkeypatch, path):
    """With every past block selected, block-sparse attention is causal dense attention."""
    from salabatch.engine.kernels.attention import attention_ref

    n = 300
    cache, q, pos, _ = selection_inputs(n, n, seed=3)
    n_blocks = -(-n // BLOCK)
    idx = mx.broadcast_to(mx.arange(n_blocks, dtype=mx.int32), (B, HK, n, n_blocks))
    idx = mx.where(idx > (pos // BLOCK)[:, None, :, None], -1, idx)
    force(monkeypatch, path)
    got = block_sparse_attention(q, cache.kv_view(), idx, [0] * B, D**-0.5, BLOCK)
    want = attention_ref(q, cache.keys.view(), cache.values.view(), D**-0.5, "causal")
    assert mx.abs(got - want).max().item() < TOL_F32


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("t", [1, 70], ids=["decode", "prefill"])
def test_block_sparse_attention_over_shared_keys(monkeypatch, t, path):
    """Rows forked from one cache (keys stored once) at different lengths, against the
    reference over each row's whole sequence."""
    doc = random_cache(700, seed=11)
    doc.keys.lengths, doc.values.lengths = [700], [700]
    one = SparseKVCache(SC)
    one.append(doc.keys.view()[:1], doc.values.view()[:1])
    rng = np.random.default_rng(5)
    forks = []
    for extra in (40, 3):  # the rows continue the document by different amounts
        row = one.fork(1)
        k = mx.array(rng.standard_normal((1, HK, extra, D)).astype(np.float32))
        row.append(k, k * 0.5)
        forks.append(row)
    rows = SparseKVCache.concat(forks)
    k = mx.array(rng.standard_normal((2, HK, t, D)).astype(np.float32))
    rows.append(k, -k)
    lengths = rows.lengths
    assert lengths == [740 + t, 703 + t]
    q = mx.array(rng.standard_normal((2, H, t, D)).astype(np.float32))
    starts = [n - t for n in lengths]
    n_blocks = -(-max(lengths) // BLOCK)
    idx = select_blocks(
        q,
        rows.chunk_parts(0),
        rows.chunk_parts(1),
        starts,
        prefill_len=0,
        n_blocks=n_blocks,
        k=5,
        scale=D**-0.5,
        init_blocks=INIT,
        local_blocks=LOCAL,
        **GEOMETRY,
    )
    kv = rows.kv_view()
    assert kv.start > 0
    want = block_sparse_attention_ref(q, kv, idx, starts, D**-0.5, BLOCK)
    force(monkeypatch, path)
    got = block_sparse_attention(q, kv, idx, starts, D**-0.5, BLOCK)
    assert mx.abs(got - want).max().item() < TOL_F32


@pytest.mark.parametrize("lane_rows", [1, 99], ids=["rows split between lanes", "one lane"])
@pytest.mark.parametrize("form", ["native", "blocks"])
@pytest.mark.parametrize("shared", [False, True], ids=["own rows", "shared keys"])
def test_decode_step_matches_the_references(shared, form, lane_rows, monkeypatch):
    """The CPU decode step (whole buffers, bucketed blocks) selects and attends exactly as
    select_blocks_ref then block_sparse_attention_ref, in each form: the C++ primitive, and
    the compiled graphs with stage 2 as blocks multiplied in place."""
    from salabatch.engine.kernels import native, sparse_decode
    from salabatch.engine.kernels.sparse_decode import infllm_v2_step

    if form == "native" and native.missing():
        pytest.skip(native.missing())
    monkeypatch.setattr(sparse_decode, "CPU_STEP", form)
    monkeypatch.setattr(sparse_decode, "LANE_ROWS", lane_rows)

    cache, q = decode_case(shared, seed=21)
    starts = [n - 1 for n in cache.lengths]
    n_blocks = -(-max(cache.lengths) // BLOCK)
    kw = dict(
        prefill_len=0,
        n_blocks=n_blocks,
        k=min(8, n_blocks),
        scale=D**-0.5,
        init_blocks=INIT,
        local_blocks=LOCAL,
        **GEOMETRY,
    )
    whole = [cache.chunk_parts(level, whole=True) for level in (0, 1)]
    got, got_idx = infllm_v2_step(q, cache.kv_view(), *whole, starts, **kw)
    want_idx = select_blocks_ref(q, cache.chunk_parts(0), cache.chunk_parts(1), starts, **kw)
    assert mx.array_equal(got_idx, want_idx)
    want = block_sparse_attention_ref(q, cache.kv_view(), want_idx, starts, D**-0.5, BLOCK)
    assert mx.abs(got - want).max().item() < TOL_F32


def decode_case(shared: bool, seed: int):
    """Two rows at different lengths (forked from one document, or each its own sequence),
    the step's own key appended, and their queries."""
    rng = np.random.default_rng(seed)
    if shared:
        doc = random_cache(1100, seed=12)
        one = SparseKVCache(SC)
        one.append(doc.keys.view()[:1], doc.values.view()[:1])
        forks = []
        for extra in (90, 7):
            row = one.fork(1)
            k = mx.array(rng.standard_normal((1, HK, extra, D)).astype(np.float32))
            row.append(k, k * 0.5)
            forks.append(row)
        cache = SparseKVCache.concat(forks)
    else:
        cache = random_cache(1187, seed=13)
    k = mx.array(rng.standard_normal((B, HK, 1, D)).astype(np.float32))
    cache.append(k, -k)  # the step's own key
    q = mx.array(rng.standard_normal((B, H, 1, D)).astype(np.float32))
    return cache, q


@pytest.mark.parametrize("dense_len", [0, 1150, 1 << 20], ids=["sparse", "mixed", "dense"])
@pytest.mark.parametrize("shared", [False, True], ids=["own rows", "shared keys"])
def test_gpu_decode_step_matches_the_references(shared, dense_len):
    """The GPU form of the decode step (one graph of the compiled model step: positions and
    tables as arrays, the rows' chunks summed afresh, top-k as one partition of exact keys)
    selects exactly the reference's blocks for its sparse rows and attends like the
    references: InfLLM-v2 for sparse rows, plain causal attention for dense ones."""
    from salabatch.engine.kernels.attention import attention_ref
    from salabatch.engine.kernels.sparse_decode import (
        decode_attention,
        step_mode,
        step_rows,
        step_tables,
    )

    cache, q = decode_case(shared, seed=21)
    starts = [n - 1 for n in cache.lengths]
    start = cache.start
    counts = cache.shared.counts if shared else (0, 0)
    entries = tuple(c.shape[2] for c in cache.shared.chunks) if shared else (0, 0)
    own = cache.keys.data.shape[2]
    n_blocks = (own + (cache.shared.keys.shape[2] if shared else 0)) // BLOCK
    strides = [s for _, s in SC.compression]
    mode = step_mode(starts, dense_len)
    o, idx = decode_attention(
        q, cache.step_arrays(), cache.shared_arrays(), step_rows(starts, start, BLOCK, strides),
        step_tables(start, counts, entries, own, n_blocks, BLOCK, SC.compression),
        mode=mode, k=8, dense_len=dense_len, scale=D**-0.5, init_blocks=INIT,
        local_blocks=LOCAL, **GEOMETRY,
    )  # fmt: skip
    kw = dict(prefill_len=0, n_blocks=-(-max(cache.lengths) // BLOCK), k=8, scale=D**-0.5,
              init_blocks=INIT, local_blocks=LOCAL, **GEOMETRY)  # fmt: skip
    want_idx = select_blocks_ref(q, cache.chunk_parts(0), cache.chunk_parts(1), starts, **kw)
    want_sparse = block_sparse_attention_ref(q, cache.kv_view(), want_idx, starts, D**-0.5, BLOCK)
    keys, values = cache.kv_view().full()
    causal = mx.arange(keys.shape[2]) <= mx.array(starts)[:, None, None, None]
    want_dense = attention_ref(q, keys, values, D**-0.5, causal)
    for b, pos in enumerate(starts):
        if pos + 1 >= dense_len:
            assert mx.array_equal(idx[b, :, :, :8], want_idx[b]), f"row {b}"
            assert mx.abs(o[b] - want_sparse[b]).max().item() < TOL_F32, f"row {b}"
        else:
            assert mx.abs(o[b] - want_dense[b]).max().item() < TOL_F32, f"row {b}"
    if shared:  # rows at 1191 and 1108 tokens: the three modes
        assert mode == {0: "sparse", 1150: "mixed"}.get(dense_len, "dense")
