"""The Responses API's stored responses: `responses.sqlite` in the server's state dir (or in
memory), so that a restarted server still returns them and continues their conversations.

A stored response is its response object and its conversation (what it was asked and its
answer, as `previous_response_id` continues it), as JSON, and how many of the conversation's
messages before the answer were its own input (the others: the conversation it continued). The
store keeps at most `limit` bytes of them: the least recently used (stored, returned or
continued) go first, the one just stored never. One connection, used under a lock: handlers
call it from worker threads.

A background response's run is recorded while it runs (`runs`: its request's body and how many
times it was started without a clean stop), so that a server stopped under it runs it again
when it starts; a response stored as ended ends its run.
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
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, body TEXT NOT NULL, starts INTEGER NOT NULL);
"""
LIMIT = 1 << 30  # bytes of stored responses, at most
UNFINISHED = ("queued", "in_progress")  # a background response's statuses until it ends


class Stored(NamedTuple):
    response: dict
    conversation: list[dict]  # what it continued, its input, its answer
    inputs: int  # its own input's messages, before the answer

    @property
    def input_messages(self) -> list[dict]:
        return self.conversation[-1 - self.inputs : -1]

    @property
    def history(self) -> list[dict]:
        """The conversation it continued (as its model read it)."""
        return self.conversation[: len(self.conversation) - 1 - self.inputs]


class Unfinished(NamedTuple):
    """A response stored queued or in progress (`ResponseStore.unfinished`): its request's body
    where its run was recorded (`ResponseStore.started`; None: not), and how many of its runs
    the server stopped under without a clean stop (`ResponseStore.stopped`)."""

    stored: Stored
    body: dict | None
    starts: int


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
        # the runs of responses no longer stored (dropped past the limit while running)
        self._db.execute("DELETE FROM runs WHERE id NOT IN (SELECT id FROM responses)")

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
                if response.get("status") not in UNFINISHED:  # its run ended
                    self._db.execute("DELETE FROM runs WHERE id = ?", (response["id"],))
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

    def started(self, response_id: str, body: dict) -> None:
        """Records a run of a background response begun: its request's `body` (to run it again
        after a restart) and one more start."""
        with self._lock:
            self._db.execute(
                "INSERT INTO runs VALUES (?, ?, 1) "
                "ON CONFLICT (id) DO UPDATE SET body = excluded.body, starts = starts + 1",
                (response_id, json.dumps(body, ensure_ascii=False)),
            )

    def stopped(self, response_id: str) -> None:
        """A run the server stopped cleanly (it runs again at the next start): its start is
        not counted against it."""
        with self._lock:
            self._db.execute("UPDATE runs SET starts = starts - 1 WHERE id = ?", (response_id,))

    def unfinished(self) -> list[Unfinished]:
        """The responses stored as queued or in progress (a background response's status until
        it ends), the oldest first, with their runs."""
        with self._lock:
            rows = self._db.execute(
                "SELECT response, conversation, inputs, body, starts FROM responses "
                "LEFT JOIN runs USING (id) "
                f"WHERE json_extract(response, '$.status') IN {UNFINISHED} "
                "ORDER BY json_extract(response, '$.created_at'), used"
            ).fetchall()
        return [
            Unfinished(
                Stored(json.loads(r), json.loads(c), n),
                None if body is None else json.loads(body),
                starts or 0,
            )
            for r, c, n, body, starts in rows
        ]

    def delete(self, response_id: str) -> bool:
        """Forgets a response; False where none had that id."""
        if not_utf8(response_id, from_bytes=False):
            return False
        with self._lock:
            row = self._db.execute(
                "DELETE FROM responses WHERE id = ? RETURNING bytes", (response_id,)
            ).fetchone()
            self._db.execute("DELETE FROM runs WHERE id = ?", (response_id,))
            if row is not None:
                self.bytes -= row[0]
        return row is not None
