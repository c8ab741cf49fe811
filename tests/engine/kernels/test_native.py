"""The native CPU decode step (salabatch/engine/native) against the float32 references, on head
sizes with a fixed register tile (16, 32) and without one (24), kv groups of under and over one
vector of heads (4, 12), one and several rows, with and without shared keys; and the dispatch:
the engine takes it on the CPU for float32 only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.config import SparseConfig
from salabatch.engine.kernels import native, sparse_decode
from salabatch.engine.kernels.attention import attention_ref
from salabatch.engine.kernels.sparse_attention import block_sparse_attention_ref
from salabatch.engine.kernels.sparse_decode import infllm_v2_step
from salabatch.engine.kernels.sparse_select import select_blocks_ref
from salabatch.engine.sparse_cache import SparseKVCache

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=str(native.missing()))

SC = SparseConfig()
HK = 2


def rows_cache(rows: int, d: int, shared: bool, seed: int) -> SparseKVCache:
    """`rows` rows of random keys: forks of one 1100-token document with 1–150 keys of their
    own each, or 1187 keys per row."""
    rng = np.random.default_rng(seed)

    def keys(b: int, n: int) -> mx.array:
        return mx.array(rng.standard_normal((b, HK, n, d)).astype(np.float32))

    if not shared:
        cache = SparseKVCache(SC)
        k = keys(rows, 1187)
        cache.append(k, k * -0.7)
        return cache
    doc = SparseKVCache(SC)
    k = keys(1, 1100)
    doc.append(k, k * 0.5)
    forks = []
    for extra in (150, 7, 90, 33, 64, 1, 120, 15)[:rows]:
        row = doc.fork(1)
        k = keys(1, extra)
        row.append(k, k * 0.5)
        forks.append(row)
    return SparseKVCache.concat(forks)


@pytest.mark.parametrize("shared", [False, True], ids=["own rows", "shared keys"])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("groups", [4, 12])
@pytest.mark.parametrize("d", [16, 24, 32])
def test_native_step_matches_the_references(d, groups, rows, shared, monkeypatch):
    monkeypatch.setattr(sparse_decode, "CPU_STEP", "native")
    rng = np.random.default_rng(d * groups + rows)
    cache = rows_cache(rows, d, shared, seed=d + rows)
    k = mx.array(rng.standard_normal((rows, HK, 1, d)).astype(np.float32))
    cache.append(k, -k)  # the step's own key
    q = mx.array(rng.standard_normal((rows, HK * groups, 1, d)).astype(np.float32))
    starts = [n - 1 for n in cache.lengths]
    n_blocks = -(-max(cache.lengths) // SC.block_size)
    kw = dict(
        prefill_len=0,
        n_blocks=n_blocks,
        k=min(8, n_blocks),
        scale=d**-0.5,
        init_blocks=1,
        local_blocks=2,
        block=SC.block_size,
        compression=SC.compression,
    )
    whole = [cache.chunk_parts(level, whole=True) for level in (0, 1)]
    got, got_idx = infllm_v2_step(q, cache.kv_view(), *whole, starts, **kw)
    want_idx = select_blocks_ref(q, cache.chunk_parts(0), cache.chunk_parts(1), starts, **kw)
    assert mx.array_equal(got_idx, want_idx)
    want = block_sparse_attention_ref(q, cache.kv_view(), want_idx, starts, d**-0.5, 64)
    assert mx.abs(got - want).max().item() < 1e-5


@pytest.mark.parametrize("shared", [False, True], ids=["own rows", "shared keys"])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("groups", [4, 12])
@pytest.mark.parametrize("d", [16, 32])
def test_dense_step_matches_plain_attention(d, groups, rows, shared):
    """Every block selected is dense attention: each row over all its keys up to its position
    (rows at different lengths; the shared prefix read once), within float32 rounding."""
    rng = np.random.default_rng(d * groups + rows + 1)
    cache = rows_cache(rows, d, shared, seed=d + rows + 1)
    q = mx.array(rng.standard_normal((rows, HK * groups, 1, d)).astype(np.float32))
    kv = cache.kv_view()
    starts = [n - 1 for n in cache.lengths]
    got = sparse_decode.dense_step(q, kv, starts, d**-0.5, SC.block_size)
    keys, values = kv.full()
    mask = mx.arange(keys.shape[2]) <= mx.array(starts)[:, None, None, None]
    want = attention_ref(q, keys, values, d**-0.5, mask)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-5


def test_results_do_not_depend_on_the_thread_count():
    """Kv heads are split between threads; each thread's arithmetic is a one-thread run's."""
    cache = rows_cache(3, 32, shared=True, seed=11)
    kv = cache.kv_view()
    c1, c2 = (cache.chunk_parts(level, whole=True) for level in (0, 1))
    q = mx.array(np.random.default_rng(2).standard_normal((3, HK * 4, 1, 32)).astype(np.float32))
    pos = mx.array([n - 1 for n in cache.lengths], dtype=mx.int32)

    def step(n: int) -> tuple[mx.array, mx.array]:
        return native.sparse_decode_step(
            q, pos, c1, c2, (kv.shared_k, kv.shared_v), kv.rows_k, kv.rows_v,
            start=kv.start, prefill_len=0, k=8, scale=32**-0.5, init_blocks=1, local_blocks=2,
            block=SC.block_size, compression=SC.compression, stream=mx.default_stream(mx.cpu),
            n_threads=n,
        )  # fmt: skip

    o1, idx1 = step(1)
    for n in (2, 4):
        o, idx = step(n)
        assert mx.array_equal(idx, idx1).item() and mx.array_equal(o, o1).item()


def test_the_engine_runs_it_for_float32_on_the_cpu(monkeypatch):
    """The C++ step is what a float32 CPU decode takes (counted), never a bfloat16 one, and
    CPU_STEP = "blocks" turns it off."""
    calls = []
    real = native.sparse_decode_step

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "sparse_decode_step", counted)
    cache = rows_cache(2, 16, shared=True, seed=3)
    kw = dict(
        prefill_len=0,
        n_blocks=20,
        k=8,
        scale=0.25,
        init_blocks=1,
        local_blocks=2,
        block=SC.block_size,
        compression=SC.compression,
    )
    whole = [cache.chunk_parts(level, whole=True) for level in (0, 1)]
    starts = [n - 1 for n in cache.lengths]
    q = mx.ones((2, 8, 1, 16))
    with mx.stream(mx.cpu):
        mx.eval(infllm_v2_step(q, cache.kv_view(), *whole, starts, **kw))
        assert calls == [mx.float32]
        monkeypatch.setattr(sparse_decode, "CPU_STEP", "blocks")
        mx.eval(infllm_v2_step(q, cache.kv_view(), *whole, starts, **kw))
        assert calls == [mx.float32]
        monkeypatch.setattr(sparse_decode, "CPU_STEP", "native")
        bf16 = rows_cache(2, 16, shared=True, seed=3)
        bf16.keys.data = bf16.keys.data.astype(mx.bfloat16)
        bf16.values.data = bf16.values.data.astype(mx.bfloat16)
        mx.eval(infllm_v2_step(q.astype(mx.bfloat16), bf16.kv_view(), *whole, starts, **kw))
        assert calls == [mx.float32]
