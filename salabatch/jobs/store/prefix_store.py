"""Prefix caches on disk: a document is prefilled once, then reused by later runs and questions.

Layout under the store's root (the job's `cache.dir`):
  prefixes/<digest>.safetensors   the cache's arrays (`ModelCache.to_state`), metadata in the header
  prefixes/<digest>.json          its manifest, written last: size, sha256 and what it belongs to
  snapshots/<digest>/<pos>.*      a partial prefill at <pos> tokens (resume after a crash): the
                                  first one whole, each later one only what came after the one
                                  before it (`since` in its manifest; the keys of its own tokens,
                                  the lightning states whole), so that a long prefill writes each
                                  token's keys once; read back as the chain of them
  .lock                           flock: exclusive to change the store, shared to read it

The digest is a content address: sha256 of (model fingerprint, tokenizer fingerprint, dtype,
sha256 of the document prompt's token ids). Writes go to a temporary file, are fsync'd and
renamed; reads check size and sha256 and the manifest's identity fields; an entry that fails any
check is reported (PrefixStoreWarning), deleted and rebuilt, never used. A size budget evicts the
least recently used entries before each write, counting the temporary files in the store too;
a prefill's snapshots evict only snapshots and stop where there is no room, a prefix larger than
the budget is not stored (`_room`). Each process that writes applies its own budget (a run its
job's `cache.max_gb`, a server its `--store-gb`).

The store is an optimisation and never costs an answer: a store that cannot be written
(read-only, full, no permission, a folder that cannot be made) warns once and stores nothing
more in this run (removals still run: they free room); a file that cannot be read is a miss.
When the store opens (its first locked use) it removes the temporaries of writers that died
(killed mid-write): entries are written under the exclusive lock, so under either lock every
temporary among them is a dead writer's, whatever its PID names now (`files.temp_path` names
carry it; the builtin models' builds, made without the lock, are judged by it). What no entry
accounts for counts as such a stale temporary (listed, in the budget, swept, a warning naming
it): a data file whose manifest was never written (a writer killed between its two renames;
under the exclusive lock, where the sweep runs, no write is between them) and a manifest that is
not one (damaged). Sweeps and prunes also remove empty snapshot folders.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import mlx.core as mx

from salabatch.engine.cache import ModelCache
from salabatch.engine.config import ModelConfig
from salabatch.engine.fingerprint import file_sha256
from salabatch.errors import CacheFormatError, CacheWarning, OutputError, error_text
from salabatch.files import (
    disk_bytes,
    pid_alive,
    remove_path,
    temp_pid,
    write_atomic,
    write_text_atomic,
)

T = TypeVar("T")

# How long a folder's modification time may still be followed by a change in its tick
SETTLE_NS = 3 * 10**9


class PrefixStoreWarning(CacheWarning):
    """The prefix store could not be used as it should: a stored cache was unusable (corrupt,
    truncated, mismatched) and was removed, or the store cannot be written or read."""


@dataclass(frozen=True)
class PrefixKey:
    """What a stored cache must match to be reused."""

    model: str  # display name (path or builtin id); not part of the identity
    model_fingerprint: str
    tokenizer_fingerprint: str
    dtype: str
    ids_sha256: str
    tokens: int
    # the document it was first stored for, for `cache ls`; not part of the identity (the same
    # text under another name is the same prefix)
    document: str = ""

    @classmethod
    def of(
        cls,
        model: str,
        model_fp: str,
        tokenizer_fp: str,
        dtype: str,
        ids: Sequence[int],
        document: str = "",
    ):
        data = b"".join(int(i).to_bytes(4, "little") for i in ids)
        sha = hashlib.sha256(data).hexdigest()
        return cls(model, model_fp, tokenizer_fp, dtype, sha, len(ids), document)

    @property
    def digest(self) -> str:
        parts = (self.model_fingerprint, self.tokenizer_fingerprint, self.dtype, self.ids_sha256)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def identity(self) -> dict[str, str]:
        """The fields a manifest and a file header must repeat exactly."""
        return {k: str(v) for k, v in asdict(self).items() if k not in ("model", "document")}


@dataclass(frozen=True)
class Entry:
    """One stored cache, as `salabatch cache ls` shows it."""

    digest: str
    kind: str  # "prefix" | "snapshot"
    path: Path
    bytes: int
    tokens: int  # tokens the cache holds (a snapshot: how far the prefill got)
    total_tokens: int  # the document prompt's length (a complete prefix's tokens)
    model: str
    dtype: str
    created: float
    last_used: float
    document: str = ""  # what it was stored for ("" for an entry of an older salabatch)


@dataclass(frozen=True)
class Temp:
    """A temporary file (or a builtin model's build folder) in the store; or, stale, what no
    entry accounts for (`PrefixStore._scan`)."""

    path: Path
    bytes: int
    stale: bool  # its writer is gone: killed mid-write; nothing will finish or remove it


class PrefixStore:
    """The store under `root`, with a budget of `max_gb`. Constructing one touches no file:
    the folder is made, and stale temporaries swept, at its first locked use."""

    def __init__(self, root: str | Path, max_gb: float = 50.0) -> None:
        self.root = Path(root).expanduser()
        self.max_bytes = int(max_gb * 2**30)
        self.swept: list[Temp] = []  # stale temporaries removed when the store opened
        self._opened = False
        self._cannot_write: str | None = None  # why writes stopped, once one failed
        self._too_large: set[str] = set()  # kinds of entry that found no room, reported
        self._read_failed = False  # a read failure was reported
        self._lengths: tuple[int, frozenset[int]] = (-1, frozenset())  # (folder mtime, lengths)
        self._lengths_of: dict[str, int] = {}  # manifest name → its tokens, as last listed

    # -- complete prefixes -----------------------------------------------------------------
    def load(self, key: PrefixKey, cfg: ModelConfig) -> ModelCache | None:
        """The stored cache of this exact prefix, or None (also when it failed a check)."""
        with self._lock(shared=True):
            return self._read(self._entry_stem(key), key, cfg, key.tokens)

    def has(self, key: PrefixKey) -> bool:
        """Whether a complete cache of this prefix is stored (not verified: see `load`)."""
        with contextlib.suppress(OSError):
            return self._entry_stem(key).with_suffix(".json").exists()
        return False

    def snapshot_tokens(self, key: PrefixKey) -> int:
        """The tokens the furthest snapshot of this prefix's prefill holds, 0 for none (not
        verified: see `load_snapshot`)."""
        folder = self.root / "snapshots" / key.digest
        return max((_position(m) for m in _manifests(folder, "*.json")), default=0)

    def save(self, key: PrefixKey, cache: ModelCache) -> None:
        """Stores a complete prefix cache in place of its prefill's snapshots, least recently
        used entries evicted first to make room for it; one larger than the whole budget is
        not stored (a warning says so, once)."""
        stem = self._entry_stem(key)

        def change() -> None:
            _remove_tree(self.root / "snapshots" / key.digest)  # no longer needed, nor counted
            state = cache.to_state()
            if self._room(state, stem, "prefix"):
                self._write(stem, key, cache.offset, state, "prefix")

        self._change(change)

    # -- snapshots of a prefill in progress ---------------------------------------------------
    def load_snapshot(self, key: PrefixKey, cfg: ModelConfig) -> ModelCache | None:
        """The furthest usable snapshot of this prefix's prefill (its chain read and checked
        link by link), or None. A link that fails its checks goes, with the later ones."""
        folder = self.root / "snapshots" / key.digest
        with self._lock(shared=True):
            for manifest in sorted(_manifests(folder, "*.json"), key=lambda p: -_position(p)):
                parts = self._read_chain(folder, key, _position(manifest))
                if parts is None:
                    continue
                source = str(manifest.with_suffix(".safetensors"))
                try:
                    return ModelCache.from_state(
                        *ModelCache.joined_state(parts, source), cfg, source
                    )
                except CacheFormatError as e:
                    self._unusable(manifest.with_suffix(""), f"unreadable ({e})")
        return None

    def save_snapshot(self, key: PrefixKey, cache: ModelCache) -> None:
        """Stores a partial prefill: what came after the furthest snapshot of the same prefix
        before it (whole where there is none), which stays as its chain's link."""
        folder = self.root / "snapshots" / key.digest

        def change() -> None:
            positions = [_position(m) for m in _manifests(folder, "*.json")]
            for later in (p for p in positions if p >= cache.offset):  # another prefill's
                self._remove(folder / str(later))
            since = max((p for p in positions if p < cache.offset), default=0)
            state = cache.to_state(since)
            if self._room(state, folder, "snapshot"):  # its chain is kept: the link continues it
                self._write(folder / str(cache.offset), key, cache.offset, state, "snapshot")

        self._change(change)

    def drop_snapshots(self, key: PrefixKey) -> None:
        """Removes the snapshots of a prefill that finished; also once writes have failed (a
        full disk: what they hold is freed)."""
        folder = self.root / "snapshots" / key.digest
        self._change(lambda: _remove_tree(folder), removing=True)

    # -- housekeeping ----------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every stored cache, most recently used first."""
        return self._scan()[0]

    def temps(self) -> list[Temp]:
        """The temporary files and build folders in the store: writes in progress, and stale
        ones whose writer died, with what no entry accounts for (`cache ls` counts them, the
        budget includes them)."""
        return self._temps(self._scan()[1], locked=False)

    def listing(self) -> tuple[list[Entry], list[Temp]]:
        """`entries()` and `temps()` read together under the shared lock, as `cache ls` shows
        them: a write in progress (its data file before its manifest) is not taken for one a
        killed writer left."""
        if not self.root.is_dir():
            return [], []  # nothing stored, and looking makes nothing
        with self._flock(shared=True):  # not opened: what killed writers left is listed, kept
            entries, unaccounted = self._scan()
            return entries, self._temps(unaccounted)

    def _temps(self, unaccounted: list[Path], locked: bool = True) -> list[Temp]:
        """The temporaries (see `temps`). Entries are written under the exclusive lock: to a
        caller `locked` (holding either lock), a temporary among them is a killed writer's,
        whatever its PID now names (reused: a container's writer is PID 1 on every run).
        Builtin models are built without the lock: their writer's PID tells."""
        entries = [self.root / "prefixes", *_glob(self.root, "snapshots/*")]
        out = []
        for folder in [self.root, self.root / "models", *entries]:
            for path in _glob(folder, ".*"):
                pid = temp_pid(path)
                if pid is not None:
                    stale = (locked and folder in entries) or not pid_alive(pid)
                    out.append(Temp(path, disk_bytes(path), stale=stale))
        return out + [Temp(p, disk_bytes(p), stale=True) for p in unaccounted]

    def prefix_lengths(self) -> frozenset[int]:
        """The token counts of the complete prefixes stored, of any model: the lengths at which
        a prompt may start with another process's entry (a run's document, for the server).
        The folder is listed again only when it changed, and only new manifests are read (a
        server asks before every prompt, on its engine thread). A folder changed within the
        last `SETTLE_NS` is listed again at every call: its time ticks coarsely (a few ms on
        ext4, 2 s on FAT), so a manifest renamed into it in the tick of a listing leaves the
        time as that listing saw it, and would go unseen until the folder next changed."""
        folder = self.root / "prefixes"
        try:
            stamp = folder.stat().st_mtime_ns
        except OSError:
            return frozenset()
        if stamp != self._lengths[0] or time.time_ns() - stamp < SETTLE_NS:
            known = self._lengths_of
            self._lengths_of = {}
            for m in _manifests(folder, "*.json"):
                if m.name in known:
                    self._lengths_of[m.name] = known[m.name]
                else:
                    for e in self._entry(m, "prefix"):
                        self._lengths_of[m.name] = e.total_tokens
            self._lengths = (stamp, frozenset(self._lengths_of.values()))
        return self._lengths[1]

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None) -> list[Entry]:
        """Removes entries unused for `older_than_s`, then the least recently used over
        `max_bytes` (each only where given). Returns what was removed (the stale temporaries
        and damaged files removed on opening are in `swept`); OutputError where the store
        cannot be changed (read-only)."""

        def change() -> list[Entry]:
            removed: list[Entry] = []
            now = time.time()
            entries = self.entries()
            for e in entries:
                old = older_than_s is not None and now - e.last_used > older_than_s
                if old and e not in removed:
                    removed += self._drop(e, entries)
            removed += [] if max_bytes is None else self._evict(max_bytes=max_bytes)
            self._drop_empty_snapshot_folders()
            if kept := [e for e in removed if e.path.with_suffix(".json").exists()]:
                raise OSError(f"cannot remove {kept[0].path} (a read-only store?)")
            return removed

        if not self.root.is_dir():
            return []  # nothing stored
        return self._change(change, strict=True) or []

    def clear(self) -> int:
        """Removes every entry; returns the bytes freed; OutputError where the store cannot be
        changed (read-only)."""

        def change() -> int:
            before = sum(e.bytes for e in self.entries())
            _remove_tree(self.root / "prefixes")
            _remove_tree(self.root / "snapshots")
            return before - sum(e.bytes for e in self.entries())

        if not self.root.is_dir():
            return 0  # nothing stored
        return self._change(change, strict=True) or 0

    # -- opening, locking, failing ---------------------------------------------------------------
    def _open(self) -> None:
        """On first use: make the folder, remove the temporaries of writers that died (a
        store that cannot be changed is only warned about if there is something to change)."""
        if self._opened:
            return
        self._opened = True
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._stop_writing(e)
            return
        if self.temps():  # which are stale is known under the lock
            self._change(self._sweep)

    def _sweep(self, unaccounted: list[Path] | None = None) -> None:
        """(Under the exclusive lock) removes the stale temporaries, and what no entry accounts
        for (`unaccounted`, else `_scan`'s) with a warning naming it."""
        for t in self._temps(self._scan()[1] if unaccounted is None else unaccounted):
            if t.stale and temp_pid(t.path) is None:  # not a temporary: unaccounted
                warnings.warn(
                    f"{t.path}: left by a write that did not finish, or damaged; removed",
                    PrefixStoreWarning,
                    stacklevel=2,
                )
            if t.stale and remove_path(t.path):
                self.swept.append(t)
        self._drop_empty_snapshot_folders()

    def _drop_empty_snapshot_folders(self) -> None:
        for folder in _glob(self.root, "snapshots/*"):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only where empty

    def _scan(self) -> tuple[list[Entry], list[Path]]:
        """(every entry, most recently used first; what no entry accounts for: data files
        without their manifest, and manifests that are not one, with their data), each
        manifest read once."""
        entries: list[Entry] = []
        unaccounted: list[Path] = []
        snapshots = [(folder, "snapshot") for folder in _glob(self.root, "snapshots/*")]
        for folder, kind in [(self.root / "prefixes", "prefix"), *snapshots]:
            for data in _manifests(folder, "*.safetensors"):
                if not data.with_suffix(".json").exists():
                    unaccounted.append(data)
            for manifest in _manifests(folder, "*.json"):
                try:
                    entries.append(_parse_entry(manifest, kind))
                except OSError:
                    continue  # cannot be read here: not this process's to judge
                except ValueError:
                    pair = (manifest, manifest.with_suffix(".safetensors"))
                    unaccounted += [p for p in pair if p.exists()]
        return sorted(entries, key=lambda e: -e.last_used), unaccounted

    @contextlib.contextmanager
    def _lock(self, shared: bool = False) -> Iterator[None]:
        """The store opened (`_open`), then `_flock`."""
        self._open()
        with self._flock(shared):
            yield

    @contextlib.contextmanager
    def _flock(self, shared: bool = False) -> Iterator[None]:
        """flock on the store: many readers, one writer, across processes. A reader that
        cannot make the lock file (a read-only or foreign store) reads unlocked: each entry
        is verified as it is read anyway."""
        with contextlib.ExitStack() as stack:
            try:
                f = stack.enter_context(open(self.root / ".lock", "a+"))
            except OSError:
                if not shared:
                    raise
            else:
                fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                stack.callback(fcntl.flock, f, fcntl.LOCK_UN)
            yield

    def _change(self, change: Callable[[], T], *, removing=False, strict=False) -> T | None:
        """`change()` under the exclusive lock; None once writing has failed (unless it only
        `removing` files: that frees room). A write that fails (read-only, full, no permission)
        stops this store's writes for the rest of the run, with one warning: a full disk stays
        full, and each failure costs time. `strict` (prune, clear: what a user asked for) raises
        OutputError instead."""
        self._open()
        if self._cannot_write is not None and not (removing or strict):
            return None
        try:
            with self._lock():
                return change()
        except OSError as e:
            if strict:
                message = f"cannot change the store ({error_text(e)})"
                raise OutputError(message, path=self.root) from None
            if not removing:
                self._stop_writing(e)
            return None

    def _stop_writing(self, e: OSError) -> None:
        if self._cannot_write is None:
            self._cannot_write = error_text(e)
            warnings.warn(
                f"{self.root}: cannot store prefix caches ({self._cannot_write}); "
                "the work goes on without storing them",
                PrefixStoreWarning,
                stacklevel=2,
            )

    def _cannot_read(self, path: Path, e: OSError) -> None:
        if not self._read_failed:
            self._read_failed = True
            warnings.warn(
                f"{path}: cannot read the stored prefix cache ({error_text(e)}); "
                "the document is prefilled instead",
                PrefixStoreWarning,
                stacklevel=2,
            )

    # -- entries -----------------------------------------------------------------------------
    def _entry_stem(self, key: PrefixKey) -> Path:
        """A complete prefix's entry, without its suffix (.json manifest, .safetensors data)."""
        return self.root / "prefixes" / key.digest

    def _room(
        self, state: tuple[dict[str, mx.array], dict[str, str]], keep: Path, kind: str
    ) -> bool:
        """Makes room for `state` (`ModelCache.to_state`'s) within the budget, evicting the
        least recently used entries but `keep` (a prefix's stem, or a snapshot folder: its
        chain); a snapshot evicts only other snapshots (a prefill's snapshots go when it ends:
        prefixes evicted for them would be lost for nothing). False, with a warning once for
        each kind, when it cannot fit even so."""
        size = sum(a.nbytes for a in state[0].values())
        scanned = self._scan()  # read once, for this and for `_evict`
        kept = 0  # a prefix stored again replaces itself
        if kind == "snapshot":  # its chain stays, and so do the prefixes
            kept = sum(e.bytes for e in scanned[0] if keep == e.path.parent or e.kind == "prefix")
        if size + kept <= self.max_bytes:
            self._evict(keep=keep, room=size, snapshots_only=kind == "snapshot", scanned=scanned)
            return True
        if kind not in self._too_large:
            self._too_large.add(kind)
            what = "prefill snapshots stop" if kind == "snapshot" else "not stored"
            warnings.warn(
                f"{self.root}: no room for a {kind} of {size / 2**20:.1f} MB within the "
                f"store's budget of {self.max_bytes / 2**20:.1f} MB (max_gb): {what}",
                PrefixStoreWarning,
                stacklevel=4,
            )
        return False

    def _write(
        self,
        stem: Path,
        key: PrefixKey,
        position: int,
        state: tuple[dict[str, mx.array], dict[str, str]],
        kind: str,
    ) -> None:
        """Writes the data (`state`, see `ModelCache.to_state`: what came after its `since`),
        then its manifest; a failure leaves neither (nor a temporary)."""
        arrays, meta = state
        since = int(meta.get("since", "0"))
        data = stem.with_suffix(".safetensors")
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)
            # through a Python file, so a failed write is an OSError with its reason (a path
            # given to MLX fails as a RuntimeError that names no cause)
            hashed = hashlib.sha256()  # of the bytes as they are written (no reading back)
            write_atomic(
                data, lambda tmp: _save_safetensors(tmp, arrays, meta | key.identity(), hashed)
            )
            manifest = {
                **key.identity(),
                "model": key.model,
                "document": key.document,
                "kind": kind,
                "position": position,
                "since": since,
                "bytes": data.stat().st_size,
                "sha256": hashed.hexdigest(),
                "created": time.time(),
            }
            # the commit point: a data file without its manifest is never read
            write_text_atomic(stem.with_suffix(".json"), json.dumps(manifest, indent=1))
        except OSError:
            self._remove(stem)
            raise

    def _read(self, stem: Path, key: PrefixKey, cfg: ModelConfig, position: int):
        """The cache of a whole entry, or None (missing, unreadable here, or failing a check:
        then removed)."""
        state = self._read_state(stem, key, position)
        if state is None:
            return None
        data_path = str(stem.with_suffix(".safetensors"))
        try:
            return ModelCache.from_state(*state, cfg, data_path)
        except CacheFormatError as e:
            self._unusable(stem, f"unreadable ({e})")
            return None

    def _read_chain(self, folder: Path, key: PrefixKey, position: int) -> list | None:
        """The states of the snapshot at `position` and of the links it continues, first link
        first; None where one is missing, unreadable or fails its checks (which goes, with
        every later snapshot: they continue it)."""
        parts = []
        while True:
            state = self._read_state(folder / str(position), key, position)
            if state is None:
                if not (folder / f"{position}.json").exists():  # a link gone: the rest is void
                    self._remove(folder / str(position))
                return None
            parts.append(state)
            since = int(state[1].get("since", "0"))
            if since == 0:
                return parts[::-1]
            position = since

    def _read_state(self, stem: Path, key: PrefixKey, position: int):
        """(arrays, header) of an entry's data once its manifest and checksum check out, or
        None (missing, unreadable here, or failing a check: then removed)."""
        manifest_path, data_path = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
        problem = None
        try:
            if not manifest_path.exists():
                return None
            manifest = json.loads(manifest_path.read_text())
            if not isinstance(manifest, dict):
                problem = "its manifest is not a JSON object"
            elif any(manifest.get(k) != v for k, v in key.identity().items()):
                problem = "it belongs to another model, tokenizer, dtype or document prompt"
            elif manifest.get("position") != position:
                problem = f"it holds {manifest.get('position')} tokens, expected {position}"
            elif data_path.stat().st_size != manifest["bytes"]:
                problem = f"truncated: {data_path.stat().st_size} of {manifest['bytes']} bytes"
            elif file_sha256(data_path) != manifest["sha256"]:
                problem = "its checksum does not match (corrupt)"
            else:
                arrays, header = mx.load(str(data_path), return_metadata=True)
                if any(header.get(k) != v for k, v in key.identity().items()):
                    problem = "its header belongs to another entry"
                elif header.get("since", "0") != str(manifest.get("since", 0)):
                    problem = "its header and its manifest disagree"
                else:
                    with contextlib.suppress(OSError):  # a read-only store: no LRU order
                        os.utime(manifest_path)  # last use, for LRU eviction
                    return arrays, header
        except FileNotFoundError as e:
            problem = f"unreadable ({e})"  # a manifest whose data is gone
        except OSError as e:  # permission, I/O: the entry may be fine, this process cannot read it
            self._cannot_read(data_path, e)
            return None
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            problem = f"unreadable ({e})"
        self._unusable(stem, problem)
        return None

    def _unusable(self, stem: Path, problem: str) -> None:
        """Reports an entry that failed a check, and removes it (a snapshot: with the later
        ones, which continue it)."""
        warnings.warn(
            f"prefix cache {stem.with_suffix('.safetensors')} is unusable, {problem}; it is "
            "removed and rebuilt",
            PrefixStoreWarning,
            stacklevel=4,
        )
        self._remove(stem)  # under the shared lock too: unlinking is atomic

    def _remove(self, stem: Path) -> None:
        """Removes an entry where it can (a read-only store keeps it, and it is never used
        unless it verifies); a snapshot with the later ones of its prefix, which continue it."""
        stems = [stem]
        if stem.parent.parent.name == "snapshots":
            later = [m for m in _manifests(stem.parent, "*.json") if _position(m) > int(stem.name)]
            stems += [m.with_suffix("") for m in later]
        for gone in stems:
            for suffix in (".json", ".safetensors"):
                with contextlib.suppress(OSError):
                    gone.with_suffix(suffix).unlink(missing_ok=True)
        if stem.parent.parent.name == "snapshots":  # its prefix's last snapshot: the folder too
            with contextlib.suppress(OSError):
                stem.parent.rmdir()

    def _evict(
        self,
        keep: Path | None = None,
        max_bytes: int | None = None,
        room: int = 0,
        snapshots_only: bool = False,
        scanned: tuple[list[Entry], list[Path]] | None = None,
    ) -> list[Entry]:
        """Removes the least recently used entries (`snapshots_only`: snapshots) until the
        store and `room` more bytes fit the budget (`max_bytes`, else the store's), never
        `keep` (an entry's stem, or a snapshot folder). `scanned`: `_scan()` just made."""
        budget = (self.max_bytes if max_bytes is None else max_bytes) - room
        entries, unaccounted = scanned or self._scan()
        # (under the exclusive lock) what killed writers left since the store opened goes
        # first: counted, it evicted live entries in its place for the rest of the process
        self._sweep(unaccounted)
        total = sum(e.bytes for e in entries) + sum(t.bytes for t in self._temps([]))
        removed: list[Entry] = []
        for e in reversed(entries):  # least recently used first
            if total <= budget:
                break
            if keep in (e.path, e.path.parent) or e in removed:
                continue
            if snapshots_only and e.kind != "snapshot":
                continue
            gone = self._drop(e, entries)
            total -= sum(x.bytes for x in gone)
            removed += gone
        return removed

    def _drop(self, entry: Entry, entries: list[Entry]) -> list[Entry]:
        """Removes `entry` (`_remove`); → the entries of `entries` that went: it, and for a
        snapshot the later ones of its prefix, which continue it."""
        self._remove(entry.path)
        if entry.kind != "snapshot":
            return [entry]
        return [
            x for x in entries if x.path.parent == entry.path.parent and x.tokens >= entry.tokens
        ]

    def _entry(self, manifest: Path, kind: str) -> list[Entry]:
        """[its Entry], or [] for a manifest that cannot be read or is damaged (the store
        removes those when it next opens: `_sweep`)."""
        try:
            return [_parse_entry(manifest, kind)]
        except (OSError, ValueError):
            return []


def _parse_entry(manifest: Path, kind: str) -> Entry:
    """The Entry of a manifest; ValueError for one that is not a manifest, OSError for one that
    cannot be read."""
    try:
        m = json.loads(manifest.read_text())
        data = manifest.with_suffix(".safetensors")
        return Entry(
            digest=manifest.parent.name if kind == "snapshot" else manifest.stem,
            kind=kind,
            path=manifest.with_suffix(""),
            bytes=data.stat().st_size if data.exists() else 0,
            tokens=int(m["position"]),
            total_tokens=int(m["tokens"]),
            model=str(m.get("model", "?")),
            dtype=str(m.get("dtype", "?")),
            created=float(m.get("created") or 0),
            last_used=manifest.stat().st_mtime,
            document=str(m.get("document", "")),
        )
    except (KeyError, TypeError, AttributeError) as e:  # valid JSON, but no manifest
        raise ValueError(f"not a manifest ({e})") from None


def _save_safetensors(
    path: Path, arrays: dict[str, mx.array], meta: dict[str, str], hashed
) -> None:
    """Writes the file, each byte also into `hashed` (a hashlib object)."""
    with open(path, "wb") as f:
        mx.save_safetensors(_Hashing(f, hashed), arrays, meta)


class _Hashing:
    """A file written through, its bytes hashed as they go (MLX writes a safetensors file in
    order, the header first, and never seeks back)."""

    def __init__(self, f, hashed) -> None:
        self.f, self.hashed = f, hashed

    def write(self, data) -> int:
        self.hashed.update(data)
        return self.f.write(data)

    def __getattr__(self, name: str):
        return getattr(self.f, name)


def _remove_tree(folder: Path) -> None:
    """Removes `folder` and what it holds, if it is there (OSError where it cannot)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(folder)


def _manifests(folder: Path, pattern: str) -> list[Path]:
    """The manifests `pattern` matches, not the temporaries of manifests being written."""
    return [p for p in _glob(folder, pattern) if temp_pid(p) is None]


def _glob(folder: Path, pattern: str) -> list[Path]:
    """`folder.glob(pattern)`, empty where the folder cannot be listed."""
    try:
        return list(folder.glob(pattern))
    except OSError:
        return []


def _position(manifest: Path) -> int:
    try:
        return int(manifest.stem)
    except ValueError:
        return -1
