"""Where salabatch keeps its files, and how it writes them so a crash never leaves half a file.

`cache_dir()` is the one default store (the prefix store, prefill snapshots, builtin models,
fingerprint memos, the patched BLAS): `$XDG_CACHE_HOME/salabatch`, else `~/.cache/salabatch`.

`write_atomic(dst, write)` has `write` fill a temporary file beside `dst` (or in `tmp_dir`, on
the same file system), fsyncs it, renames it over `dst` and fsyncs the folder: a reader sees the
old file or the new one, never a part. Temporary files are named `.<stem>.tmp-<pid>-<hex><suffix>`
(`is_temp` recognises them) and are deleted when the write fails. A temporary whose writer was
killed stays until the next write of the same file: `temp_pid` names its writer and `pid_alive`
says whether it may still finish it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from salabatch.errors import not_utf8

TEMP_MARK = ".tmp-"
_TEMP_NAME = re.compile(r"\.(.*)\.tmp-([0-9]+)-[0-9a-f]{8}(.*)", re.S)


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


def temp_pid(path: Path) -> int | None:
    """The process that made `temp_path` name `path`, or None for any other name."""
    match = _TEMP_NAME.fullmatch(path.name)
    return int(match[2]) if match else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (in this PID namespace). A temporary of a
    dead writer is stale; a live one's may be a write in progress."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user's process
    except OverflowError:
        return False
    return True


def disk_bytes(path: Path) -> int:
    """The bytes of a file, or of the files in a folder (0 for what cannot be read)."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
        return sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir())
    except OSError:
        return 0


def remove_path(path: Path) -> bool:
    """Removes a file or a folder; whether it is gone now (False where it cannot be removed)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        return not os.path.lexists(path)
    return True


def write_atomic(dst: Path, write: Callable[[Path], None], *, tmp_dir: Path | None = None) -> None:
    """`write(tmp)` fills a temporary file; then it becomes `dst`, durably (see the module).
    Temporaries of `dst` whose writer was killed go first: rewriting a file cleans up after
    the write of it that died."""
    tmp = temp_path(dst, tmp_dir)
    _drop_dead_temps(dst, tmp.parent)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(dst.parent)


def _drop_dead_temps(dst: Path, folder: Path) -> None:
    pattern = f".{glob.escape(dst.stem)}{TEMP_MARK}*{glob.escape(dst.suffix)}"
    for path in folder.glob(pattern):
        match = _TEMP_NAME.fullmatch(path.name)
        ours = match and (match[1], match[3]) == (dst.stem, dst.suffix)
        if ours and not pid_alive(int(match[2])):
            with contextlib.suppress(OSError):
                path.unlink()


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


def lock_now(fd: int) -> bool:
    """An exclusive flock on the open file `fd`, without waiting: True when taken (or where
    there is no flock, Windows: one writer is then up to the user), False while another
    process holds it. The kernel drops it when the file closes or the process dies."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


# Characters Python's str.splitlines() (and JavaScript's older JSON parsers) take for line ends
# inside a JSON string, which JSON itself leaves unescaped.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def json_line(value: object) -> str:
    """`value` as one line of a JSON Lines file, without its newline: text as itself (not
    \\u escapes), except what would split the line for a reader that splits on every line
    break Unicode has (U+2028, U+2029, U+0085) and a lone surrogate UTF-8 cannot hold."""
    text = json.dumps(value, ensure_ascii=False)
    if not_utf8(text, from_bytes=False):  # a lone surrogate (JSON allows "\ud800"): escaped
        return json.dumps(value)
    return text.translate(_LINE_BREAKS)


def same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file (through links too); paths compared where either
    cannot be looked at (not there yet)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)
