"""Prefix caches on disk: a document is prefilled once, then reused by later runs and questions.

Layout under the store's root (the job's `cache.dir`):
  prefixes/<digest>.safetensors   the cache's arrays (`ModelCache.to_state`), metadata in the header
  prefixes/<digest>.json          its manifest, written last: size, sha256 and what it belongs to
  snapshots/<digest>/<pos>.*      the same for a partial prefill (resume after a crash)
  .lock                           flock: exclusive to change the store, shared to read it

The digest is a content address: sha256 of (model fingerprint, tokenizer fingerprint, dtype,
sha256 of the document prompt's token ids). Writes go to a temporary file, are fsync'd and
renamed; reads check size and sha256 and the manifest's identity fields; an entry that fails any
check is reported (PrefixStoreWarning), deleted and rebuilt, never used. A size budget evicts the
least recently used entries.
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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from salabatch.engine.cache import ModelCache
from salabatch.engine.config import ModelConfig
from salabatch.engine.fingerprint import file_sha256
from salabatch.errors import CacheFormatError
from salabatch.files import write_atomic, write_text_atomic


class PrefixStoreWarning(UserWarning):
    """A stored cache was unusable (corrupt, truncated, mismatched) and was removed."""


@dataclass(frozen=True)
class PrefixKey:
    """What a stored cache must match to be reused."""

    model: str  # display name (path or builtin id); not part of the identity
    model_fingerprint: str
    tokenizer_fingerprint: str
    dtype: str
    ids_sha256: str
    tokens: int

    @classmethod
    def of(cls, model: str, model_fp: str, tokenizer_fp: str, dtype: str, ids: Sequence[int]):
        data = b"".join(int(i).to_bytes(4, "little") for i in ids)
        return cls(model, model_fp, tokenizer_fp, dtype, hashlib.sha256(data).hexdigest(), len(ids))

    @property
    def digest(self) -> str:
        parts = (self.model_fingerprint, self.tokenizer_fingerprint, self.dtype, self.ids_sha256)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def identity(self) -> dict[str, str]:
        """The fields a manifest and a file header must repeat exactly."""
        return {k: str(v) for k, v in asdict(self).items() if k != "model"}


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


class PrefixStore:
    def __init__(self, root: str | Path, max_gb: float = 50.0) -> None:
        self.root = Path(root).expanduser()
        self.max_bytes = int(max_gb * 2**30)

    # -- complete prefixes -----------------------------------------------------------------
    def load(self, key: PrefixKey, cfg: ModelConfig) -> ModelCache | None:
        """The stored cache of this exact prefix, or None (also when it failed a check)."""
        with self._lock(shared=True):
            return self._read(self._entry_stem(key), key, cfg, key.tokens)

    def has(self, key: PrefixKey) -> bool:
        """Whether a complete cache of this prefix is stored (not verified: see `load`)."""
        return self._entry_stem(key).with_suffix(".json").exists()

    def save(self, key: PrefixKey, cache: ModelCache) -> None:
        """Stores a complete prefix cache, then evicts least recently used entries over budget."""
        with self._lock():
            self._write(self._entry_stem(key), key, cache, "prefix")
            self._evict(keep=self._entry_stem(key))

    # -- snapshots of a prefill in progress ---------------------------------------------------
    def load_snapshot(self, key: PrefixKey, cfg: ModelConfig) -> ModelCache | None:
        """The furthest usable snapshot of this prefix's prefill, or None."""
        folder = self.root / "snapshots" / key.digest
        with self._lock(shared=True):
            stems = sorted(folder.glob("*.json"), key=lambda p: -_position(p))
            for manifest in stems:
                cache = self._read(manifest.with_suffix(""), key, cfg, _position(manifest))
                if cache is not None:
                    return cache
        return None

    def save_snapshot(self, key: PrefixKey, cache: ModelCache) -> None:
        """Stores a partial prefill and drops the older snapshots of the same prefix."""
        folder = self.root / "snapshots" / key.digest
        with self._lock():
            self._write(folder / str(cache.offset), key, cache, "snapshot")
            for manifest in folder.glob("*.json"):
                if _position(manifest) < cache.offset:
                    self._remove(manifest.with_suffix(""))

    def drop_snapshots(self, key: PrefixKey) -> None:
        with self._lock():
            shutil.rmtree(self.root / "snapshots" / key.digest, ignore_errors=True)

    # -- housekeeping ----------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every stored cache, most recently used first."""
        out = []
        for manifest in self.root.glob("prefixes/*.json"):
            out += self._entry(manifest, "prefix")
        for manifest in self.root.glob("snapshots/*/*.json"):
            out += self._entry(manifest, "snapshot")
        return sorted(out, key=lambda e: -e.last_used)

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None) -> list[Entry]:
        """Removes entries unused for `older_than_s`, then the least recently used over
        `max_bytes` (default: the store's budget). Returns what was removed."""
        with self._lock():
            removed = []
            now = time.time()
            for e in self.entries():
                if older_than_s is not None and now - e.last_used > older_than_s:
                    self._remove(e.path)
                    removed.append(e)
            return removed + self._evict(max_bytes=max_bytes)

    def clear(self) -> int:
        """Removes every entry; returns the bytes freed."""
        with self._lock():
            freed = sum(e.bytes for e in self.entries())
            shutil.rmtree(self.root / "prefixes", ignore_errors=True)
            shutil.rmtree(self.root / "snapshots", ignore_errors=True)
            return freed

    # -- internals ---------------------------------------------------------------------------
    def _entry_stem(self, key: PrefixKey) -> Path:
        """A complete prefix's entry, without its suffix (.json manifest, .safetensors data)."""
        return self.root / "prefixes" / key.digest

    @contextlib.contextmanager
    def _lock(self, shared: bool = False) -> Iterator[None]:
        """flock on the store: many readers, one writer, across processes."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _write(self, stem: Path, key: PrefixKey, cache: ModelCache, kind: str) -> None:
        arrays, meta = cache.to_state()
        stem.parent.mkdir(parents=True, exist_ok=True)
        data = stem.with_suffix(".safetensors")
        write_atomic(
            data, lambda tmp: mx.save_safetensors(str(tmp), arrays, {**meta, **key.identity()})
        )
        manifest = {
            **key.identity(),
            "model": key.model,
            "kind": kind,
            "position": cache.offset,
            "bytes": data.stat().st_size,
            "sha256": file_sha256(data),
            "created": time.time(),
        }
        # the commit point: a data file without its manifest is never read
        write_text_atomic(stem.with_suffix(".json"), json.dumps(manifest, indent=1))

    def _read(self, stem: Path, key: PrefixKey, cfg: ModelConfig, position: int):
        manifest_path, data_path = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
        if not manifest_path.exists():
            return None
        problem = None
        try:
            manifest = json.loads(manifest_path.read_text())
            if any(manifest.get(k) != v for k, v in key.identity().items()):
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
                else:
                    cache = ModelCache.from_state(arrays, header, cfg, str(data_path))
                    os.utime(manifest_path)  # last use, for LRU eviction
                    return cache
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, CacheFormatError) as e:
            problem = f"unreadable ({e})"
        warnings.warn(
            f"prefix cache {data_path} is unusable, {problem}; it is removed and rebuilt",
            PrefixStoreWarning,
            stacklevel=3,
        )
        self._remove(stem)  # under the shared lock too: unlinking is atomic
        return None

    def _remove(self, stem: Path) -> None:
        for suffix in (".json", ".safetensors"):
            stem.with_suffix(suffix).unlink(missing_ok=True)

    def _evict(self, keep: Path | None = None, max_bytes: int | None = None) -> list[Entry]:
        budget = self.max_bytes if max_bytes is None else max_bytes
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        removed = []
        for e in reversed(entries):  # least recently used first
            if total <= budget:
                break
            if keep is not None and e.path == keep:
                continue
            self._remove(e.path)
            total -= e.bytes
            removed.append(e)
        return removed

    def _entry(self, manifest: Path, kind: str) -> list[Entry]:
        try:
            m = json.loads(manifest.read_text())
            data = manifest.with_suffix(".safetensors")
            return [
                Entry(
                    digest=manifest.parent.name if kind == "snapshot" else manifest.stem,
                    kind=kind,
                    path=manifest.with_suffix(""),
                    bytes=data.stat().st_size if data.exists() else 0,
                    tokens=int(m["position"]),
                    total_tokens=int(m["tokens"]),
                    model=m.get("model", "?"),
                    dtype=m.get("dtype", "?"),
                    created=float(m.get("created", 0)),
                    last_used=manifest.stat().st_mtime,
                )
            ]
        except (OSError, ValueError, KeyError):
            return []  # a half-written or foreign file: not an entry


def _position(manifest: Path) -> int:
    try:
        return int(manifest.stem)
    except ValueError:
        return -1
