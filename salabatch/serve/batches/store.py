"""The Batch API's durable state under the server's state dir: `batches.sqlite` (WAL, a commit
reaches the disk before it returns) holds the file and batch records and every answered line of
a batch; `files/<id>` holds each file's bytes, written to a temporary file, fsynced and renamed
(what a killed server left there half made is removed at the next start).

A batch's answered lines are rows keyed by (batch, line): a line is answered once however often
the server is killed and restarted, and its output file is written from them, in input order.
One connection, used under a lock: the HTTP handlers and the batch runner share it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from salabatch.errors import SalabatchError, StateError
from salabatch.files import fsync_dir, fsync_path, json_line, lock_now, temp_path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, status TEXT NOT NULL, object TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, failed INTEGER NOT NULL,
    output TEXT NOT NULL, PRIMARY KEY (batch_id, line));
"""
OPEN = ("validating", "in_progress", "finalizing", "cancelling")  # statuses a runner still owns


def new_id(kind: str) -> str:
    """OpenAI's id shape: `file-<hex>`, `batch_<hex>`, `batch_req_<hex>`."""
    sep = "-" if kind == "file" else "_"
    return f"{kind}{sep}{uuid.uuid4().hex}"


OPEN_WAIT_S = 30.0  # how long a store waits for another process that holds the database


def _setup(db: sqlite3.Connection) -> None:
    """WAL, synced commits and the schema. Switching to WAL needs the database to itself and
    does not wait on another connection (a second server starting on the same state dir):
    retried until OPEN_WAIT_S has passed."""
    deadline = time.monotonic() + OPEN_WAIT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # a commit is on disk when it returns
            db.executescript(SCHEMA)
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class StateDirBusy(SalabatchError):
    """Another server's batches live in this state dir: a second one would run them too."""

    exit_code = 2


def _own(root: Path) -> BinaryIO:
    """`root/.lock`, flocked exclusively (kept open while the store is), or StateDirBusy."""
    owner = open(root / ".lock", "a+b")  # noqa: SIM115 (held until the store closes)
    if not lock_now(owner.fileno()):
        owner.close()
        raise StateDirBusy(
            "another salabatch serve holds this state dir (its .lock): its batches would run "
            "twice; give this server its own --state-dir",
            path=root,
        )
    return owner


class BatchStore:
    """Files and batches under `root` (made if missing), one server's at a time: it holds an
    exclusive flock on `root/.lock` until closed (the kernel drops it when the process dies);
    StateDirBusy while another holds it."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._owner = _own(self.root)
        self._lock = threading.Lock()
        path = self.root / "batches.sqlite"
        self._db = sqlite3.connect(
            path, check_same_thread=False, isolation_level=None, timeout=OPEN_WAIT_S
        )
        try:
            _setup(self._db)
        except sqlite3.DatabaseError as e:
            self._db.close()
            self._owner.close()
            if isinstance(e, sqlite3.OperationalError):  # locked past OPEN_WAIT_S, a full disk
                raise
            raise StateError(
                f"cannot open the Batch API's database ({e}); move it away to start with no "
                "batches and files",
                path=path,
            ) from None
        self._sweep()

    def _sweep(self) -> None:
        """Removes what a killed server left in `files/`: a write's temporary file, and bytes
        renamed into place whose record was never made. No one else writes there: the store
        holds the state dir."""
        known = {row[0] for row in self._run("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known and path.is_file():
                path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._owner.close()

    def _run(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- files -------------------------------------------------------------------------------

    def add_file(
        self,
        filename: str,
        purpose: str,
        write: Callable[[BinaryIO], int],
        file_id: str | None = None,
    ) -> dict:
        """A new file whose bytes `write(f)` writes (returning how many); durable before its
        record is. `write` may raise (a size limit): then nothing is kept."""
        file_id = file_id or new_id("file")
        path = self.files_dir / file_id
        tmp = temp_path(path)
        try:
            with open(tmp, "wb") as f:
                size = write(f)
            fsync_path(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.files_dir)
        self._run(
            "INSERT INTO files VALUES (?, ?, ?, ?, ?)",
            (file_id, filename, purpose, size, int(time.time())),
        )
        return self.file(file_id)

    def file(self, file_id: str) -> dict | None:
        """The FileObject of `file_id`, or None."""
        rows = self._run("SELECT * FROM files WHERE id = ?", (file_id,))
        return _file_object(rows[0]) if rows else None

    def files(self, purpose: str | None = None) -> list[dict]:
        """Every file (of `purpose`), newest first."""
        rows = self._run(
            "SELECT * FROM files WHERE ? IS NULL OR purpose = ?"
            " ORDER BY created_at DESC, rowid DESC",
            (purpose, purpose),
        )
        return [_file_object(r) for r in rows]

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def reading(self, file_id: str) -> dict | None:
        """The batch not ended yet whose input is the file, if any: its runner reads the lines
        again after a restart."""
        found = [b for b in self.open_batches() if b["input_file_id"] == file_id]
        return found[0] if found else None

    def delete_file(self, file_id: str) -> bool:
        """Removes the record, then the bytes; False when there was none."""
        with self._lock:
            gone = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # ---- batches -----------------------------------------------------------------------------

    def add_batch(self, batch: dict) -> None:
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            self._db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?)",
                (batch["id"], seq, batch["status"], json.dumps(batch)),
            )

    def batch(self, batch_id: str) -> dict | None:
        """The Batch object, its request_counts from the lines answered so far."""
        rows = self._run("SELECT object FROM batches WHERE id = ?", (batch_id,))
        return self._with_counts(json.loads(rows[0][0])) if rows else None

    def status(self, batch_id: str) -> str | None:
        """The batch's status alone (its counts are not read: the runner asks for every line)."""
        rows = self._run("SELECT status FROM batches WHERE id = ?", (batch_id,))
        return rows[0][0] if rows else None

    def batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Up to `limit` batches, newest first, from after the batch `after`; and whether more
        follow."""
        rows = self._run(
            "SELECT object FROM batches WHERE seq < COALESCE("
            "(SELECT seq FROM batches WHERE id = ?), 1 << 62) ORDER BY seq DESC LIMIT ?",
            (after, limit + 1),
        )
        return [self._with_counts(json.loads(r[0])) for r in rows[:limit]], len(rows) > limit

    def open_batches(self) -> list[dict]:
        """The batches a runner has not finished, oldest first (to resume after a restart)."""
        marks = ",".join("?" * len(OPEN))
        rows = self._run(f"SELECT object FROM batches WHERE status IN ({marks}) ORDER BY seq", OPEN)
        return [self._with_counts(json.loads(r[0])) for r in rows]

    def update_batch(self, batch_id: str, change: Callable[[dict], dict | None]) -> dict | None:
        """Applies `change` to the stored object (it returns the new one, or None to leave it)
        atomically; returns the object as it is after."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(
                    "SELECT object FROM batches WHERE id = ?", (batch_id,)
                ).fetchall()
                batch = json.loads(rows[0][0]) if rows else None
                new = change(batch) if batch is not None else None
                if new is not None:
                    self._db.execute(
                        "UPDATE batches SET status = ?, object = ? WHERE id = ?",
                        (new["status"], json.dumps(new), batch_id),
                    )
                    batch = new
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return None if batch is None else self._with_counts(batch)

    # ---- a batch's lines ---------------------------------------------------------------------

    def add_line(self, batch_id: str, line: int, output: dict, failed: bool) -> None:
        """Records line `line`'s output line, durably; a line answered already keeps its
        first answer."""
        text = json_line(output)  # a line of the output file as it is stored
        self._run(
            "INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?)", (batch_id, line, int(failed), text)
        )

    def done_lines(self, batch_id: str) -> set[int]:
        return {r[0] for r in self._run("SELECT line FROM lines WHERE batch_id = ?", (batch_id,))}

    def outputs(self, batch_id: str, failed: bool) -> list[str]:
        """The recorded output lines (JSON text) of the batch's answered (or failed) lines, in
        input order."""
        rows = self._run(
            "SELECT output FROM lines WHERE batch_id = ? AND failed = ? ORDER BY line",
            (batch_id, int(failed)),
        )
        return [r[0] for r in rows]

    def _with_counts(self, batch: dict) -> dict:
        ((completed, failed),) = self._run(
            "SELECT COALESCE(SUM(1 - failed), 0), COALESCE(SUM(failed), 0) FROM lines"
            " WHERE batch_id = ?",
            (batch["id"],),
        )
        total = batch.get("request_counts", {}).get("total", 0)
        counts = {"total": total, "completed": completed, "failed": failed}
        return {**batch, "request_counts": counts}


def _file_object(row: tuple) -> dict:
    file_id, filename, purpose, size, created_at = row
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }
