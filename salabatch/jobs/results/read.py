"""Reading results: a results file (the final file plus the parts of a running or killed run)
or a results folder, deduplicated and sorted as `schema` describes; the parts folder's layout.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from salabatch.errors import OutputError, error_text
from salabatch.jobs.results.schema import (
    ADDED_COLUMNS,
    META_CREATED_AT,
    META_SCHEMA_VERSION,
    META_SKIPPED_FILES,
    META_UPDATED_AT,
    RESULT_SCHEMA,
    SCHEMA_VERSION,
    OutputWarning,
    decode_metadata,
)

# ---- the folder ----------------------------------------------------------------------------------

_PART_NAME = re.compile(r"part-(\d+)-[0-9a-f]{32}\.parquet")
FRESH = "FRESH"  # the marker of a --no-resume run in the parts folder


def parts_dir_of(path: Path) -> Path:
    """The parts folder of the results file `path`, beside the file a link names (one run's
    lock is every path's to the same file)."""
    real = Path(os.path.realpath(path))
    return real.with_name(real.name + ".parts")


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
            if path.exists() and not path.is_file():  # a FIFO would wait for a writer forever
                raise OutputError("not a regular file", path=path)
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
            Path(root, n)
            for n in names
            if n.endswith(".parquet")
            and not n.startswith((".", "_"))
            and Path(root, n).is_file()  # not a FIFO, which would wait for a writer forever
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
    # Each job's rows on their own: two jobs' results side by side (results/ of several jobs)
    # share custom_ids such as "a.txt/q1" and are all kept, a job after a job.
    rows = pa.concat_tables(tables).sort_by("finished_at")
    jobs = sorted(set(rows.column("job_name").to_pylist()))
    each = [dedupe([rows.filter(pc.equal(rows["job_name"], job))]) for job in jobs]
    meta = _folder_metadata(metas)
    if skipped:
        meta[META_SKIPPED_FILES] = str(len(skipped)).encode()
    return pa.concat_tables(each).replace_schema_metadata(meta)


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
    with _final(path) as f:
        table = f.read(columns=columns)
        return table if columns is not None else _with_added(table), f.schema_arrow.metadata


def check_final(path: Path) -> None:
    """OutputError unless `path` is a results file salabatch wrote whose every page reads
    back, checksums verified: what a run looks at before its work, not to fail at the merge
    after it. A row group at a time."""
    with _final(path) as f:
        for group in range(f.num_row_groups):
            f.read_row_group(group)


@contextmanager
def _final(path: Path) -> Iterator[pq.ParquetFile]:
    """The final file open, its pages' checksums verified as they are read, its schema
    checked; what fails in the block (Arrow's errors, the disk's) an OutputError naming it."""
    try:
        with pq.ParquetFile(path, page_checksum_verification=True) as f:
            _check_schema(f.schema_arrow, path)
            yield f
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
