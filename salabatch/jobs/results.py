"""What a results file is, and how it is read: the Parquet schema, `ResultRow`, the file
metadata and the folder.

One row per document × question. On disk, for `output.path: results/x.parquet`:

    results/x.parquet                the merged results, replaced atomically when a run ends
    results/x.parquet.parts/         exists while a run is going, or after one was killed
        LOCK                         flock'd by the running writer: one writer per results file
        FRESH                        present when this run replaces x.parquet (--no-resume)
        part-000007-<uuid>.parquet   the rows of one `ResultWriter.write()` call, complete
        .<name>.tmp-<pid>-<hex>.parquet  a part or a merge being written; deleted at the next open

`result_writer.ResultWriter` writes them (durably, resumably). What a results file holds
(`read_results`): the rows of x.parquet (ignored when FRESH is present) followed by the rows of
the readable parts in sequence order, one row per `request_key`: an ok row beats an error row,
otherwise the later row wins, and one row per custom_id: the most recently written key (the
row of an edited question supersedes the old one); sorted by doc_id, question_id, custom_id,
request_key. `inspect`, `export` and resume all read it this way, so they agree with each other
at every instant, mid-run and after a kill included.

`read_results` also reads a results *folder* (a dataset): every `*.parquet` below it, at any
depth, whose name and folders do not start with `.` or `_` (temp files, Spark/Hive markers), as
Ray's `Dataset.write_parquet` writes them, a `.parts` folder, or results files collected from
several machines. Its rows are deduplicated as above, "later" meaning a later `finished_at`
(the files have no sequence); a file that is not salabatch's is skipped with an OutputWarning.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from salabatch import __version__
from salabatch.errors import OutputError, error_text

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
        _col("request_line", _I, "1-based line of the request in the --requests file, else null"),
        # result
        _col("answer", _S, "the answer (think block removed); null for an error row"),
        _col("reasoning", _S, "the think block when generation.think is true, else null"),
        _col("finish_reason", _S, "stop | length | error", nullable=False),
        _col("status", _S, "ok | error", nullable=False),
        _col("error", _S, "one-line reason of an error row, else null"),
        # model
        _col("model", _S, "the job's model (checkpoint path or builtin:name)", nullable=False),
        _col("model_sha", _S, "digest of the checkpoint weights"),
        _col("quant_bits", _I, "bits of a quantized checkpoint (2 to 8), null for full precision"),
        # tokens
        _col("doc_tokens", _I, "tokens of the document prompt"),
        _col("prompt_tokens", _I, "tokens of the whole prompt: document prompt + question"),
        _col("cached_tokens", _I, "prompt tokens served from the prefix cache"),
        _col("completion_tokens", _I, "generated tokens, think block included"),
        # timings
        _col("doc_prefill_s", _F, "seconds prefilling the document; 0 when it came from a cache"),
        _col("prefill_tok_s", _F, "prefill throughput, tokens/s"),
        _col("ttft_s", _F, "seconds from the start of the request to its first token"),
        _col("decode_s", _F, "seconds decoding the answer"),
        _col("decode_tok_s", _F, "decode throughput of this sequence, tokens/s"),
        _col("batch_size", _I, "sequences decoded together"),
        _col("cache_source", _S, "where the document's prefix came from: memory | disk | none"),
        _col("peak_mem_gb", _F, "peak accelerator/process memory during the request, GB"),
        _col("started_at", _TS, "when the request started (UTC)"),
        _col("finished_at", _TS, "when the row was finished (UTC)", nullable=False),
    ],
    metadata={META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode()},
)

# Columns added to schema v1 later: a file without them reads as if they held nulls.
ADDED_COLUMNS = ("request_line",)

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
    request_line: int | None = None
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


def encode_metadata(
    *, job_spec_json: str, versions_json: str, created_at: str, updated_at: str | None = None
) -> dict[bytes, bytes]:
    """The file metadata of a part (no updated_at: not merged yet) or of a merged file."""
    meta = {
        META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
        META_JOB_SPEC: job_spec_json.encode(),
        META_VERSIONS: versions_json.encode(),
        META_CREATED_AT: created_at.encode(),
    }
    if updated_at is not None:
        meta[META_UPDATED_AT] = updated_at.encode()
    return meta


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


# ---- the folder ----------------------------------------------------------------------------------

_PART_NAME = re.compile(r"part-(\d+)-[0-9a-f]{32}\.parquet")
FRESH = "FRESH"  # the marker of a --no-resume run in the parts folder


def parts_dir_of(path: Path) -> Path:
    """The parts folder of the results file `path`."""
    return path.with_name(path.name + ".parts")


def list_parts(parts_dir: Path) -> list[tuple[int, Path]]:
    """Complete part files, oldest first."""
    if not parts_dir.is_dir():
        return []
    found = [(_PART_NAME.fullmatch(p.name), p) for p in parts_dir.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m)


# ---- reading ------------------------------------------------------------------------------------

_SORT_KEYS = ("doc_id", "question_id", "custom_id", "request_key")


def read_results(path: str | os.PathLike) -> pa.Table:
    """Every row of a results file, one per request_key, sorted (see the module docstring):
    the final file plus the parts of a running or killed run; or every row of a results folder.
    Schema: RESULT_SCHEMA, with the file metadata (job spec, versions, created/updated) of the
    newest contributor.

    Raises OutputError when there is neither file nor parts, the file is not salabatch's, or
    the folder holds no salabatch results file.
    """
    path = Path(path)
    for _ in range(3):
        try:
            if path.is_dir():
                return _read_folder(path)
            parts_dir = parts_dir_of(path)
            if not path.exists() and not parts_dir.is_dir():
                raise OutputError("no such results file", path=path)
            return _read_contents(path, parts_dir)
        except (FileNotFoundError, _Changed):
            continue  # a writer merged and removed its parts while we read: read again
    raise OutputError("the results changed while being read; try again", path=path)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """`decode_metadata` of a results file (final file, or its parts before the first merge)."""
    return decode_metadata(read_results(path).schema.metadata)


class _Changed(Exception):
    """The final file was replaced while `_read_contents` read it and the parts."""


def _read_contents(path: Path, parts_dir: Path) -> pa.Table:
    identity = _identity(path)
    fresh = (parts_dir / FRESH).exists()  # before the final file: a merge removes it after
    tables, meta = [], {}
    if path.exists():
        final, final_meta = read_final(path, columns=[] if fresh else None)
        if not fresh:
            tables.append(final)
            meta = dict(final_meta)
    for _, part in list_parts(parts_dir):
        table, part_meta, problem = read_part(part)
        if problem:
            warn_bad_part(part, problem)
            continue
        tables.append(table)
        created = meta.get(META_CREATED_AT)
        meta.update(part_meta)  # the newest run's job spec and versions
        if created:
            meta[META_CREATED_AT] = created
    if _identity(path) != identity:
        raise _Changed
    meta[META_SCHEMA_VERSION] = str(SCHEMA_VERSION).encode()
    return dedupe(tables).replace_schema_metadata(meta)


def dataset_files(folder: Path) -> list[Path]:
    """The Parquet files of a results folder, sorted: every `*.parquet` below it, skipping
    names (of files and of folders) that start with `.` or `_`."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        found += [
            Path(root, n) for n in names if n.endswith(".parquet") and not n.startswith((".", "_"))
        ]
    return sorted(found)


def _read_folder(folder: Path) -> pa.Table:
    files = dataset_files(folder)
    if not files:
        raise OutputError(
            "a folder without .parquet files; expected a results file or a folder of them",
            path=folder,
        )
    tables, metas, skipped = [], [], []
    for file in files:
        table, meta, problem = read_part(file)
        if problem:
            skipped.append(f"{file}: {problem}")
            warnings.warn(
                f"{file}: skipping a file that is not salabatch results ({problem})",
                OutputWarning,
                stacklevel=3,
            )
            continue
        tables.append(table.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA))
        metas.append(meta or {})
    if not tables:
        raise OutputError(
            f"none of its {len(files)} .parquet files is salabatch results (first: {skipped[0]})",
            path=folder,
        )
    # The files have no order: a later finish wins (the sort is stable, ties keep file order).
    rows = pa.concat_tables(tables).sort_by("finished_at")
    return dedupe([rows]).replace_schema_metadata(_folder_metadata(metas))


def _folder_metadata(metas: list[Mapping[bytes, bytes]]) -> dict[bytes, bytes]:
    """salabatch's metadata of the newest file (job spec, versions), with the earliest
    created_at and the latest updated_at (none unless some file was a merged results file)."""
    stamps = [m.get(META_UPDATED_AT) or m.get(META_CREATED_AT) or b"" for m in metas]
    newest = metas[stamps.index(max(stamps))]  # ISO 8601 UTC stamps sort as text
    stamped = (META_CREATED_AT, META_UPDATED_AT)
    meta = {k: v for k, v in newest.items() if k.startswith(b"salabatch.") and k not in stamped}
    for key, pick in ((META_CREATED_AT, min), (META_UPDATED_AT, max)):
        stamps = [m[key] for m in metas if m.get(key)]
        if stamps:
            meta[key] = pick(stamps)
    return meta


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def read_final(
    path: Path, columns: list[str] | None = None
) -> tuple[pa.Table, Mapping[bytes, bytes]]:
    """The final file's rows (`columns` only) and metadata; OutputError unless salabatch's."""
    try:
        with pq.ParquetFile(path, page_checksum_verification=True) as f:
            _check_schema(f.schema_arrow, path)
            table = f.read(columns=columns)
            return table if columns is not None else _with_added(table), f.schema_arrow.metadata
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise OutputError(f"not a readable Parquet file ({error_text(e)})", path=path) from e


def _check_schema(schema: pa.Schema, path: Path) -> None:
    version = (schema.metadata or {}).get(META_SCHEMA_VERSION)
    if version is None:
        raise OutputError(
            "a Parquet file salabatch did not write (no salabatch.schema_version in its metadata)",
            path=path,
        )
    if version != str(SCHEMA_VERSION).encode():
        raise OutputError(
            "a results file of another salabatch schema version",
            path=path,
            expected=SCHEMA_VERSION,
            got=version.decode(errors="replace"),
        )
    got = {f.name: f.type for f in schema}
    want = {f.name: f.type for f in RESULT_SCHEMA if f.name in got or f.name not in ADDED_COLUMNS}
    if got != want:
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        raise OutputError(
            f"columns do not match salabatch's results schema v{SCHEMA_VERSION}",
            path=path,
            expected="RESULT_SCHEMA",
            got=", ".join(f"{n}: {got.get(n, 'missing')}" for n in bad[:8]),
        )


def _with_added(table: pa.Table) -> pa.Table:
    """`table` with the ADDED_COLUMNS it lacks, as nulls (a file of an older salabatch)."""
    for name in ADDED_COLUMNS:
        if name not in table.column_names:
            field = RESULT_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table


def read_part(path: Path) -> tuple[pa.Table | None, Mapping[bytes, bytes] | None, str | None]:
    """(rows, metadata, None), or (None, None, why) for a part that cannot be read."""
    try:
        table, meta = read_final(path)
    except OutputError as e:
        return None, None, e.message
    return table, meta, None


def warn_bad_part(part: Path, problem: str) -> None:
    """Warn that the part file `part` is skipped: `problem` says why."""
    warnings.warn(
        f"{part}: skipping an unreadable part file ({problem}); its rows will be recomputed",
        OutputWarning,
        stacklevel=4,
    )


def dedupe(tables: list[pa.Table]) -> pa.Table:
    """Tables oldest first -> one row per request_key (ok beats error, then the later row), then
    one row per custom_id (the later key: a row of an edited question, request or document
    supersedes the row the job asked for before), sorted by _SORT_KEYS."""
    tables = [t.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA) for t in tables]
    table = pa.concat_tables(tables) if tables else RESULT_SCHEMA.empty_table()
    keys = table.column("request_key").to_pylist()
    ok = [s == "ok" for s in table.column("status").to_pylist()]
    best: dict[str, int] = {}
    for i, key in enumerate(keys):
        j = best.get(key)
        if j is None or ok[i] or not ok[j]:
            best[key] = i
    custom_ids = table.column("custom_id").to_pylist()
    latest: dict[str, int] = {}  # custom_id -> the row of its most recently written key
    last_seen = {key: i for i, key in enumerate(keys)}
    for _key, i in sorted(best.items(), key=lambda kv: last_seen[kv[0]]):
        latest[custom_ids[i]] = i
    table = table.take(pa.array(sorted(latest.values()), pa.int64()))
    return table.sort_by([(name, "ascending") for name in _SORT_KEYS])
