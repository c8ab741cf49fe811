"""A cache that fails never costs an answer: a prefix or snapshot save that fails, a store that
cannot be made, read or written, a builtin model that cannot be built in the cache dir — each
warns once, in one line, and the run answers every row. No temporary file survives a failed
write, and those of killed writers are counted (`cache ls`), swept and pruned.

The real file systems (a full and a read-only tmpfs) need root with CAP_SYS_ADMIN; elsewhere
those tests skip and the monkeypatched ones still cover the same paths."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from salabatch.engine.config import ModelConfig
from salabatch.engine.generate import prefill
from salabatch.engine.load import load_model
from salabatch.errors import CacheWarning, OutputError
from salabatch.files import temp_path, temp_pid
from salabatch.jobs.store import prefix_store
from salabatch.jobs.store.document_cache import DocumentCaches
from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore
from salabatch.models import resolve_model
from tests.jobs.run.test_runner import rows, run_cli, write_docs, write_job

FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model(tiny_model, dtype="float32")


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """The system temporary folder, inside this test's folder (a fallback build goes there)."""
    folder = tmp_path / "system-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def mount(tmp_path):
    """mount(folder, size, read_only): a tmpfs there, unmounted after the test."""
    mounted: list[Path] = []

    def mount_tmpfs(folder: Path, size: str = "2m", read_only: bool = False) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN); not root here")
        folder.mkdir(parents=True, exist_ok=True)
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount_tmpfs
    for folder in reversed(mounted):
        if subprocess.run(["umount", str(folder)]).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path) -> None:
    """Writes into `folder` until its file system is full."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def temps_in(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if temp_pid(p) is not None]


def warning_lines(output: str, text: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("warning:") and text in line]


def doc_ids(n: int) -> list[int]:
    return np.random.default_rng(n).integers(3, 256, size=n).tolist()


def key_for(ids) -> PrefixKey:
    return PrefixKey.of("tiny", "m" * 64, "t" * 64, "float32", ids)


def dead_pid() -> int:
    """The PID of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def stale_temp(dst: Path, pid: int, size: int = 1000) -> Path:
    """A temporary for `dst` as process `pid` would have left it."""
    tmp = temp_path(dst)
    tmp = tmp.with_name(tmp.name.replace(f"-{os.getpid()}-", f"-{pid}-"))
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(bytes(size))
    return tmp


# -- failures made by hand: they run everywhere ------------------------------------------------
def test_a_failed_prefix_save_answers_every_row_from_the_live_cache(
    tmp_path, tiny_model, monkeypatch
):
    calls = []

    def save_half_then_fail(path, arrays, meta, hashed):
        calls.append(path)
        path.write_bytes(bytes(3000))
        raise FULL

    monkeypatch.setattr(prefix_store, "_save_safetensors", save_half_then_fail)
    write_docs(tmp_path)
    result = run_cli("run", str(write_job(tmp_path, tiny_model)))
    assert result.exit_code == 0, result.output
    got = rows(tmp_path)
    assert len(got) == 9 and {r["status"] for r in got} == {"ok"}
    assert len(warning_lines(result.output, "No space left on device")) == 1, result.output
    assert len(calls) == 1  # two long documents: the first failure stops the store's writes
    assert temps_in(tmp_path / "cache") == []
    assert list((tmp_path / "cache" / "prefixes").iterdir()) == []


def test_a_failed_snapshot_save_lets_the_prefill_go_on(model, tmp_path, monkeypatch):
    def fail(path, arrays, meta, hashed):
        raise FULL

    monkeypatch.setattr(prefix_store, "_save_safetensors", fail)
    ids = doc_ids(700)
    store = PrefixStore(tmp_path / "store")
    caches = DocumentCaches(model, store, chunk=128, snapshot_every=256)
    with pytest.warns(CacheWarning, match="cannot store prefix caches") as caught:
        found = caches.get(key_for(ids), ids)
    assert len(caught) == 1 and found.source == "none" and found.cache.offset == 700
    assert store.entries() == [] and store.temps() == []


def test_a_store_that_cannot_be_made_is_a_miss_and_never_raises(model, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    store = PrefixStore(tmp_path / "a-file" / "cache")  # no one can make this folder
    ids = doc_ids(300)
    with pytest.warns(CacheWarning, match="a-file/cache: cannot store prefix caches") as caught:
        first = DocumentCaches(model, store, snapshot_every=128).get(key_for(ids), ids)
        assert store.load(key_for(ids), model.config) is None
        assert DocumentCaches(model, store).get(key_for(ids), ids).source == "none"
    assert len(caught) == 1 and first.source == "none" and first.cache.offset == 300
    assert store.prune(max_bytes=0) == [] and store.clear() == 0 and not store.has(key_for(ids))


def test_an_entry_that_cannot_be_read_is_a_miss_and_is_kept(model, tmp_path, monkeypatch):
    ids = doc_ids(300)
    cache = model.make_cache()
    prefill(model, ids, cache)
    PrefixStore(tmp_path / "store").save(key_for(ids), cache)

    def denied(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(prefix_store, "file_sha256", denied)
    store = PrefixStore(tmp_path / "store")
    with pytest.warns(CacheWarning, match="cannot read the stored prefix cache") as caught:
        assert store.load(key_for(ids), model.config) is None
        assert store.load(key_for(ids), model.config) is None
    assert len(caught) == 1 and store.has(key_for(ids))  # the entry may be fine: not removed


def test_builtin_tiny_is_built_in_a_private_folder_when_the_cache_dir_fails(
    tmp_path, private_tmp, monkeypatch
):
    from salabatch.demo import checkpoint

    real = checkpoint.write_random_checkpoint

    def full_in_the_cache(path, raw, *args):
        if private_tmp not in path.parents:
            (path / "model.safetensors").write_bytes(bytes(3 << 20))
            raise RuntimeError("[write] Unable to write 79358 bytes to file.")  # as MLX says
        return real(path, raw, *args)

    monkeypatch.setattr(checkpoint, "write_random_checkpoint", full_in_the_cache)
    with pytest.warns(CacheWarning, match="cannot build the builtin model there") as caught:
        built = resolve_model("builtin:random", tmp_path / "cache")
    assert len(caught) == 1 and private_tmp in built.parents
    assert (built / "model.safetensors").is_file() and (built / "tokenizer.json").is_file()
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # no 3 MB temp left there


def test_the_private_build_is_removed_when_the_process_ends(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    code = (
        "import warnings; warnings.simplefilter('ignore');"
        "from salabatch.models import resolve_model;"
        f"print(resolve_model('builtin:random', {str(tmp_path / 'a-file')!r}))"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    built = Path(done.stdout.strip())
    assert built.name == "builtin-random-v2" and tmp_path in built.parents
    assert not built.parent.exists()


# -- stale temporaries ---------------------------------------------------------------------------
def test_stale_temps_are_counted_by_ls_and_removed_by_prune(tmp_path):
    root = tmp_path / "store"
    dead = dead_pid()
    stale = [
        stale_temp(root / "prefixes" / f"{'a' * 64}.safetensors", dead, 3000),
        stale_temp(root / "snapshots" / ("b" * 64) / "512.json", dead, 1000),
        stale_temp(root / "fingerprints.json", dead, 500),
    ]
    build = stale_temp(root / "models" / "builtin-random-v2", dead, 0)
    build.unlink()
    build.mkdir()
    (build / "model.safetensors").write_bytes(bytes(1500))
    # entries are written under the store's lock, which ls and prune hold: one left in
    # prefixes/ is a killed writer's though its PID is alive (reused: a container's PID 1)
    stale.append(stale_temp(root / "prefixes" / f"{'c' * 64}.safetensors", os.getpid(), 2000))
    live = stale_temp(root / "models" / "builtin-tiny-v9", os.getpid(), 7000)  # a build going on

    listed = run_cli("cache", "ls", "--dir", str(root))
    assert listed.exit_code == 0, listed.output
    assert "5 stale temporary files, 7.8 KB" in listed.output  # 3000+1000+500+1500+2000
    pruned = run_cli("cache", "prune", "--dir", str(root), "--max-gb", "1")
    assert pruned.exit_code == 0, pruned.output
    assert "removed 0 entries, 0 B; 5 stale temporary files, 7.8 KB" in pruned.output
    assert not any(p.exists() for p in [*stale, build]) and live.exists()
    assert "stale" not in run_cli("cache", "ls", "--dir", str(root)).output


def test_the_store_sweeps_stale_temps_when_it_opens(tmp_path, tiny_model):
    root = tmp_path / "store"
    dead = stale_temp(root / "prefixes" / f"{'a' * 64}.safetensors", dead_pid())
    live = stale_temp(root / "prefixes" / f"{'b' * 64}.safetensors", os.getpid())
    manifest = stale_temp(root / "prefixes" / f"{'a' * 64}.json", os.getpid())
    manifest.write_text('{"position": 2, "tokens": 2}')  # a manifest being written
    store = PrefixStore(root)
    # unlocked, a live writer's temporaries may be writes in progress
    assert {t.path: t.stale for t in store.temps()} == {dead: True, live: False, manifest: False}
    assert store.entries() == []
    assert store.load(key_for([5, 6]), ModelConfig.from_file(tiny_model)) is None
    # opened, under the lock no entry is being written: every temporary of one is stale
    assert {t.path for t in store.swept} == {dead, live, manifest}
    assert not (dead.exists() or live.exists() or manifest.exists())


def test_the_budget_counts_temp_bytes(model, tmp_path):
    entries = []
    for n in (300, 301):
        cache = model.make_cache()
        prefill(model, doc_ids(n), cache)
        entries.append((key_for(doc_ids(n)), cache))
    probe = PrefixStore(tmp_path / "probe")
    probe.save(*entries[0])
    size = probe.entries()[0].bytes
    store = PrefixStore(tmp_path / "store", max_gb=2.5 * size / 2**30)  # two entries fit
    store.save(*entries[0])
    live = stale_temp(store.root / "models" / "x", os.getpid(), size)  # a model being built
    store.save(*entries[1])
    assert [e.total_tokens for e in store.entries()] == [301]
    live.unlink()


def test_a_killed_writers_temp_left_after_the_store_opened_goes_at_the_next_save(model, tmp_path):
    """A temporary another process's killed write leaves while this one runs: under the lock
    it is stale, and the next save removes it (it was counted, and live entries were evicted
    in its place for the rest of the process)."""
    entries = [prefilled(model, n) for n in (300, 301)]
    probe = PrefixStore(tmp_path / "probe")
    probe.save(*entries[0])
    size = probe.entries()[0].bytes
    store = PrefixStore(tmp_path / "store", max_gb=2.5 * size / 2**30)  # two entries fit
    store.save(*entries[0])
    dead = stale_temp(store.root / "prefixes" / f"{'d' * 64}.safetensors", dead_pid(), size)
    store.save(*entries[1])
    assert [e.total_tokens for e in store.entries()] == [301, 300]
    assert not dead.exists() and dead in {t.path for t in store.swept}


def prefilled(model, n: int):
    cache = model.make_cache()
    prefill(model, doc_ids(n), cache)
    return key_for(doc_ids(n)), cache


def test_a_prefix_in_place_of_its_snapshots_evicts_no_prefix_that_fits(model, tmp_path):
    """A saved prefix counted its own snapshots, about to go, against the budget: the most
    recently written entries, so older prefixes that fit were evicted instead."""
    entries = [prefilled(model, n) for n in (300, 301)]
    probe = PrefixStore(tmp_path / "probe")
    probe.save(*entries[0])
    size = probe.entries()[0].bytes
    store = PrefixStore(tmp_path / "store", max_gb=3.3 * size / 2**30)  # three prefixes fit
    for entry in entries:
        store.save(*entry)
    ids = doc_ids(302)
    DocumentCaches(model, store, chunk=64, snapshot_every=128).get(key_for(ids), ids)
    assert sorted(e.total_tokens for e in store.entries()) == [300, 301, 302]


def test_snapshots_keep_to_the_budget_and_a_cache_over_it_is_not_stored(model, tmp_path):
    """Snapshots were never evicted (a 1M-token prefill on the 9B writes ~8 GB of them,
    whatever max_gb says), and a prefix larger than the whole budget was stored anyway, every
    other entry evicted for it. Snapshots now evict only snapshots, then stop; a prefix over
    the budget is not stored; both say so once."""
    small = prefilled(model, 300)
    probe = PrefixStore(tmp_path / "probe")
    probe.save(*small)
    budget = int(2.1 * probe.entries()[0].bytes)  # under the 900-token prefix's ~2.7 times
    store = PrefixStore(tmp_path / "store", max_gb=budget / 2**30)
    store.save(*small)
    totals: list[int] = []
    ids = doc_ids(900)
    caches = DocumentCaches(model, store, chunk=32, snapshot_every=32)
    with pytest.warns(CacheWarning, match="within the store's budget") as caught:
        caches.get(key_for(ids), ids, lambda *_: totals.append(store_bytes(store)))
    said = sorted(str(w.message).split(": ")[-1] for w in caught)
    assert said == ["not stored", "prefill snapshots stop"]
    assert max(totals) <= budget and max(totals) > 1.5 * budget / 2.1  # snapshots were written
    assert [e.total_tokens for e in store.entries()] == [300]  # kept; the 900 over the budget


def store_bytes(store: PrefixStore) -> int:
    return sum(e.bytes for e in store.entries())


def test_prune_and_clear_that_cannot_change_the_store_say_so(model, tmp_path, monkeypatch):
    """On a read-only store they reported "removed 0 entries" / "freed 0 B", exit 0."""
    store = PrefixStore(tmp_path / "store")
    store.save(*prefilled(model, 300))
    monkeypatch.setattr(PrefixStore, "_remove", lambda self, stem: None)
    with pytest.raises(OutputError, match="cannot change the store .*cannot remove"):
        store.prune(max_bytes=0)

    def read_only(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(prefix_store.shutil, "rmtree", read_only)
    with pytest.raises(OutputError, match="Read-only file system"):
        store.clear()
    assert len(store.entries()) == 1


def test_snapshots_go_when_the_prefix_cannot_be_written(model, tmp_path, monkeypatch):
    """A full disk stops the store's writes: the snapshots of the prefill that finished were
    then kept for ever (their removal was a write too), holding the disk that is full."""
    real = prefix_store._save_safetensors

    def prefixes_fail(path, arrays, meta, hashed):
        if path.parent.name == "prefixes":
            raise FULL
        return real(path, arrays, meta, hashed)

    monkeypatch.setattr(prefix_store, "_save_safetensors", prefixes_fail)
    store = PrefixStore(tmp_path / "store")
    ids = doc_ids(400)
    with pytest.warns(CacheWarning, match="cannot store prefix caches"):
        DocumentCaches(model, store, chunk=64, snapshot_every=128).get(key_for(ids), ids)
    assert store.entries() == [] and not (store.root / "snapshots" / key_for(ids).digest).exists()


# -- real file systems: a full and a read-only cache dir ----------------------------------------
def test_a_job_on_a_full_cache_dir_answers_every_row(tmp_path, mount, private_tmp):
    cache = mount(tmp_path / "cache", size="2m")
    fill(cache)
    write_docs(tmp_path)
    result = run_cli("run", str(write_job(tmp_path, "builtin:random")))
    assert result.exit_code == 0, result.output
    got = rows(tmp_path)
    assert len(got) == 9 and {r["status"] for r in got} == {"ok"}
    assert len(warning_lines(result.output, "cannot build the builtin model there")) == 1
    assert len(warning_lines(result.output, "cannot store prefix caches")) == 1, result.output
    lines = warning_lines(result.output, str(cache))
    assert all(line.count("No space left on device") == 1 for line in lines), result.output
    assert temps_in(cache) == []


def test_a_read_only_cache_dir_answers_every_row(tmp_path, mount, private_tmp):
    cache = mount(tmp_path / "cache", read_only=True)
    write_docs(tmp_path)
    result = run_cli("run", str(write_job(tmp_path, "builtin:random")))
    assert result.exit_code == 0, result.output
    assert len(rows(tmp_path)) == 9 and {r["status"] for r in rows(tmp_path)} == {"ok"}
    lines = warning_lines(result.output, str(cache))
    assert lines and all("Read-only file system" in line for line in lines), result.output
    assert len(warning_lines(result.output, "cannot store prefix caches")) == 1


def test_a_read_only_store_still_serves_its_prefixes(tmp_path, mount, private_tmp):
    cache = mount(tmp_path / "cache", size="64m")
    write_docs(tmp_path)
    job = write_job(tmp_path, "builtin:random")
    assert run_cli("run", str(job)).exit_code == 0
    subprocess.run(["mount", "-o", "remount,ro", str(cache)], check=True)
    spec = yaml.safe_load(job.read_text())
    spec["questions"].append({"id": "when", "text": "When?"})
    job.write_text(yaml.safe_dump(spec))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # nothing needs writing: no warning
        result = run_cli("run", str(job))
    assert result.exit_code == 0, result.output
    new = [r for r in rows(tmp_path) if r["question_id"] == "when"]
    assert {r["status"] for r in new} == {"ok"}
    assert {r["cache_source"] for r in new if r["doc_id"] != "notes.txt"} == {"disk"}


# ---- damage no entry accounts for ------------------------------------------------------------


def stored(model, root: Path, n: int) -> PrefixKey:
    ids = doc_ids(n)
    cache = model.make_cache()
    prefill(model, ids, cache)
    PrefixStore(root).save(key_for(ids), cache)
    return key_for(ids)


@pytest.mark.parametrize("manifest", ["[]", '"text"', '{"position": null}', "{not json"])
def test_a_manifest_that_is_not_one_is_a_miss_then_swept_and_breaks_nothing(
    model, tmp_path, manifest
):
    """A store with such a manifest still lists, prunes, evicts and saves the others; the
    entry itself is a miss (warned, removed), and a store opening later sweeps it."""
    root = tmp_path / "store"
    bad, good = stored(model, root, 300), stored(model, root, 310)
    (root / "prefixes" / f"{bad.digest}.json").write_text(manifest)
    store = PrefixStore(root)
    assert [e.digest for e in store.entries()] == [good.digest]
    damaged = {t.path.name for t in store.temps() if t.stale}  # listed by `cache ls`
    assert damaged == {f"{bad.digest}.json", f"{bad.digest}.safetensors"}
    with pytest.warns(CacheWarning, match="removed"):
        assert store.load(good, model.config) is not None  # the store opens: swept
    assert not (root / "prefixes" / f"{bad.digest}.safetensors").exists()
    assert store.prune(older_than_s=3600) == [] and store.prune(max_bytes=1 << 40) == []
    assert [e.digest for e in store.entries()] == [good.digest] and store.temps() == []


def test_a_data_file_whose_manifest_was_never_written_is_swept_and_counted(model, tmp_path):
    """A writer killed between its two renames leaves data and no manifest: nothing reads it,
    and the store's next opening removes it (it holds the exclusive lock: no write is
    between its renames then)."""
    root = tmp_path / "store"
    key = stored(model, root, 300)
    data = root / "prefixes" / f"{key.digest}.safetensors"
    data.with_suffix(".json").unlink()
    size = data.stat().st_size
    store = PrefixStore(root)
    assert store.entries() == [] and [(t.bytes, t.stale) for t in store.temps()] == [(size, True)]
    with pytest.warns(CacheWarning, match="did not finish"):
        assert store.load(key, model.config) is None
    assert not data.exists() and [t.bytes for t in store.swept] == [size]


def test_the_last_snapshot_of_a_prefix_leaves_no_empty_folder(model, tmp_path):
    root = tmp_path / "store"
    ids = doc_ids(300)
    cache = model.make_cache()
    cache.plan_prefill(len(ids))
    prefill(model, ids[:128], cache)
    store = PrefixStore(root)
    store.save_snapshot(key_for(ids), cache)
    (snapshot,) = [e for e in store.entries() if e.kind == "snapshot"]
    store.prune(older_than_s=0)
    assert list((root / "snapshots").iterdir()) == []
    (root / "snapshots" / ("0" * 64)).mkdir()  # one an older salabatch left
    assert PrefixStore(root).prune(older_than_s=3600) == []
    assert list((root / "snapshots").iterdir()) == []


def test_pruning_by_age_alone_keeps_what_is_newer_whatever_the_budget(model, tmp_path):
    """`cache prune --older-than` removes only what is that old: the store's own budget (a
    writer's) is not applied by a prune that gave none."""
    root = tmp_path / "store"
    keys = [stored(model, root, n) for n in (300, 310)]
    store = PrefixStore(root, max_gb=1e-9)
    assert store.prune(older_than_s=3600) == []
    assert all(store.has(k) for k in keys)


def test_the_lengths_of_the_stored_prefixes_follow_the_folder(model, tmp_path):
    """What the server tries a prompt's prefixes at (another process's entries included)."""
    root = tmp_path / "store"
    store = PrefixStore(root)
    assert store.prefix_lengths() == frozenset()
    first = stored(model, root, 300)
    assert store.prefix_lengths() == {300}
    stored(model, root, 310)  # by another store object: another process
    assert store.prefix_lengths() == {300, 310}
    store.prune(older_than_s=-1)  # every entry
    assert store.prefix_lengths() == frozenset() and not store.has(first)


def test_a_manifest_renamed_in_the_tick_of_a_listing_is_seen_at_the_next(model, tmp_path):
    """A folder's time ticks coarsely: an entry written in the tick of the last listing left
    the time it saw, and the server never tried that prefix until the folder changed again.
    (The tick is made here: the folder's time set back to what the listing saw.)"""
    root = tmp_path / "store"
    stored(model, root, 300)
    store, folder = PrefixStore(root), root / "prefixes"
    tick = time.time_ns() + 10**9  # this tick (a clock a little ahead of ours)
    os.utime(folder, ns=(tick, tick))
    assert store.prefix_lengths() == {300}
    stored(model, root, 310)
    os.utime(folder, ns=(tick, tick))
    assert store.prefix_lengths() == {300, 310}


def test_cache_ls_waits_for_a_write_in_progress_instead_of_calling_it_stale(model, tmp_path):
    """A writer holds the exclusive lock from its data file to its manifest: `cache ls`
    (`listing`) reads under the shared lock, so it never sees the one without the other."""
    import fcntl
    import threading

    root = tmp_path / "store"
    key = stored(model, root, 300)
    manifest = root / "prefixes" / f"{key.digest}.json"
    held = manifest.read_bytes()
    manifest.unlink()  # between the writer's two renames...
    listed = []
    with open(root / ".lock", "a+") as lock:  # ...which it does under the exclusive lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        reader = threading.Thread(target=lambda: listed.append(PrefixStore(root).listing()))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not listed  # waits for the write
        manifest.write_bytes(held)  # the write ends
        fcntl.flock(lock, fcntl.LOCK_UN)
    reader.join(60)
    ((entries, temps),) = listed
    assert [e.digest for e in entries] == [key.digest] and temps == []
