"""Prefix store: a saved cache continues exactly like the live one (in a new process), bad
entries are never used, a killed prefill resumes from its snapshot, the budget evicts LRU."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import warnings
import weakref

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.cache import ModelCache
from salabatch.engine.generate import Prefill, prefill
from salabatch.engine.load import load_model
from salabatch.engine.sparse_cache import SparseKVCache
from salabatch.errors import CacheFormatError
from salabatch.jobs.store.document_cache import DocumentCaches
from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore, PrefixStoreWarning
from tests.tiny import SPARSE_AT_256, SPARSE_AT_512, tiny_config_dict, write_tiny_checkpoint

NEXT = [[7, 8, 9, 10, 11]]  # the continuation both caches are fed


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), tiny_config_dict(**SPARSE_AT_256))


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype="float32")


@pytest.fixture(scope="module")
def ckpt_512(tmp_path_factory):
    """Sparse from 512 tokens: a chunk at 256-511 runs differently dense and sparse."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m512"), tiny_config_dict(**SPARSE_AT_512))


@pytest.fixture(scope="module")
def model_512(ckpt_512):
    return load_model(ckpt_512, dtype="float32")


def doc_ids(n: int) -> list[int]:
    return np.random.default_rng(n).integers(3, 256, size=n).tolist()


def key_for(ids, model_fp="m" * 64, tok_fp="t" * 64, dtype="float32") -> PrefixKey:
    return PrefixKey.of("tiny", model_fp, tok_fp, dtype, ids)


def run_in_new_process(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "n", [150, 203, 711], ids=["dense", "dense-inside-a-chunk", "sparse-inside-a-chunk"]
)
def test_saved_prefix_continues_like_the_live_cache_in_a_new_process(model, ckpt, tmp_path, n):
    ids = doc_ids(n)
    live = model.make_cache()
    prefill(model, ids, live)
    store = PrefixStore(tmp_path / "store")
    store.save(key_for(ids), live)
    want = np.array(model(mx.array(NEXT), live))
    out = tmp_path / "logits.npy"
    result = run_in_new_process(
        f"""
        import numpy as np
        import salabatch.engine
        import mlx.core as mx
        from salabatch.engine.load import load_model
        from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore
        model = load_model({str(ckpt)!r}, dtype="float32")
        key = PrefixKey.of("tiny", "m" * 64, "t" * 64, "float32", {ids!r})
        cache = PrefixStore({str(tmp_path / "store")!r}).load(key, model.config)
        assert cache is not None and cache.offset == {n}
        np.save({str(out)!r}, np.array(model(mx.array({NEXT!r}), cache)))
        """
    )
    assert result.returncode == 0, result.stderr
    assert np.abs(np.load(out) - want).max() <= 1e-6


def test_saved_cache_keeps_format_1(model):
    """What the store has always written: each layer's kind, and its arrays under
    `layers.{i}.`: `state` (lightning), or `keys`, `values`, `chunks0`, `chunks1` cut to their
    lengths (sparse)."""
    cache = model.make_cache()
    prefill(model, doc_ids(300), cache)
    arrays, meta = cache.to_state()
    assert meta == {
        "format_version": "1",
        "layer_kinds": json.dumps(["sparse", "lightning", "lightning", "sparse"]),
        "position": "300",
        "prefill_len": "300",
    }
    sparse = {"keys": 300, "values": 300, "chunks0": (300 - 32) // 16 + 1, "chunks1": 3}
    want = {f"layers.{i}.{name}": n for i in (0, 3) for name, n in sparse.items()}
    assert {name: a.shape[2] for name, a in arrays.items() if "state" not in name} == want
    assert {name for name in arrays if "state" in name} == {"layers.1.state", "layers.2.state"}


def test_a_snapshot_keeps_the_length_of_the_prompt_it_is_part_of(model):
    """A mid-prefill snapshot saves the whole prompt's length beside its position, and loads
    with it planned: its remaining chunks choose dense or sparse as one call over the prompt."""
    cache = model.make_cache()
    feed = Prefill(model, doc_ids(1000), cache, 128)
    while feed.done < 512:
        feed.step()
    arrays, meta = cache.to_state()
    assert (meta["position"], meta["prefill_len"]) == ("512", "1000")
    loaded = ModelCache.from_state(arrays, meta, model.config)
    assert loaded.positions == [512] and loaded.prefill_len == 1000
    sparse = [c.prefill_len for c in loaded if isinstance(c, SparseKVCache)]
    assert sparse == [1000] * len(model.config.sparse_layers)


def test_parts_of_a_state_since_earlier_positions_join_into_the_whole(model):
    """A prefill's states at 300, 700 and 1000 tokens, each only since the one before (the
    keys and compressed chunks of its own tokens, the lightning states whole), join into the
    state of the cache at 1000 bit for bit; parts out of order, or one missing, are refused."""
    cache = model.make_cache()
    feed = Prefill(model, doc_ids(1000), cache, 100)
    parts, before = [], 0
    for at in (300, 700, 1000):
        while feed.done < at:
            feed.step()
        parts.append(cache.to_state(since=before))
        before = at
    arrays, meta = ModelCache.joined_state(parts)
    whole, whole_meta = cache.to_state()
    assert meta == whole_meta and arrays.keys() == whole.keys()
    assert all(mx.array_equal(arrays[k], whole[k]) for k in whole)
    own = {k: a.shape[2] for k, a in parts[1][0].items() if ".keys" in k or ".chunks" in k}
    assert (
        own["layers.0.keys"] == 400
        and own["layers.0.chunks0"] == (700 - 32) // 16 - (300 - 32) // 16
    )
    loaded = ModelCache.from_state(arrays, meta, model.config)
    assert mx.array_equal(model(mx.array(NEXT), loaded), model(mx.array(NEXT), cache))
    for broken in (parts[1:], [parts[0], parts[2]], parts[::-1]):
        with pytest.raises(CacheFormatError, match="a part from"):
            ModelCache.joined_state(broken)
    with pytest.raises(ValueError, match="since must be in"):
        cache.to_state(since=2000)  # past its 1005 tokens (NEXT fed)


def test_inconsistent_states_are_refused(model):
    cache = model.make_cache()
    prefill(model, doc_ids(300), cache)
    arrays, meta = cache.to_state()
    broken = [
        ({k: a for k, a in arrays.items() if k != "layers.3.chunks1"}, meta, "missing array"),
        ({k: a for k, a in arrays.items() if k != "layers.2.state"}, meta, "missing array"),
        (arrays, {**meta, "position": "299"}, "layer 0 holds 300 keys"),
        ({**arrays, "layers.0.chunks0": arrays["layers.0.chunks0"][:, :, :-1]}, meta, "chunks"),
        (arrays, {**meta, "layer_kinds": json.dumps(["sparse"] * 4)}, "layer layout"),
        (arrays, {**meta, "format_version": "2"}, "format version"),
    ]
    for state, header, why in broken:
        with pytest.raises(CacheFormatError, match=why):
            ModelCache.from_state(state, header, model.config)


def test_a_loaded_document_forks_like_the_live_one(model):
    """Rows forked from a loaded (sparse-mode) document and batched continue exactly like rows
    forked from the live cache."""
    live = model.make_cache()
    prefill(model, doc_ids(711), live)
    loaded = ModelCache.from_state(*live.to_state(), model.config)
    outs = []
    for doc in (live, loaded):
        rows = [doc.fork(1), doc.fork(1)]
        model(mx.array([[5, 6, 7]]), rows[0])
        model(mx.array([[9]]), rows[1])
        batch = ModelCache.concat(rows)
        outs.append(model(mx.array(NEXT[0][:2])[:, None], batch))
    assert mx.abs(outs[0] - outs[1]).max().item() <= 1e-6


def stored_entry(model, tmp_path, n=300):
    ids = doc_ids(n)
    cache = model.make_cache()
    prefill(model, ids, cache)
    store = PrefixStore(tmp_path / "store")
    store.save(key_for(ids), cache)
    return store, key_for(ids), store.root / "prefixes" / f"{key_for(ids).digest}.safetensors"


def test_bit_flip_is_detected_and_the_entry_removed(model, tmp_path):
    from salabatch.engine.fingerprint import file_sha256

    store, key, path = stored_entry(model, tmp_path)
    # the checksum, hashed as the file was written, is the file's
    assert json.loads(path.with_suffix(".json").read_text())["sha256"] == file_sha256(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.warns(PrefixStoreWarning, match="checksum"):
        assert store.load(key, model.config) is None
    assert not path.exists() and store.entries() == []


def test_truncation_is_detected(model, tmp_path):
    store, key, path = stored_entry(model, tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.warns(PrefixStoreWarning, match="truncated"):
        assert store.load(key, model.config) is None


def test_another_model_tokenizer_or_dtype_is_never_used(model, tmp_path):
    store, key, path = stored_entry(model, tmp_path)
    ids = doc_ids(300)
    for other in (
        key_for(ids, model_fp="x" * 64),
        key_for(ids, tok_fp="y" * 64),
        key_for(ids, dtype="bfloat16"),
        key_for(ids[:-1]),
    ):
        assert other.digest != key.digest
        assert store.load(other, model.config) is None
    # a manifest that claims this digest but names another model is rejected too
    manifest = path.with_suffix(".json")
    manifest.write_text(manifest.read_text().replace("m" * 64, "z" * 64))
    with pytest.warns(PrefixStoreWarning, match="another model"):
        assert store.load(key, model.config) is None


def test_documents_are_prefilled_once_then_served_from_memory_and_disk(model, tmp_path):
    ids = doc_ids(400)
    store = PrefixStore(tmp_path / "store")
    first = DocumentCaches(model, store, chunk=128).get(key_for(ids), ids)
    assert first.source == "none" and first.prefill_s > 0
    again = DocumentCaches(model, store, chunk=128)
    disk = again.get(key_for(ids), ids)
    assert disk.source == "disk" and again.get(key_for(ids), ids).source == "memory"
    a = model(mx.array(NEXT), first.cache)
    b = model(mx.array(NEXT), disk.cache)
    assert mx.array_equal(a, b)


def test_the_last_document_is_let_go_before_the_next_one_is_prefilled(model, tmp_path):
    """A run's memory plan counts one document's prefix: the previous one's is not held while
    the next one loads or prefills (it was: ~8 GB more at 1M tokens of the 9B)."""
    caches = DocumentCaches(model, PrefixStore(tmp_path / "store"), chunk=128)
    first = caches.get(key_for(doc_ids(300)), doc_ids(300)).cache
    held = weakref.ref(first)
    del first
    alive = []

    def progress(_done, _total):
        gc.collect()
        alive.append(held() is not None)

    second = doc_ids(400)[::-1]
    assert caches.get(key_for(second), second, progress).source == "none"
    assert alive and not any(alive), alive
    assert caches.get(key_for(second), second).source == "memory"


@pytest.mark.parametrize(
    ("dense_len", "snapshot"),
    [(256, 512), (512, 256)],
    ids=["snapshot-above-dense_len", "snapshot-below-dense_len"],
)
def test_killed_prefill_resumes_from_its_last_snapshot(request, tmp_path, dense_len, snapshot):
    """Killed between two snapshots, the prefill resumes from the last one and ends as one
    uninterrupted prefill. From a snapshot below dense_len (512, where a chunk's mode shows) its
    remaining chunks run sparse, as the whole 1000-token prompt's do in one call."""
    at = "" if dense_len == 256 else "_512"
    ckpt, model = (request.getfixturevalue(name + at) for name in ("ckpt", "model"))
    ids = doc_ids(1000)
    root = tmp_path / "store"
    result = run_in_new_process(
        f"""
        import os, signal
        import salabatch.engine
        from salabatch.engine.load import load_model
        from salabatch.jobs.store.document_cache import DocumentCaches
        from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore
        model = load_model({str(ckpt)!r}, dtype="float32")
        key = PrefixKey.of("tiny", "m" * 64, "t" * 64, "float32", {ids!r})
        def progress(done, total):
            if done >= {snapshot + 128}:  # after the snapshot, before the next one
                os.kill(os.getpid(), signal.SIGKILL)
        caches = DocumentCaches(model, PrefixStore({str(root)!r}), chunk=128, snapshot_every=256)
        caches.get(key, {ids!r}, progress)
        """
    )
    assert result.returncode == -9, result.stderr
    store = PrefixStore(root)
    # a chain: each snapshot holds the keys of its own tokens, the first all before it
    snapshots = sorted((e.kind, e.tokens) for e in store.entries())
    assert snapshots == [("snapshot", n) for n in range(256, snapshot + 1, 256)]
    resumed = DocumentCaches(model, store, chunk=128, snapshot_every=256).get(key_for(ids), ids)
    assert resumed.source == "none" and resumed.resumed_from == snapshot
    assert [e.kind for e in store.entries()] == ["prefix"]  # snapshots dropped once complete
    fresh = model.make_cache()
    prefill(model, ids, fresh)
    diff = mx.abs(model(mx.array(NEXT), resumed.cache) - model(mx.array(NEXT), fresh)).max()
    assert diff.item() <= 1e-5


def snapshot_chain(model, store: PrefixStore, ids: list[int], at=(256, 512, 768)) -> ModelCache:
    """Snapshots of `ids`'s prefill at positions `at`, as a run's prefill saves them; → the
    cache at the last."""
    cache = model.make_cache()
    feed = Prefill(model, ids, cache, 128)
    for position in at:
        while feed.done < position:
            feed.step()
        store.save_snapshot(key_for(ids), cache)
    return cache


def test_snapshots_write_each_tokens_keys_once_and_load_as_their_chain(model, tmp_path):
    """Snapshots at 256, 512 and 768 tokens: each file holds only its own tokens' keys and
    compressed chunks (the first all before it), so all of them hold the keys of the last one
    once; the furthest loads as the live cache at 768 (bit for bit). A link that fails its
    checks goes with the later ones, and the furthest before it loads instead; one whose
    earlier link is gone goes too; a snapshot saved where others went further replaces those
    (another prefill's), continuing the furthest before it."""
    root = tmp_path / "store"
    store = PrefixStore(root)
    ids = doc_ids(1000)
    live = snapshot_chain(model, store, ids)
    folder = root / "snapshots" / key_for(ids).digest

    def rows(position: int) -> int:
        arrays = mx.load(str(folder / f"{position}.safetensors"))
        return sum(a.shape[2] for name, a in arrays.items() if ".state" not in name)

    whole, _ = live.to_state()
    assert sum(rows(p) for p in (256, 512, 768)) == sum(
        a.shape[2] for name, a in whole.items() if ".state" not in name
    )
    loaded = store.load_snapshot(key_for(ids), model.config)
    assert loaded.offset == 768 and loaded.prefill_len == 1000
    assert store.snapshot_tokens(key_for(ids)) == 768  # what --dry-run says it resumes at
    assert store.snapshot_tokens(key_for(doc_ids(10))) == 0
    assert mx.array_equal(model(mx.array(NEXT), loaded), model(mx.array(NEXT), live))

    data = folder / "512.safetensors"
    data.write_bytes(data.read_bytes()[:-1] + b"\0")  # a bit flipped in the middle link
    with pytest.warns(PrefixStoreWarning, match="512.safetensors is unusable"):
        assert store.load_snapshot(key_for(ids), model.config).offset == 256
    assert sorted(p.name for p in folder.iterdir()) == ["256.json", "256.safetensors"]

    other = doc_ids(900)
    snapshot_chain(model, store, other)
    other_folder = root / "snapshots" / key_for(other).digest
    (other_folder / "256.json").unlink()  # the first link gone (its data a stale temporary)
    assert store.load_snapshot(key_for(other), model.config) is None
    assert not list(other_folder.glob("*.json"))

    cache = snapshot_chain(model, store, doc_ids(1000), at=(384,))  # below none: after 256
    assert sorted(p.name for p in folder.glob("*.json")) == ["256.json", "384.json"]
    assert json.loads((folder / "384.json").read_text())["since"] == 256
    again = store.load_snapshot(key_for(ids), model.config)
    assert mx.array_equal(model(mx.array(NEXT), again), model(mx.array(NEXT), cache))
    snapshot_chain(model, store, doc_ids(1000), at=(128,))  # another prefill, not so far yet
    assert sorted(p.name for p in folder.glob("*.json")) == ["128.json"]


def test_a_snapshot_evicted_takes_the_later_ones_of_its_chain(model, tmp_path):
    """The budget evicts a snapshot with the snapshots that continue it (useless without it),
    counting all their bytes; prune by age likewise."""
    store = PrefixStore(tmp_path / "store")
    ids = doc_ids(1000)
    snapshot_chain(model, store, ids)
    prefix = model.make_cache()
    prefill(model, doc_ids(300), prefix)
    store.save(key_for(doc_ids(300)), prefix)
    chain = sorted((e for e in store.entries() if e.kind == "snapshot"), key=lambda e: e.tokens)
    for age, e in enumerate(chain):  # the first link the least recently used, as written
        os.utime(e.path.with_suffix(".json"), (1000 + age, 1000 + age))
    removed = store.prune(max_bytes=sum(e.bytes for e in store.entries()) - 1)
    assert sorted(e.tokens for e in removed) == [256, 512, 768]
    assert [e.kind for e in store.entries()] == ["prefix"]
    snapshot_chain(model, store, ids)
    for e in store.entries():
        if e.kind == "snapshot" and e.tokens == 512:
            os.utime(e.path.with_suffix(".json"), (1000, 1000))
    removed = store.prune(older_than_s=3600)
    assert sorted(e.tokens for e in removed) == [512, 768]
    assert store.load_snapshot(key_for(ids), model.config).offset == 256


def test_budget_evicts_least_recently_used(model, tmp_path):
    store = PrefixStore(tmp_path / "store")
    docs = [doc_ids(n) for n in (200, 210, 220)]
    for ids in docs:
        cache = model.make_cache()
        prefill(model, ids, cache)
        store.save(key_for(ids), cache)
    assert len(store.entries()) == 3
    store.load(key_for(docs[0]), model.config)  # the oldest is now the most recently used
    one = store.entries()[0].bytes
    removed = store.prune(max_bytes=int(one * 2.5))
    assert len(removed) == 1 and removed[0].total_tokens == 210
    assert store.load(key_for(docs[0]), model.config) is not None
    assert store.clear() > 0 and store.entries() == []


def test_two_processes_share_a_store(model, ckpt, tmp_path):
    root = tmp_path / "store"
    code = f"""
        import salabatch.engine
        from salabatch.engine.generate import prefill
        from salabatch.engine.load import load_model
        from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore
        import numpy as np
        model = load_model({str(ckpt)!r}, dtype="float32")
        store = PrefixStore({str(root)!r}, max_gb=0.001)  # small: evictions race with reads
        for n in range(150, 230, 10):
            ids = np.random.default_rng(n).integers(3, 256, size=n).tolist()
            key = PrefixKey.of("tiny", "m" * 64, "t" * 64, "float32", ids)
            cache = store.load(key, model.config)
            if cache is None:
                cache = model.make_cache()
                prefill(model, ids, cache)
                store.save(key, cache)
            assert cache.offset == n
        """
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read().decode()
        assert b"PrefixStoreWarning" not in p.stderr.read()
    store = PrefixStore(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every entry left must verify
        for e in store.entries():
            ids = np.random.default_rng(e.total_tokens).integers(3, 256, size=e.total_tokens)
            assert store.load(key_for(ids.tolist()), model.config) is not None


def test_a_corrupt_entry_is_rebuilt_by_the_next_prefill(model, tmp_path):
    store, key, path = stored_entry(model, tmp_path)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.warns(PrefixStoreWarning):
        again = DocumentCaches(model, store).get(key, doc_ids(300))
    assert again.source == "none" and store.has(key)
    assert store.load(key, model.config) is not None


def test_cache_commands(model, tmp_path):
    from click.testing import CliRunner

    from salabatch.cli import main

    store, key, _ = stored_entry(model, tmp_path)
    root = str(store.root)
    listed = CliRunner().invoke(main, ["cache", "ls", "--dir", root])
    assert listed.exit_code == 0 and "prefix" in listed.output and " 300 " in listed.output
    assert "1 entry," in listed.output
    pruned = CliRunner().invoke(main, ["cache", "prune", "--dir", root, "--max-gb", "0"])
    assert pruned.exit_code == 0 and "removed 1 entry," in pruned.output
    stored_entry(model, tmp_path / "again")
    cleared = CliRunner().invoke(
        main, ["cache", "clear", "--dir", str(tmp_path / "again" / "store"), "--yes"]
    )
    assert cleared.exit_code == 0 and "freed" in cleared.output
    assert CliRunner().invoke(main, ["cache", "ls", "--dir", root]).output.startswith("no stored")
