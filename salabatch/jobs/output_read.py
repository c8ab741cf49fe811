"""Reading a results file: the final file plus the parts of a running or killed run.

What a results file holds (`read_results`): the rows of x.parquet (ignored when FRESH is
present) followed by the rows of the readable parts in sequence order, one row per
`request_key`: an ok row beats an error row, otherwise the later row wins; sorted by doc_id,
question_id, custom_id, request_key. `inspect`, `export` and resume all read it this way, so
they agree with each other at every instant, mid-run and after a kill included.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from salabatch.errors import OutputError
from salabatch.jobs.output import (
    META_CREATED_AT,
    META_SCHEMA_VERSION,
    RESULT_SCHEMA,
    SCHEMA_VERSION,
    OutputWarning,
    decode_metadata,
    list_parts,
    parts_dir_of,
)

_SORT_KEYS = ("doc_id", "question_id", "custom_id", "request_key")


def read_results(path: str | os.PathLike) -> pa.Table:
    """Every row of a results file, one per request_key, sorted (see the module docstring):
    the final file plus the parts of a running or killed run. Schema: RESULT_SCHEMA, with the
    file metadata (job spec, versions, created/updated) of the newest contributor.

    Raises OutputError when there is neither file nor parts, or the file is not salabatch's.
    """
    path = Path(path)
    parts_dir = parts_dir_of(path)
    if not path.exists() and not parts_dir.is_dir():
        raise OutputError("no such results file", path=path)
    for _ in range(3):
        try:
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
    fresh = (parts_dir / "FRESH").exists()  # before the final file: a merge removes it after
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
            return table, f.schema_arrow.metadata
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise OutputError(
            f"not a readable Parquet file ({error_text(e)}); refusing to overwrite it, "
            "choose another output path or move the file away",
            path=path,
        ) from e


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


def error_text(e: BaseException) -> str:
    """Why an OS or Arrow call failed, on one line."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return " ".join(text.split()) or type(e).__name__
