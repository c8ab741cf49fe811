"""Model fingerprint: what a saved cache must match before it may be reused.

sha256 over config.json's bytes and, for every weight file, its name, size and a hash of its
content. Hashing an 18 GB checkpoint takes a while, so each file's content hash is remembered in
`<cache dir>/fingerprints.json`, keyed by its absolute path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from salabatch.engine.checkpoint import weight_files
from salabatch.files import write_text_atomic

CHUNK = 1 << 24


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(path: str | Path, memo: Path | None = None) -> str:
    """sha256 hex of a checkpoint folder's config and weights (see the module docstring)."""
    path = Path(path)
    known = _read_memo(memo)
    h = hashlib.sha256(b"salabatch-model-v1\0")
    h.update((path / "config.json").read_bytes())
    changed = False
    for file in weight_files(path):
        st = file.stat()
        key = f"{file.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if key not in known:
            known[key] = file_sha256(file)
            changed = True
        h.update(f"{file.name}\0{st.st_size}\0{known[key]}\0".encode())
    if changed and memo is not None:
        _write_memo(memo, known)
    return h.hexdigest()


def _read_memo(memo: Path | None) -> dict[str, str]:
    if memo is None or not memo.is_file():
        return {}
    try:
        data = json.loads(memo.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a damaged memo only costs re-hashing


def _write_memo(memo: Path, known: dict[str, str]) -> None:
    memo.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(memo, json.dumps(known, indent=1, sort_keys=True))
