"""The durable writer of a results file: a finished row is never lost, never written twice.

Durability: `write()` returns only once its part file is fsync'd, renamed into place and the
folder fsync'd. A rename is atomic, so a part is either complete or absent, and a finished row
survives SIGKILL (and power loss). `close()` merges x.parquet and the parts into a temp file,
fsyncs it, renames it over x.parquet, and only then deletes the parts; a merge interrupted at any
point loses nothing, and the next writer's close redoes it with the same result.

Resume (the default): rows whose request_key is already there count as done (error rows too,
unless retry_errors), and the runner skips them. `--retry-errors --limit N` runs redo the error
rows N at a time: the merged file names the runs of such a series (META_RETRIED_BY), whose own
error rows the next one does not redo again, so the same command goes on with the next N; the
series ends with a retry run that sees the whole job (and a retry run without a limit redoes
every error row). Once the runner has planned the whole job, it names the job's keys (`retain`)
and the merge drops rows of earlier runs that are no longer in the job (a removed document or
question, a changed document or model). `--no-resume` deletes
leftover parts, marks the run FRESH and leaves x.parquet untouched on disk until this run closes
and replaces it; from the start, readers see only the new run's rows, and a killed --no-resume
run resumes as itself. A run that closes without a new row (it failed before its first
document, or every row was done) writes nothing beyond dropping rows no longer in the job: the
old results stay, and no empty file is created.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from salabatch.errors import OutputError, error_text
from salabatch.files import fsync, fsync_dir, is_temp, lock_now, write_atomic
from salabatch.jobs.results.read import (
    FRESH,
    check_final,
    dedupe,
    list_parts,
    parts_dir_of,
    read_final,
    read_part,
    warn_bad_part,
)
from salabatch.jobs.results.schema import RESULT_SCHEMA, ResultRow, decode_metadata, encode_metadata
from salabatch.plural import counted


class ResultWriter:
    """Writes finished rows durably; merges them into `path` on close (see the module docstring).

        with ResultWriter(path, job_spec_json=spec_json, versions=current_versions()) as out:
            todo = [r for r in requests if r.key not in out.done_keys()]
            ...
            out.write(rows_of_one_document)    # durable when it returns

    resume: keep the rows already in `path` (and in the parts of a killed run) and report their
        keys in `done_keys()`; False starts fresh (the old rows are replaced when this closes).
    retry_errors: error rows do not count as done, so they are recomputed.
    limited: a run cut by --limit: with retry_errors, the error rows of the earlier retry runs
        the file names (see the module docstring) still count as done.
    Closing (normally, on an exception or on KeyboardInterrupt) merges the rows into `path`.
    Raises OutputError if `path` holds something that is not a salabatch results file, or
    another writer has it open.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        job_spec_json: str,
        versions: Mapping[str, str | None],
        resume: bool = True,
        retry_errors: bool = False,
        limited: bool = False,
    ) -> None:
        json.loads(job_spec_json)  # ValueError for a caller bug; the spec is stored verbatim
        # the file a link names: its lock is every path's to it, and the merge replaces the
        # file, not the link
        self.path = Path(os.path.realpath(path))
        self.parts_dir = parts_dir_of(self.path)
        self.resume = resume
        self.retry_errors = retry_errors
        self.limited = limited
        self._job_spec_json = job_spec_json
        self._versions_json = json.dumps(dict(versions), sort_keys=True)
        self._done: dict[str, bool] = {}  # request_key -> an ok row exists
        self._failed_by: dict[str, str] = {}  # request_key -> run_id of its latest error row
        self._retried_by: frozenset[str] = frozenset()  # the file's META_RETRIED_BY
        self._written: set[str] = set()
        self._run_ids: set[str] = set()  # of the rows written
        self._retain: set[str] | None = None
        self._bad_parts: set[Path] = set()
        self._closed = False
        if self.path.is_dir():
            raise OutputError("is a folder, expected a .parquet results file", path=self.path)
        if self.path.exists():  # before anything is written: whose file is it?
            try:
                check_final(self.path)
            except OutputError as e:
                raise OutputError(
                    f"{e.message}; refusing to overwrite it, choose another output path or move "
                    "the file away",
                    path=self.path,
                    expected=e.expected,
                    got=e.got,
                ) from None
        self._lock_fd = _lock(self.parts_dir / "LOCK", self.path)
        try:
            self._open()
        except BaseException:
            self._unlock()
            raise

    def _open(self) -> None:
        for tmp in self.parts_dir.iterdir():
            if is_temp(tmp):
                tmp.unlink(missing_ok=True)  # a write or merge a killed writer left unfinished
        created = None
        if not self.resume:
            for _, part in list_parts(self.parts_dir):
                part.unlink()
            _touch_durably(self.parts_dir / FRESH)
        else:
            fresh = (self.parts_dir / FRESH).exists()
            if self.path.exists() and not fresh:
                final, meta = read_final(self.path, columns=["request_key", "status", "run_id"])
                created = decode_metadata(meta)["created_at"]
                self._retried_by = decode_metadata(meta)["retried_by"]
                self._note_done(final)
            for _, part in list_parts(self.parts_dir):
                table, meta = self._read_part(part)
                if table is not None:
                    created = created or decode_metadata(meta)["created_at"]
                    self._note_done(table)
        parts = list_parts(self.parts_dir)
        self._seq = parts[-1][0] + 1 if parts else 1
        self._created_at = created or _now_iso()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def done_keys(self) -> frozenset[str]:
        """request_keys finished in earlier runs or by this writer (error rows count unless
        retry_errors; those of the series a limited retry run goes on with count still)."""
        return frozenset(
            key
            for key, ok in self._done.items()
            if counts_done(
                ok, self._failed_by.get(key), self.retry_errors, self.limited, self._retried_by
            )
        )

    def written_keys(self) -> frozenset[str]:
        """request_keys of the rows this writer wrote."""
        return frozenset(self._written)

    def failed_keys(self) -> frozenset[str]:
        """request_keys that have only error rows, from earlier runs or this writer."""
        return frozenset(k for k, ok in self._done.items() if not ok)

    def retain(self, keys: Iterable[str]) -> int:
        """Declare the request_keys of the whole job (not just this run's --limit share): at
        close, rows of earlier runs with other keys (an edited question, a changed document or
        model) are dropped. Rows written by this writer are always kept. Without a call, all
        rows are kept. Returns how many rows the close drops (`stale_rows` says so)."""
        self._retain = set(keys)
        return len(self._done.keys() - self._retain - self._written)

    def write(self, rows: Iterable[ResultRow | Mapping[str, Any]]) -> None:
        """Persist finished rows (a dict is passed to ResultRow); durable when this returns."""
        if self._closed:
            raise ValueError(f"ResultWriter({self.path}) is closed")
        records = [(r if isinstance(r, ResultRow) else ResultRow(**r)).to_record() for r in rows]
        if not records:
            return
        table = pa.Table.from_pylist(records, schema=RESULT_SCHEMA)
        table = table.replace_schema_metadata(self._metadata(updated=False))
        name = f"part-{self._seq:06d}-{uuid.uuid4().hex}.parquet"
        try:
            _write_durably(table, self.parts_dir / name, tmp_dir=self.parts_dir)
        except OSError as e:
            raise OutputError(
                f"cannot write finished rows ({error_text(e)})", path=self.parts_dir
            ) from e
        self._seq += 1
        self._note_done(table)
        self._written.update(r["request_key"] for r in records)
        self._run_ids.update(r["run_id"] for r in records)

    def close(self) -> None:
        """Merge everything into `path` (atomically), then remove the parts. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._merge()
        finally:
            self._unlock()

    def _merge(self) -> None:
        fresh_marker = self.parts_dir / FRESH
        fresh = fresh_marker.exists()
        parts = [part for _, part in list_parts(self.parts_dir)]
        same_series = self._series() == self._retried_by
        if not parts and (fresh or self._retain is None) and same_series:
            # No new row: keep the results as they are (a --no-resume run that failed before
            # its first row must not wipe the old results).
            fresh_marker.unlink(missing_ok=True)
            return
        tables = []
        if self.path.exists() and not fresh:
            tables.append(read_final(self.path)[0])
        for part in parts:
            table, _ = self._read_part(part)
            if table is not None:
                tables.append(table)
        merged = dedupe(tables)
        if self._retain is not None:
            keep = pa.array(sorted(self._retain | self._written), pa.string())
            retained = merged.filter(pc.is_in(merged["request_key"], value_set=keep))
            if not parts and retained.num_rows == merged.num_rows and same_series:
                return  # no new row and none to drop: the results stay as they are
            merged = retained
        merged = merged.replace_schema_metadata(self._metadata(updated=True))
        try:
            _write_durably(merged, self.path, tmp_dir=self.parts_dir)
            # The final file holds every row now. FRESH goes first: with it gone and parts
            # left, a rerun merges final + parts, which gives the same rows again.
            fresh_marker.unlink(missing_ok=True)
            fsync_dir(self.parts_dir)
            for part in parts:
                part.unlink()
        except OSError as e:
            raise OutputError(f"cannot write the results ({error_text(e)})", path=self.path) from e

    def _read_part(self, part: Path) -> tuple[pa.Table | None, Mapping[bytes, bytes] | None]:
        table, meta, problem = read_part(part)
        if problem and part not in self._bad_parts:
            self._bad_parts.add(part)
            warn_bad_part(part, problem)
        return table, meta

    def _note_done(self, table: pa.Table) -> None:
        keys = table.column("request_key").to_pylist()
        statuses = table.column("status").to_pylist()
        run_ids = table.column("run_id").to_pylist()
        for key, status, run_id in zip(keys, statuses, run_ids, strict=True):
            self._done[key] = self._done.get(key, False) or status == "ok"
            if status != "ok":
                self._failed_by[key] = run_id

    def _series(self) -> frozenset[str]:
        """The retry runs the merged file names: this one added while a retry series goes on
        (a limited retry run that did not see the whole job: cut, or stopped), none once a
        retry run ends it, the file's own otherwise."""
        if not self.retry_errors:
            return self._retried_by
        if self.limited and self._retain is None:
            return self._retried_by | self._run_ids
        return frozenset()

    def _metadata(self, *, updated: bool) -> dict[bytes, bytes]:
        return encode_metadata(
            job_spec_json=self._job_spec_json,
            versions_json=self._versions_json,
            created_at=self._created_at,
            updated_at=_now_iso() if updated else None,
            retried_by=self._series() if updated else (),
        )

    def _unlock(self) -> None:
        lock = self.parts_dir / "LOCK"
        try:
            idle = all(p.name == "LOCK" for p in self.parts_dir.iterdir())
        except OSError:
            idle = False
        if idle:
            # Nothing left to merge. We still hold the lock, so no writer can start in between.
            lock.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.parts_dir.rmdir()
        os.close(self._lock_fd)


# ---- durable files, one writer -------------------------------------------------------------------


def counts_done(
    ok: bool, failed_by: str | None, retry_errors: bool, limited: bool, retried_by: frozenset[str]
) -> bool:
    """Whether a run skips a row of the results (`ResultWriter.done_keys`, and `--dry-run`
    as it): an ok row; an error row unless `retry_errors`, or when a `limited` retry run goes
    on with the series `retried_by` (the run ids the file names) whose run `failed_by` wrote
    it."""
    return ok or not retry_errors or (limited and failed_by in retried_by)


def stale_rows(n: int) -> str:
    """What a run says, before it drops them, of `n` rows of earlier runs that are no longer
    in the job (and `--dry-run` of the rows the run would drop)."""
    are, them = ("is", "it") if n == 1 else ("are", "them")
    return (
        f"{counted(n, 'row')} of earlier runs {are} no longer in the job (a document, question, "
        f"request or setting changed or was removed); the run drops {them} from the results"
    )


def _write_durably(table: pa.Table, dst: Path, *, tmp_dir: Path) -> None:
    """`table` as `dst`, atomically and durably; its temporary file lives in `tmp_dir` (on
    `dst`'s file system: a sibling folder is), where a killed write's leftovers are swept."""
    write_atomic(
        dst,
        lambda tmp: pq.write_table(table, tmp, compression="zstd", write_page_checksum=True),
        tmp_dir=tmp_dir,
    )


def _touch_durably(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


_LOCK_TRIES = 100  # another writer ending idle removes the parts folder: rare, and quick


def _lock(lock_path: Path, results: Path) -> int:
    """An exclusive flock on `lock_path` in the parts folder (made if missing); the kernel drops
    it when the process dies. A writer that ends idle removes the lock file and the folder while
    it holds the lock (`_unlock`): a lock taken on the file it removed guards nothing, so it is
    taken again on the file there now, the folder made again."""
    folder = lock_path.parent
    for _ in range(_LOCK_TRIES):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except (FileExistsError, FileNotFoundError) as e:
            if os.path.lexists(folder) and not os.path.isdir(folder):
                raise OutputError(
                    f"cannot create the parts folder ({error_text(e)})", path=folder
                ) from e
            continue  # the folder removed while it was made or opened, by a writer ending
        except OSError as e:
            raise OutputError(
                f"cannot create the parts folder ({error_text(e)})", path=folder
            ) from e
        if not lock_now(fd):
            os.close(fd)
            raise OutputError(
                "another salabatch run is writing this results file (it holds "
                f"{lock_path.name} in {folder.name}/)",
                path=results,
            )
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock_path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # removed (or replaced) before we had it: try the one there now
    raise OutputError("the parts folder kept being removed and made again; try again", path=folder)


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
