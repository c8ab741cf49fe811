"""Where salabatch keeps its files, and how it writes them so a crash never leaves half a file.

`cache_dir()` is the one default store (the prefix store, prefill snapshots, builtin models,
fingerprint memos, the patched BLAS): `$XDG_CACHE_HOME/salabatch`, else `~/.cache/salabatch`.

`write_atomic(dst, write)` has `write` fill a temporary file beside `dst` (or in `tmp_dir`, on
the same file system), fsyncs it, renames it over `dst` and fsyncs the folder: a reader sees the
old file or the new one, never a part. Temporary files are named `.<stem>.tmp-<pid>-<hex><suffix>`
(`is_temp` recognises them) and are deleted when the write fails.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

TEMP_MARK = ".tmp-"


def cache_dir() -> Path:
    """The default store folder: $XDG_CACHE_HOME/salabatch, else ~/.cache/salabatch."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "salabatch"


def temp_path(dst: Path, tmp_dir: Path | None = None) -> Path:
    """A fresh temporary name for `dst`, keeping its suffix (some writers insist on it)."""
    name = f".{dst.stem}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}{dst.suffix}"
    return (dst.parent if tmp_dir is None else tmp_dir) / name


def is_temp(path: Path) -> bool:
    """Whether `path` is one of `temp_path`'s names (a write in progress, or one that died)."""
    return path.name.startswith(".") and TEMP_MARK in path.name


def write_atomic(dst: Path, write: Callable[[Path], None], *, tmp_dir: Path | None = None) -> None:
    """`write(tmp)` fills a temporary file; then it becomes `dst`, durably (see the module)."""
    tmp = temp_path(dst, tmp_dir)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(dst.parent)


def write_text_atomic(dst: Path, text: str) -> None:
    write_atomic(dst, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def fsync_path(path: Path) -> None:
    """Flush a file's data to the medium."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def fsync(fd: int) -> None:
    # On macOS fsync only reaches the drive's cache; F_FULLFSYNC reaches the medium.
    if sys.platform == "darwin":
        import fcntl

        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
    os.fsync(fd)


def fsync_dir(folder: Path) -> None:
    """Make renames and deletions in `folder` durable; some file systems refuse, and there the
    rename is still atomic, only possibly not yet on disk."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
