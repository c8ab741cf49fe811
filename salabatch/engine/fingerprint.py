"""Model fingerprint: what a saved cache must match before it may be reused.

sha256 over config.json's bytes and, for every weight file, its name, size and the sha256 of
its content: the same files give the same fingerprint wherever they lie (a folder, the Hugging
Face cache). Hashing an 18 GB checkpoint takes a while, so:

* a weight file in the Hugging Face cache is not read: there, `snapshots/<commit>/<file>` links
  to `blobs/<sha256 of the content>` for every LFS file (safetensors are), and huggingface_hub
  itself takes a 64-hex blob name for the content's sha256. Only that exact layout counts; a
  non-LFS blob is named by git's 40-hex sha1, and anything else is hashed;
* other files' hashes are remembered in `<cache dir>/fingerprints.json`, keyed by absolute path,
  size and modification time. A memo that cannot be read costs re-hashing; one that cannot be
  written (read-only, full) warns once (CacheWarning) and the fingerprint is returned anyway.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path

from salabatch.engine.checkpoint import weight_files
from salabatch.errors import CacheWarning, error_text
from salabatch.files import write_text_atomic

CHUNK = 1 << 24
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def hub_sha256(file: Path) -> str | None:
    """The content sha256 that the Hugging Face cache names `file` by, or None: `file` must be
    a link `<repo>/snapshots/<commit>/<name>` to `<repo>/blobs/<64 hex>` of the same repo."""
    if not file.is_symlink():
        return None
    snapshot = file.absolute().parent
    blob = file.resolve()
    repo = blob.parent.parent
    if (
        blob.parent.name != "blobs"
        or snapshot.parent.name != "snapshots"
        or snapshot.parent.parent.resolve() != repo
        or not _SHA256_HEX.fullmatch(blob.name)
    ):
        return None
    return blob.name


def model_fingerprint(path: str | Path, memo: Path | None = None) -> str:
    """sha256 hex of a checkpoint folder's config and weights (see the module docstring)."""
    path = Path(path)
    known = _read_memo(memo)
    h = hashlib.sha256(b"salabatch-model-v1\0")
    h.update((path / "config.json").read_bytes())
    changed = False
    for file in weight_files(path):
        st = file.stat()
        digest = hub_sha256(file)
        if digest is None:
            key = f"{file.resolve()}:{st.st_size}:{st.st_mtime_ns}"
            if key not in known:
                known[key] = file_sha256(file)
                changed = True
            digest = known[key]
        h.update(f"{file.name}\0{st.st_size}\0{digest}\0".encode())
    if changed and memo is not None:
        _write_memo(memo, known)
    return h.hexdigest()


def _read_memo(memo: Path | None) -> dict[str, str]:
    if memo is None:
        return {}
    try:
        data = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}  # absent, unreadable or damaged: it only costs re-hashing
    return data if isinstance(data, dict) else {}


def _write_memo(memo: Path, known: dict[str, str]) -> None:
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(memo, json.dumps(known, indent=1, sort_keys=True))
    except OSError as e:
        warnings.warn(
            f"{memo}: cannot save the weights' hashes ({error_text(e)}); "
            "the next run hashes the weights again",
            CacheWarning,
            stacklevel=3,
        )
