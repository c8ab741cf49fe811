"""The GPU path's prefill forms against their float32 references, run on any device: stage 1
(`select_blocks_gpu`), stage 2 (`block_sparse_attention_gpu`: its masked and its gathered
form) and the lightning prefill
(`gla_parallel`), on lengths 1, 63, 64, 65, block and tile boundaries ±1, the stage-1 quirk
lengths, rows forked over shared keys at different lengths, and a non-zero initial state."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.kernels import attention, sparse_attention
from salabatch.engine.kernels import gla as gla_module
from salabatch.engine.kernels.gla import gla, gla_parallel, gla_recurrent_ref
from salabatch.engine.kernels.sparse_attention import (
    block_sparse_attention,
    block_sparse_attention_gpu,
    block_sparse_attention_ref,
)
from salabatch.engine.kernels.sparse_select import (
    _k_smallest,
    select_blocks,
    select_blocks_gpu,
    select_blocks_ref,
)
from salabatch.engine.sparse_cache import SparseKVCache
from tests.engine.kernels.test_gla import G4, SLOPES_32, make_inputs, rel_rms
from tests.engine.kernels.test_sparse_kernels import (
    BLOCK,
    GEOMETRY,
    HK,
    INIT,
    LOCAL,
    SC,
    B,
    D,
    H,
    random_cache,
)

TOL_F32 = 1e-5  # max abs error of float32 attention against the float32 reference
F32_RTOL = 1e-5  # relative RMS error of the float32 lightning form (measured ≤ 2e-6)
# ... and of its final state: a state sums decays exp(g·n) for n up to the call's length, and
# CUDA's exp loses ~|g·n| ulps (measured 1.02e-5 at 500 tokens on an H100; ≤ 2e-6 on the CPU)
F32_STATE_RTOL = 2e-5
BF16_RTOL = 2e-2  # relative RMS error of bf16 operands against the float32 reference
BF16_SAME_SLOTS = 0.97  # share of selected blocks bf16 scores agree on with float32 (near ties)
SMALL_TILE = 16  # TILE_ROWS that forces many query tiles, the last one partial
FORMS = ["masked", "gathered"]  # stage 2 on the GPU path: below MASKED_KEYS, and above


def stage2_form(monkeypatch, form: str) -> None:
    """Stage 2 takes `form` at the small lengths these tests use (gathered: as past
    MASKED_KEYS)."""
    if form == "gathered":
        monkeypatch.setattr(sparse_attention, "MASKED_KEYS", 0)


def settings(n: int, k: int, prefill_len: int = 0) -> dict:
    n_blocks = -(-n // BLOCK)
    return dict(
        prefill_len=prefill_len,
        n_blocks=n_blocks,
        k=min(k, n_blocks),
        scale=D**-0.5,
        init_blocks=INIT,
        local_blocks=LOCAL,
        **GEOMETRY,
    )


def queries(t: int, seed: int, rows: int = B) -> mx.array:
    """[rows, H, t, D], laid out as the projections leave them ([rows, t, H, D] in memory)."""
    q = np.random.default_rng(seed).standard_normal((rows, t, H, D)).astype(np.float32)
    return mx.array(q).transpose(0, 2, 1, 3)


def forked(lengths: tuple[int, ...], doc: int, seed: int) -> SparseKVCache:
    """Rows forked from one `doc`-token document (its keys stored once), each continued to its
    own length."""
    rng = np.random.default_rng(seed)
    full = random_cache(doc, seed=seed)
    one = SparseKVCache(SC)
    one.append(full.keys.view()[:1], full.values.view()[:1])
    rows = []
    for n in lengths:
        row = one.fork(1)
        k = mx.array(rng.standard_normal((1, HK, n - doc, D)).astype(np.float32))
        row.append(k, k * 0.5)
        rows.append(row)
    return SparseKVCache.concat(rows)


CASES = [  # (cached keys, queries, K): the queries are the last ones
    (700, 700, 6),  # one-call prefill, odd length
    (640, 640, 6),  # on a block boundary
    (641, 641, 6),  # … +1
    (639, 639, 6),  # … -1
    (655, 655, 6),  # L ≡ 15 (mod 16): the stage-1 quirk
    (703, 703, 6),  # L ≡ 63 (mod 64): the quirk at level 2
    (1000, 333, 8),  # a later chunk of a chunked prefill
    (1000, 63, 8),
    (1000, 64, 8),
    (1000, 65, 8),
    (1000, 1, 8),  # one query (decode of a row group)
    (300, 300, 12),  # more slots than past blocks: -1 padding
    (100, 100, 3),  # early queries see no level-2 chunk
    (20, 20, 3),  # no complete chunk at all
]


@pytest.mark.parametrize("tile", [SMALL_TILE, None], ids=["small tiles", "device tiles"])
@pytest.mark.parametrize(("n", "t", "k"), CASES)
def test_select_blocks_gpu_matches_reference(monkeypatch, n, t, k, tile):
    if tile:
        monkeypatch.setattr(attention, "TILE_ROWS", tile)
    cache = random_cache(n, seed=n + t)
    q = queries(t, seed=n - t)
    args = (q, cache.chunk_parts(0), cache.chunk_parts(1), [n - t] * B)
    kw = settings(n, k, prefill_len=n if t == n else 0)
    got = select_blocks_gpu(*args, **kw)
    assert mx.array_equal(got, select_blocks_ref(*args, **kw))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_k_smallest_is_a_stable_sorts_choice(dtype):
    """Stage 1's top-k by one partition of unique keys picks what a stable sort picks: the k
    smallest keys, equal ones by the lowest id (SPEC P11), ascending; with ties everywhere,
    ±0, ±inf; and by the stable sort itself past 65,536 blocks."""
    rng = np.random.default_rng(5)
    values = np.array([-np.inf, -2.5, -1.0, -0.0, 0.0, 0.75, np.inf], dtype=np.float32)
    for n, k in ((7, 3), (200, 12), (1000, 96), (70_000, 5)):
        key = mx.array(rng.choice(values, size=(3, n))).astype(dtype)
        want = mx.sort(mx.argsort(key, axis=-1)[..., :k], axis=-1)
        got = _k_smallest(key, k)
        assert mx.array_equal(got.astype(mx.int32), want.astype(mx.int32)), (n, k)


def test_select_blocks_gpu_over_shared_keys_at_different_lengths(monkeypatch):
    monkeypatch.setattr(attention, "TILE_ROWS", SMALL_TILE)
    cache = forked((790, 745), doc=700, seed=3)
    t = 45
    q = queries(t, seed=4)
    starts = [n - t for n in cache.lengths]
    args = (q, cache.chunk_parts(0), cache.chunk_parts(1), starts)
    kw = settings(max(cache.lengths), 6)
    assert mx.array_equal(select_blocks_gpu(*args, **kw), select_blocks_ref(*args, **kw))


def test_select_blocks_gpu_in_bf16_picks_nearly_the_same_blocks():
    n = 1500
    cache = random_cache(n, seed=5)
    q = queries(n, seed=6)
    kw = settings(n, 8, prefill_len=n)
    want = select_blocks_ref(q, cache.chunk_parts(0), cache.chunk_parts(1), [0] * B, **kw)
    low = [tuple(p.astype(mx.bfloat16) for p in cache.chunk_parts(level)) for level in (0, 1)]
    got = select_blocks_gpu(q.astype(mx.bfloat16), *low, [0] * B, **kw)
    same = np.mean(
        [
            len(set(a) & set(b)) / len(set(b))
            for a, b in zip(
                np.array(got).reshape(-1, kw["k"]),
                np.array(want).reshape(-1, kw["k"]),
                strict=True,
            )
        ]
    )
    assert same >= BF16_SAME_SLOTS


def test_select_blocks_dispatches_to_the_gpu_form_under_the_switch(monkeypatch):
    cache = random_cache(700, seed=8)
    q = queries(300, seed=9)
    args = (q, cache.chunk_parts(0), cache.chunk_parts(1), [400] * B)
    kw = settings(700, 6)
    monkeypatch.setattr(attention, "TILE_ROWS", SMALL_TILE)
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    assert mx.array_equal(select_blocks(*args, **kw), select_blocks_gpu(*args, **kw))


def stage2(cache: SparseKVCache, t: int, k: int, seed: int, dtype=mx.float32):
    """Queries at the last t positions of each row, their selection (the reference's) and the
    float32 reference output."""
    q = queries(t, seed=seed, rows=len(cache.lengths))
    starts = [n - t for n in cache.lengths]
    kw = settings(max(cache.lengths), k)
    idx = select_blocks_ref(q, cache.chunk_parts(0), cache.chunk_parts(1), starts, **kw)
    want = block_sparse_attention_ref(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK)
    return q.astype(dtype), idx, starts, want


STAGE2_CASES = [(700, 700), (1000, 333), (1000, 63), (1000, 64), (1000, 65), (1000, 1), (129, 65)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tile", [SMALL_TILE, None], ids=["small tiles", "device tiles"])
@pytest.mark.parametrize(("n", "t"), STAGE2_CASES)
def test_block_sparse_attention_gpu_matches_reference(monkeypatch, n, t, tile, form):
    stage2_form(monkeypatch, form)
    if tile:
        monkeypatch.setattr(attention, "TILE_ROWS", tile)
    cache = random_cache(n, seed=7 * n + t)
    q, idx, starts, want = stage2(cache, t, k=5, seed=t)
    got = block_sparse_attention_gpu(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < TOL_F32


def test_tiles_keep_batched_kernels_within_the_launch_grid(monkeypatch):
    """MLX's CUDA backend cannot launch a gather_mm or a sort of 65,536 entries or more (one
    grid row each; seen on an H200 at an 8K chunk's 1,024-query tiles). With GRID_ROWS made
    small, every such kernel of stage 1 and stage 2 batches within it (compile off, so each call
    is seen), and the smaller tiles still give the references' results."""
    limit = 40
    monkeypatch.setattr(attention, "GRID_ROWS", limit)
    stage2_form(monkeypatch, "gathered")
    batches = []

    def recorded(fn, entries):
        def wrapped(*args, **kwargs):
            batches.append((fn.__name__, entries(*args)))
            return fn(*args, **kwargs)

        return wrapped

    def index_entries(a, b, lhs, rhs):
        return int(np.prod(np.broadcast_shapes(lhs.shape, rhs.shape)))

    monkeypatch.setattr(mx, "gather_mm", recorded(mx.gather_mm, index_entries))
    for name in ("sort", "argsort", "topk", "argpartition", "partition"):
        fn = getattr(mx, name)
        monkeypatch.setattr(mx, name, recorded(fn, lambda x, *_: x.size // x.shape[-1]))
    n, t, k = 1000, 70, 5
    cache = random_cache(n, seed=13)
    q = queries(t, seed=14)
    starts = [n - t] * B
    args = (q, cache.chunk_parts(0), cache.chunk_parts(1), starts)
    kw = settings(n, k)
    mx.disable_compile()
    try:
        idx = select_blocks_gpu(*args, **kw)
        got = block_sparse_attention_gpu(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK)
        mx.eval(idx, got)
    finally:
        mx.enable_compile()
    assert {name for name, _ in batches} >= {"gather_mm", "partition"}
    assert max(entries for _, entries in batches) <= limit
    assert mx.array_equal(idx, select_blocks_ref(*args, **kw))
    want = block_sparse_attention_ref(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK)
    assert mx.abs(got - want).max().item() < TOL_F32


@pytest.mark.parametrize("t", [1, 70], ids=["one query", "prefill"])
def test_block_sparse_attention_gpu_over_shared_keys(monkeypatch, t):
    """Forked rows at different lengths: slots in the document read its shared buffers, slots
    after it the rows' own."""
    monkeypatch.setattr(attention, "TILE_ROWS", SMALL_TILE)
    cache = forked((840, 703), doc=640, seed=11)
    q, idx, starts, want = stage2(cache, t, k=5, seed=12)
    assert cache.kv_view().start > 0
    got = block_sparse_attention_gpu(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK)
    assert mx.abs(got - want).max().item() < TOL_F32


@pytest.mark.parametrize("form", FORMS)
def test_block_sparse_attention_gpu_in_bf16(monkeypatch, form):
    """bf16 keys and queries (gather_mm or SDPA in bf16, softmax and sums in float32) against
    the float32 reference of the same selection."""
    stage2_form(monkeypatch, form)
    if mx.default_device() == mx.cpu:  # MLX's CPU gather_mm is float32 only: run the GPU's
        gather_mm = mx.gather_mm  # (float32 accumulation, the result rounded to the inputs')

        def rounded(a, b, *args, **kwargs):
            f32 = (x.astype(mx.float32) for x in (a, b))
            return gather_mm(*f32, *args, **kwargs).astype(a.dtype)

        monkeypatch.setattr(mx, "gather_mm", rounded)
    n, t = 1200, 700
    cache = random_cache(n, seed=13)
    q, idx, starts, want = stage2(cache, t, k=6, seed=14, dtype=mx.bfloat16)
    kv = cache.kv_view()
    low = type(kv)(
        None, None, 0, kv.rows_k.astype(mx.bfloat16), kv.rows_v.astype(mx.bfloat16), kv.lengths
    )
    got = block_sparse_attention_gpu(q, low, idx, starts, D**-0.5, BLOCK)
    assert got.dtype == mx.bfloat16
    assert rel_rms(got, want) < BF16_RTOL


@pytest.mark.parametrize("form", FORMS)
def test_rows_at_different_lengths(monkeypatch, form):
    """Rows of their own keys only (no shared part) at different lengths: each row's queries
    at its own positions, each masked tile over its own row's keys."""
    stage2_form(monkeypatch, form)
    monkeypatch.setattr(attention, "TILE_ROWS", SMALL_TILE)
    long, short = random_cache(1000, seed=21), random_cache(760, seed=22)
    cache = SparseKVCache.concat([long.select([0]), short.select([1])])
    assert cache.kv_view().start == 0 and cache.lengths == [1000, 760]
    q, idx, starts, want = stage2(cache, 200, k=5, seed=23)
    got = block_sparse_attention_gpu(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK)
    assert mx.abs(got - want).max().item() < TOL_F32


def test_stage2_form_follows_the_keys(monkeypatch):
    """The masked form (one SDPA per row and tile, no gather) while a tile's keys rounded up to
    MASKED_BUCKET are at most MASKED_KEYS; the gathers (no SDPA past the first K blocks'
    queries) beyond, and for rows over shared keys."""
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(mx, "gather_mm", spy("gather_mm", mx.gather_mm))
    sdpa = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy("sdpa", sdpa))
    cache = random_cache(1000, seed=24)
    q, idx, starts, _ = stage2(cache, 300, k=5, seed=25)  # every query past the first K blocks
    for limit, want in ((sparse_attention.MASKED_BUCKET, "sdpa"), (0, "gather_mm")):
        monkeypatch.setattr(sparse_attention, "MASKED_KEYS", limit)
        calls.clear()
        mx.disable_compile()
        try:
            mx.eval(block_sparse_attention_gpu(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK))
        finally:
            mx.enable_compile()
        assert set(calls) == {want}, (limit, calls)
    calls.clear()
    shared = forked((840, 703), doc=640, seed=26)
    q, idx, starts, _ = stage2(shared, 70, k=5, seed=27)
    monkeypatch.setattr(sparse_attention, "MASKED_KEYS", sparse_attention.MASKED_BUCKET)
    mx.eval(block_sparse_attention_gpu(q, shared.kv_view(), idx, starts, D**-0.5, BLOCK))
    assert "gather_mm" in calls


def test_block_sparse_attention_dispatches_to_the_gpu_form_under_the_switch(monkeypatch):
    cache = random_cache(1000, seed=15)
    q, idx, starts, _ = stage2(cache, 333, k=5, seed=16)
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    got = block_sparse_attention(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK)
    want = block_sparse_attention_gpu(q, cache.kv_view(), idx, starts, D**-0.5, BLOCK)
    assert mx.array_equal(got, want)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 127, 128, 129, 500])
def test_gla_parallel_matches_reference(T, with_state):
    # T = 65, 129, 500 end in a partial chunk: a final state decayed over the padding fails.
    q, k, v, state = make_inputs(T, 16, 24, with_state=with_state, seed=T)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, G4, 0.25, state)
    o, s = gla_parallel(q, k, v, G4, 0.25, state)
    assert o.shape == o_ref.shape and o.dtype == mx.float32
    assert s.shape == s_ref.shape and s.dtype == mx.float32
    assert rel_rms(o, o_ref) <= F32_RTOL
    assert rel_rms(s, s_ref) <= F32_STATE_RTOL


def test_gla_parallel_in_segments(monkeypatch):
    """A call longer than a segment: the state carried from one compiled graph to the next."""
    monkeypatch.setattr(gla_module, "GPU_SEGMENT", 128)
    q, k, v, state = make_inputs(300, seed=3)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, G4, 0.25, state)
    o, s = gla_parallel(q, k, v, G4, 0.25, state)
    assert rel_rms(o, o_ref) <= F32_RTOL and rel_rms(s, s_ref) <= F32_STATE_RTOL


@pytest.mark.parametrize("T", [1, 64, 65, 300])
def test_gla_parallel_rounds_o_once_to_the_dtype_asked(T, monkeypatch):
    """o in bf16 is the float32 o rounded, to the bit, whole chunks and a padded last one, in
    segments too; a fresh sequence (no state read) gives what an explicit zero state gives."""
    monkeypatch.setattr(gla_module, "GPU_SEGMENT", 128)
    q, k, v, state = make_inputs(T, 16, 24, with_state=True, seed=40 + T)
    q, k, v = (x.astype(mx.bfloat16) for x in (q, k, v))
    o32, s32 = gla_parallel(q, k, v, G4, 0.25, state)
    o16, s16 = gla_parallel(q, k, v, G4, 0.25, state, out_dtype=mx.bfloat16)
    assert o16.dtype == mx.bfloat16 and o16.shape == o32.shape
    assert mx.array_equal(o16, o32.astype(mx.bfloat16)).item() and mx.array_equal(s16, s32).item()
    zero = mx.zeros_like(state)
    fresh, zeroed = gla_parallel(q, k, v, G4, 0.25), gla_parallel(q, k, v, G4, 0.25, zero)
    assert all(mx.array_equal(a, b).item() for a, b in zip(fresh, zeroed, strict=True))


def test_gla_parallel_every_9b_decay_and_bf16_inputs():
    q, k, v, state = make_inputs(200, dk=8, dv=8, heads=32, seed=1)
    g = -mx.array(SLOPES_32, dtype=mx.float32)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, g, 0.3, state)
    o, s = gla_parallel(q, k, v, g, 0.3, state)
    assert rel_rms(o, o_ref) <= F32_RTOL and rel_rms(s, s_ref) <= F32_STATE_RTOL
    low = [x.astype(mx.bfloat16) for x in (q, k, v)]
    o, s = gla_parallel(*low, g, 0.3, state)
    assert rel_rms(o, o_ref) <= BF16_RTOL and rel_rms(s, s_ref) <= BF16_RTOL


def test_gla_dispatches_to_the_parallel_form_under_the_switch(monkeypatch):
    q, k, v, state = make_inputs(100, seed=2)
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    got = gla(q, k, v, G4, 0.25, state)
    want = gla_parallel(q, k, v, G4, 0.25, state)
    assert all(mx.array_equal(a, b) for a, b in zip(got, want, strict=True))
