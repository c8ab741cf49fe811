"""The Responses API's stored responses: `responses.sqlite` in the server's state dir (or in
memory), so that a restarted server still returns them and continues their conversations.

A stored response is its response object and its conversation (what it was asked and its
answer, as `previous_response_id` continues it), as JSON, and how many of the conversation's
messages before the answer were its own input (the others: the conversation it continued). The
store keeps at most `limit` bytes of them: the least recently used (stored, returned or
continued) go first, the one just stored never. One connection, used under a lock: handlers
call it from worker threads.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from typing import NamedTuple

from salabatch.errors import StateError, not_utf8

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, used INTEGER NOT NULL, bytes INTEGER NOT NULL,
    response TEXT NOT NULL, conversation TEXT NOT NULL, inputs INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used);
"""
LIMIT = 1 << 30  # bytes of stored responses, at most


class Stored(NamedTuple):
    response: dict
    conversation: list[dict]  # what it continued, its input, its answer
    inputs: int  # its own input's messages, before the answer

    @property
    def input_messages(self) -> list[dict]:
        return self.conversation[-1 - self.inputs : -1]


class ResponseStore:
    """Responses by id in `path` (an SQLite file, made if missing; None: in memory), within
    `limit` bytes of their JSON."""

    def __init__(self, path: str | os.PathLike | None = None, limit: int = LIMIT) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            ":memory:" if path is None else os.fspath(path),
            check_same_thread=False,
            isolation_level=None,
        )
        try:
            # WAL: a commit survives the process killed after it (not the machine losing
            # power, which is not worth an fsync a response)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            used, size = self._db.execute("SELECT MAX(used), SUM(bytes) FROM responses").fetchone()
        except sqlite3.DatabaseError as e:
            self._db.close()
            if isinstance(e, sqlite3.OperationalError):
                raise
            raise StateError(
                f"cannot open the stored responses ({e}); move the file away to start with none",
                path=path,
            ) from None
        self._clock, self.bytes = used or 0, size or 0

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def put(self, response: dict, conversation: list[dict], inputs: int) -> None:
        """Stores `response` (by its id; in place of one stored with that id), its conversation
        and how many messages before its answer were its input, then drops the least recently
        used others while the store holds more than its limit."""
        texts = (
            json.dumps(response, ensure_ascii=False),
            json.dumps(conversation, ensure_ascii=False),
        )
        size = sum(len(t.encode()) for t in texts)
        with self._lock:
            with self._db:  # one transaction: committed whole, or rolled back
                self._db.execute("BEGIN")
                old = self._db.execute(
                    "DELETE FROM responses WHERE id = ? RETURNING bytes", (response["id"],)
                ).fetchone()
                self._db.execute(
                    "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                    (response["id"], self._clock + 1, size, *texts, inputs),
                )
                held = self.bytes + size - (old[0] if old else 0)
                while held > self.limit:
                    oldest = self._db.execute(
                        "SELECT id, bytes FROM responses WHERE id != ? ORDER BY used LIMIT 1",
                        (response["id"],),
                    ).fetchone()
                    if oldest is None:
                        break
                    self._db.execute("DELETE FROM responses WHERE id = ?", (oldest[0],))
                    held -= oldest[1]
            self._clock += 1
            self.bytes = held

    def get(self, response_id: str) -> Stored | None:
        """The stored response (now the most recently used), or None."""
        if not_utf8(response_id, from_bytes=False):  # no id stored is one (JSON's "\ud800")
            return None
        with self._lock:
            row = self._db.execute(
                "SELECT response, conversation, inputs FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
            if row is None:
                return None
            self._clock += 1
            self._db.execute(
                "UPDATE responses SET used = ? WHERE id = ?", (self._clock, response_id)
            )
        return Stored(json.loads(row[0]), json.loads(row[1]), row[2])

    def unfinished(self) -> list[Stored]:
        """The responses stored as queued or in progress (a background response's status until
        it ends)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT response, conversation, inputs FROM responses "
                "WHERE json_extract(response, '$.status') IN ('queued', 'in_progress')"
            ).fetchall()
        return [Stored(json.loads(r), json.loads(c), n) for r, c, n in rows]

    def delete(self, response_id: str) -> bool:
        """Forgets a response; False where none had that id."""
        if not_utf8(response_id, from_bytes=False):
            return False
        with self._lock:
            row = self._db.execute(
                "DELETE FROM responses WHERE id = ? RETURNING bytes", (response_id,)
            ).fetchone()
            if row is not None:
                self.bytes -= row[0]
        return row is not None
