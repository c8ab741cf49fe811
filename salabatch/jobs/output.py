"""The Parquet sink of a job: one row per document × question, never lost, never twice.

On disk, for `output.path: results/x.parquet`:

    results/x.parquet                the merged results, replaced atomically when a run ends
    results/x.parquet.parts/         exists while a run is going, or after one was killed
        LOCK                         flock'd by the running writer: one writer per results file
        FRESH                        present when this run replaces x.parquet (--no-resume)
        part-000007-<uuid>.parquet   the rows of one `ResultWriter.write()` call, complete
        .tmp-<uuid>.parquet          a part or a merge being written; deleted at the next open

Durability: `write()` returns only once its part file is fsync'd, renamed into place and the
folder fsync'd. A rename is atomic, so a part is either complete or absent, and a finished row
survives SIGKILL (and power loss). `close()` merges x.parquet and the parts into a temp file,
fsyncs it, renames it over x.parquet, and only then deletes the parts; a merge interrupted at any
point loses nothing, and the next writer's close redoes it with the same result.

What a results file holds (`read_results`): the rows of x.parquet (ignored when FRESH is
present) followed by the rows of the readable parts in sequence order, one row per
`request_key`: an ok row beats an error row, otherwise the later row wins; sorted by doc_id,
question_id, custom_id, request_key. `inspect`, `export` and resume all read it this way, so
they agree with each other at every instant, mid-run and after a kill included.

Resume (the default): rows whose request_key is already there count as done (error rows too,
unless retry_errors), and the runner skips them. `--no-resume` deletes leftover parts, marks the
run FRESH and leaves x.parquet untouched on disk until this run closes and replaces it; from the
start, readers see only the new run's rows, and a killed --no-resume run resumes as itself. A
run that closes without having written a row (it failed before its first document) changes
nothing: the old results stay, and no empty file is created.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
import uuid
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from salabatch import __version__
from salabatch.errors import OutputError

SCHEMA_VERSION = 1

STATUSES = ("ok", "error")
FINISH_REASONS = ("stop", "length", "error")
CACHE_SOURCES = ("memory", "disk", "none")

# File metadata keys (bytes, as Parquet stores them).
META_SCHEMA_VERSION = b"salabatch.schema_version"
META_JOB_SPEC = b"salabatch.job_spec"
META_VERSIONS = b"salabatch.versions"
META_CREATED_AT = b"salabatch.created_at"
META_UPDATED_AT = b"salabatch.updated_at"

_S, _I, _F = pa.string(), pa.int64(), pa.float64()
_TS = pa.timestamp("us", tz="UTC")


def _col(name: str, type_: pa.DataType, doc: str, *, nullable: bool = True) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={"description": doc})


RESULT_SCHEMA = pa.schema(
    [
        # identity
        _col("run_id", _S, "id of the `salabatch run` that produced the row", nullable=False),
        _col("job_name", _S, "the job's name", nullable=False),
        _col("doc_id", _S, "the document's stable id within the job", nullable=False),
        _col("doc_path", _S, "the source file (a .jsonl file for a jsonl record)", nullable=False),
        _col("doc_sha256", _S, "sha256 of the document; '' if it was not read", nullable=False),
        _col("question_id", _S, "the question's id in the job", nullable=False),
        _col("question", _S, "the question text as asked", nullable=False),
        _col(
            "custom_id",
            _S,
            "join key for other tools; default <doc_id>/<question_id>",
            nullable=False,
        ),
        _col(
            "request_key",
            _S,
            "deterministic key of the request; resume skips done keys",
            nullable=False,
        ),
        # result
        _col("answer", _S, "the answer (think block removed); null for an error row"),
        _col("reasoning", _S, "the think block when generation.think is true, else null"),
        _col("finish_reason", _S, "stop | length | error", nullable=False),
        _col("status", _S, "ok | error", nullable=False),
        _col("error", _S, "one-line reason of an error row, else null"),
        # model
        _col("model", _S, "the job's model (checkpoint path or builtin:name)", nullable=False),
        _col("model_sha", _S, "digest of the checkpoint weights"),
        _col("quant_bits", _I, "4 or 8 for a quantized checkpoint, null for full precision"),
        # tokens
        _col("doc_tokens", _I, "tokens of the document prefix"),
        _col("prompt_tokens", _I, "tokens of the whole prompt: document prefix + question"),
        _col("cached_tokens", _I, "prompt tokens served from the prefix cache"),
        _col("completion_tokens", _I, "generated tokens, think block included"),
        # timings
        _col("doc_prefill_s", _F, "seconds prefilling the document; 0 when it came from a cache"),
        _col("prefill_tok_s", _F, "prefill throughput, tokens/s"),
        _col("ttft_s", _F, "seconds from the start of the request to its first token"),
        _col("decode_s", _F, "seconds decoding the answer"),
        _col("decode_tok_s", _F, "decode throughput of this sequence, tokens/s"),
        _col("batch_size", _I, "sequences decoded together"),
        _col("cache_source", _S, "where the document prefix came from: memory | disk | none"),
        _col("peak_mem_gb", _F, "peak accelerator/process memory during the request, GB"),
        _col("started_at", _TS, "when the request started (UTC)"),
        _col("finished_at", _TS, "when the row was finished (UTC)", nullable=False),
    ],
    metadata={META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode()},
)

_SORT_KEYS = ("doc_id", "question_id", "custom_id", "request_key")
_REQUIRED_TEXT = ("run_id", "job_name", "doc_id", "doc_path", "question_id", "request_key", "model")


class OutputWarning(UserWarning):
    """Something in a results folder was skipped (a corrupt part file); its rows are redone."""


@dataclass(frozen=True, kw_only=True)
class ResultRow:
    """One document × question, as the runner finished it. Fields are RESULT_SCHEMA's columns,
    in its order (see the column descriptions there). Invalid rows raise ValueError: rows come
    from the runner, never from user input, so a bad one is a bug.
    """

    run_id: str
    job_name: str
    doc_id: str
    doc_path: str
    doc_sha256: str
    question_id: str
    question: str
    custom_id: str | None = None  # None -> "<doc_id>/<question_id>"
    request_key: str
    answer: str | None = None
    reasoning: str | None = None
    finish_reason: str = "stop"
    status: str = "ok"
    error: str | None = None
    model: str
    model_sha: str | None = None
    quant_bits: int | None = None
    doc_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    doc_prefill_s: float | None = None
    prefill_tok_s: float | None = None
    ttft_s: float | None = None
    decode_s: float | None = None
    decode_tok_s: float | None = None
    batch_size: int | None = None
    cache_source: str | None = None
    peak_mem_gb: float | None = None
    started_at: datetime | None = None
    finished_at: datetime

    def __post_init__(self) -> None:
        if self.custom_id is None:
            object.__setattr__(self, "custom_id", f"{self.doc_id}/{self.question_id}")
        problems = [
            f"{name} must be a non-empty string, got {getattr(self, name)!r}"
            for name in _REQUIRED_TEXT + ("custom_id",)
            if not isinstance(getattr(self, name), str) or not getattr(self, name)
        ]
        problems += [
            f"{name} must be a string, got {getattr(self, name)!r}"
            for name in ("doc_sha256", "question")
            if not isinstance(getattr(self, name), str)
        ]
        for name, allowed, value in (
            ("status", STATUSES, self.status),
            ("finish_reason", FINISH_REASONS, self.finish_reason),
            ("cache_source", (*CACHE_SOURCES, None), self.cache_source),
        ):
            if value not in allowed:
                problems.append(f"{name} must be one of {allowed}, got {value!r}")
        if self.status == "ok" and (
            not isinstance(self.answer, str)
            or self.error is not None
            or self.finish_reason == "error"
        ):
            problems.append("an ok row needs a str answer, no error and finish_reason stop|length")
        if self.status == "error" and (not self.error or self.finish_reason != "error"):
            problems.append("an error row needs an error message and finish_reason 'error'")
        for f in fields(self):
            value = getattr(self, f.name)
            kind = RESULT_SCHEMA.field(f.name).type
            if value is None:
                continue
            if kind == _S and not isinstance(value, str):
                problems.append(f"{f.name} must be a string, got {value!r}")
            if kind == _I and (not isinstance(value, int) or isinstance(value, bool)):
                problems.append(f"{f.name} must be an int, got {value!r}")
            if kind == _F and (not isinstance(value, int | float) or isinstance(value, bool)):
                problems.append(f"{f.name} must be a number, got {value!r}")
            if kind == _TS and (not isinstance(value, datetime) or value.tzinfo is None):
                problems.append(f"{f.name} must be a timezone-aware datetime, got {value!r}")
        if self.finished_at is None:
            problems.append("finished_at is required")
        if problems:
            raise ValueError(f"ResultRow {self.request_key!r}: " + "; ".join(problems))

    def to_record(self) -> dict[str, Any]:
        """The row as a dict in RESULT_SCHEMA's column order, timestamps in UTC."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("started_at", "finished_at"):
            if record[name] is not None:
                record[name] = record[name].astimezone(timezone.utc)
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ResultRow:
        """Inverse of `to_record` (e.g. a row of `read_results(...).to_pylist()`)."""
        return cls(**{name: record[name] for name in RESULT_SCHEMA.names})


def current_versions() -> dict[str, str | None]:
    """Versions for the file metadata; reads package metadata only (no MLX import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        mlx = None
    return {
        "salabatch": __version__,
        "mlx": mlx,
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
    }


def decode_metadata(metadata: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    """A results file's metadata as Python values: schema_version (int or None), job_spec and
    versions (JSON-decoded, or None), created_at and updated_at (ISO 8601 UTC strings, or None).
    """
    metadata = metadata or {}

    def text(key: bytes) -> str | None:
        value = metadata.get(key)
        return value.decode("utf-8", errors="replace") if value is not None else None

    def parsed(key: bytes) -> Any:
        raw = text(key)
        with contextlib.suppress(ValueError):
            return json.loads(raw) if raw is not None else None
        return raw

    version = text(META_SCHEMA_VERSION)
    return {
        "schema_version": int(version) if version and version.isdigit() else None,
        "job_spec": parsed(META_JOB_SPEC),
        "versions": parsed(META_VERSIONS),
        "created_at": text(META_CREATED_AT),
        "updated_at": text(META_UPDATED_AT),
    }


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """`decode_metadata` of a results file (final file, or its parts before the first merge)."""
    return decode_metadata(read_results(path).schema.metadata)


def read_results(path: str | os.PathLike) -> pa.Table:
    """Every row of a results file, one per request_key, sorted (see the module docstring):
    the final file plus the parts of a running or killed run. Schema: RESULT_SCHEMA, with the
    file metadata (job spec, versions, created/updated) of the newest contributor.

    Raises OutputError when there is neither file nor parts, or the file is not salabatch's.
    """
    path = Path(path)
    parts_dir = _parts_dir(path)
    if not path.exists() and not parts_dir.is_dir():
        raise OutputError("no such results file", path=path)
    for _ in range(3):
        try:
            return _read_contents(path, parts_dir)
        except (FileNotFoundError, _Changed):
            continue  # a writer merged and removed its parts while we read: read again
    raise OutputError("the results changed while being read; try again", path=path)


class ResultWriter:
    """Writes finished rows durably; merges them into `path` on close (see the module docstring).

        with ResultWriter(path, job_spec_json=spec_json, versions=current_versions()) as out:
            todo = [r for r in requests if r.key not in out.done_keys()]
            ...
            out.write(rows_of_one_document)    # durable when it returns

    resume: keep the rows already in `path` (and in the parts of a killed run) and report their
        keys in `done_keys()`; False starts fresh (the old rows are replaced when this closes).
    retry_errors: error rows do not count as done, so they are recomputed.
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
    ) -> None:
        json.loads(job_spec_json)  # ValueError for a caller bug; the spec is stored verbatim
        self.path = Path(path)
        self.parts_dir = _parts_dir(self.path)
        self.resume = resume
        self.retry_errors = retry_errors
        self._job_spec_json = job_spec_json
        self._versions_json = json.dumps(dict(versions), sort_keys=True)
        self._done: dict[str, bool] = {}  # request_key -> an ok row exists
        self._written: set[str] = set()
        self._retain: set[str] | None = None
        self._bad_parts: set[Path] = set()
        self._closed = False
        if self.path.is_dir():
            raise OutputError("is a folder, expected a .parquet results file", path=self.path)
        if self.path.exists():
            _read_final(self.path, columns=[])  # before anything is written: whose file is it?
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(
                f"cannot create the parts folder ({_why(e)})", path=self.parts_dir
            ) from e
        self._lock_fd = _lock(self.parts_dir / "LOCK", self.path)
        try:
            self._open()
        except BaseException:
            self._unlock()
            raise

    def _open(self) -> None:
        for tmp in self.parts_dir.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)  # a write or merge a killed writer left unfinished
        created = None
        if not self.resume:
            for _, part in _list_parts(self.parts_dir):
                part.unlink()
            _touch_durably(self.parts_dir / "FRESH")
        else:
            fresh = (self.parts_dir / "FRESH").exists()
            if self.path.exists() and not fresh:
                final, meta = _read_final(self.path, columns=["request_key", "status"])
                created = decode_metadata(meta)["created_at"]
                self._note_done(final)
            for _, part in _list_parts(self.parts_dir):
                table, meta = self._read_part(part)
                if table is not None:
                    created = created or decode_metadata(meta)["created_at"]
                    self._note_done(table)
        parts = _list_parts(self.parts_dir)
        self._seq = parts[-1][0] + 1 if parts else 1
        self._created_at = created or _now_iso()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def done_keys(self) -> frozenset[str]:
        """request_keys finished in earlier runs or by this writer (error rows count unless
        retry_errors)."""
        return frozenset(k for k, ok in self._done.items() if ok or not self.retry_errors)

    def retain(self, keys: Iterable[str]) -> None:
        """Declare the request_keys of the whole job (not just this run's --limit share): at
        close, rows of earlier runs with other keys (an edited question, a changed document or
        model) are dropped. Rows written by this writer are always kept. Without a call, all
        rows are kept."""
        self._retain = set(keys)

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
            raise OutputError(f"cannot write finished rows ({_why(e)})", path=self.parts_dir) from e
        self._seq += 1
        self._note_done(table)
        self._written.update(r["request_key"] for r in records)

    def close(self) -> None:
        """Merge everything into `path` (atomically), then remove the parts. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._merge()
        finally:
            self._unlock()

    finalize = close

    def _merge(self) -> None:
        fresh_marker = self.parts_dir / "FRESH"
        fresh = fresh_marker.exists()
        parts = [part for _, part in _list_parts(self.parts_dir)]
        if not parts and (fresh or self._retain is None):
            # No new row: keep the results as they are (a --no-resume run that failed before
            # its first row must not wipe the old results).
            fresh_marker.unlink(missing_ok=True)
            return
        tables = []
        if self.path.exists() and not fresh:
            tables.append(_read_final(self.path)[0])
        for part in parts:
            table, _ = self._read_part(part)
            if table is not None:
                tables.append(table)
        merged = _dedupe(tables)
        if self._retain is not None:
            keep = pa.array(sorted(self._retain | self._written), _S)
            merged = merged.filter(pc.is_in(merged["request_key"], value_set=keep))
        merged = merged.replace_schema_metadata(self._metadata(updated=True))
        try:
            _write_durably(merged, self.path, tmp_dir=self.parts_dir)
            # The final file holds every row now. FRESH goes first: with it gone and parts
            # left, a rerun merges final + parts, which gives the same rows again.
            fresh_marker.unlink(missing_ok=True)
            _fsync_dir(self.parts_dir)
            for part in parts:
                part.unlink()
        except OSError as e:
            raise OutputError(f"cannot write the results ({_why(e)})", path=self.path) from e

    def _read_part(self, part: Path) -> tuple[pa.Table | None, Mapping[bytes, bytes] | None]:
        table, meta, problem = _read_part(part)
        if problem and part not in self._bad_parts:
            self._bad_parts.add(part)
            _warn_bad_part(part, problem)
        return table, meta

    def _note_done(self, table: pa.Table) -> None:
        keys = table.column("request_key").to_pylist()
        statuses = table.column("status").to_pylist()
        for key, status in zip(keys, statuses, strict=True):
            self._done[key] = self._done.get(key, False) or status == "ok"

    def _metadata(self, *, updated: bool) -> dict[bytes, bytes]:
        meta = {
            META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
            META_JOB_SPEC: self._job_spec_json.encode(),
            META_VERSIONS: self._versions_json.encode(),
            META_CREATED_AT: self._created_at.encode(),
        }
        if updated:
            meta[META_UPDATED_AT] = _now_iso().encode()
        return meta

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


# --- reading -------------------------------------------------------------------------------

_PART_NAME = re.compile(r"part-(\d+)-[0-9a-f]{32}\.parquet")


def _parts_dir(path: Path) -> Path:
    return path.with_name(path.name + ".parts")


def _list_parts(parts_dir: Path) -> list[tuple[int, Path]]:
    """Complete part files, oldest first."""
    if not parts_dir.is_dir():
        return []
    found = [(_PART_NAME.fullmatch(p.name), p) for p in parts_dir.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m)


def _read_final(
    path: Path, columns: list[str] | None = None
) -> tuple[pa.Table, Mapping[bytes, bytes]]:
    """The final file's rows (`columns` only) and metadata; OutputError unless salabatch's."""
    try:
        with pq.ParquetFile(path, page_checksum_verification=True) as f:
            _check_schema(f.schema_arrow, path)
            table = f.read(columns=columns)
            return table, f.schema_arrow.metadata
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise OutputError(
            f"not a readable Parquet file ({_why(e)}); refusing to overwrite it, "
            "choose another output path or move the file away",
            path=path,
        ) from e


def _read_part(path: Path) -> tuple[pa.Table | None, Mapping[bytes, bytes] | None, str | None]:
    """(rows, metadata, None), or (None, None, why) for a part that cannot be read."""
    try:
        table, meta = _read_final(path)
    except OutputError as e:
        return None, None, e.message
    return table, meta, None


def _check_schema(schema: pa.Schema, path: Path) -> None:
    version = (schema.metadata or {}).get(META_SCHEMA_VERSION)
    if version is None:
        raise OutputError(
            "a Parquet file salabatch did not write (no salabatch.schema_version in its "
            "metadata); refusing to overwrite it, choose another output path",
            path=path,
        )
    if version != str(SCHEMA_VERSION).encode():
        raise OutputError(
            "a results file of another salabatch schema version",
            path=path,
            expected=SCHEMA_VERSION,
            got=version.decode(errors="replace"),
        )
    want = {f.name: f.type for f in RESULT_SCHEMA}
    got = {f.name: f.type for f in schema}
    if got != want:
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        raise OutputError(
            f"columns do not match salabatch's results schema v{SCHEMA_VERSION}",
            path=path,
            expected="RESULT_SCHEMA",
            got=", ".join(f"{n}: {got.get(n, 'missing')}" for n in bad[:8]),
        )


def _warn_bad_part(part: Path, problem: str) -> None:
    warnings.warn(
        f"{part}: skipping an unreadable part file ({problem}); its rows will be recomputed",
        OutputWarning,
        stacklevel=4,
    )


class _Changed(Exception):
    """The final file was replaced while `_read_contents` read it and the parts."""


def _read_contents(path: Path, parts_dir: Path) -> pa.Table:
    identity = _identity(path)
    fresh = (parts_dir / "FRESH").exists()  # before the final file: a merge removes it after
    tables, meta = [], {}
    if path.exists():
        final, final_meta = _read_final(path, columns=[] if fresh else None)
        if not fresh:
            tables.append(final)
            meta = dict(final_meta)
    for _, part in _list_parts(parts_dir):
        table, part_meta, problem = _read_part(part)
        if problem:
            _warn_bad_part(part, problem)
            continue
        tables.append(table)
        created = meta.get(META_CREATED_AT)
        meta.update(part_meta)  # the newest run's job spec and versions
        if created:
            meta[META_CREATED_AT] = created
    if _identity(path) != identity:
        raise _Changed
    meta[META_SCHEMA_VERSION] = str(SCHEMA_VERSION).encode()
    return _dedupe(tables).replace_schema_metadata(meta)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _dedupe(tables: list[pa.Table]) -> pa.Table:
    """Tables oldest first -> one row per request_key (ok beats error, then the later row),
    sorted by _SORT_KEYS."""
    tables = [t.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA) for t in tables]
    table = pa.concat_tables(tables) if tables else RESULT_SCHEMA.empty_table()
    keys = table.column("request_key").to_pylist()
    ok = [s == "ok" for s in table.column("status").to_pylist()]
    best: dict[str, int] = {}
    for i, key in enumerate(keys):
        j = best.get(key)
        if j is None or ok[i] or not ok[j]:
            best[key] = i
    table = table.take(pa.array(sorted(best.values()), pa.int64()))
    return table.sort_by([(name, "ascending") for name in _SORT_KEYS])


# --- durable files -------------------------------------------------------------------------


def _write_durably(table: pa.Table, dst: Path, *, tmp_dir: Path) -> None:
    """Write `table` to a temp file in `tmp_dir`, fsync it, rename it to `dst`, fsync the
    folder. `tmp_dir` must be on `dst`'s file system (a sibling folder is)."""
    tmp = tmp_dir / f".tmp-{uuid.uuid4().hex}.parquet"
    try:
        pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            _fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(dst.parent)


def _touch_durably(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        _fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(path.parent)


def _fsync(fd: int) -> None:
    # On macOS fsync only reaches the drive's cache; F_FULLFSYNC reaches the medium.
    if sys.platform == "darwin":
        import fcntl

        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
    os.fsync(fd)


def _fsync_dir(folder: Path) -> None:
    """Make renames and deletions in `folder` durable; some file systems refuse, and there the
    rename is still atomic, only possibly not yet on disk."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        _fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _lock(lock_path: Path, results: Path) -> int:
    """An exclusive flock on `lock_path`; the kernel drops it when the process dies."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputError(f"cannot create the lock file ({_why(e)})", path=lock_path) from e
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one writer per file is then up to the user
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise OutputError(
            "another salabatch run is writing this results file (it holds "
            f"{lock_path.name} in {lock_path.parent.name}/)",
            path=results,
        ) from None
    return fd


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _why(e: BaseException) -> str:
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return " ".join(text.split()) or type(e).__name__
