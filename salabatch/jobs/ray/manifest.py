"""The work of a distributed run as units a worker can do alone, listed on the driver without
loading the model or extracting any text.

A unit is one file's documents (a .jsonl file's records travel together), or for a job's
request lines, one group sharing a prefix or a pool of short lines. A document is never split:
all its questions go to the worker that holds its prefix. Rows are named from what
`identify_documents` gives (a document's id and sha256), so documents whose rows are all in the
results make no unit, and a rerun with nothing to do only hashes the files. Files are listed
largest first, so that a long document does not start last while the other workers sit idle.

Each unit carries its rows (the driver writes error rows for them when every worker attempt
failed) and the keys of its documents' rows done earlier: the worker's Planner skips those, as
the local runner's does, so the prompts (truncation included) come out the same. Request lines
are planned on the driver, prompts and all, since their grouping needs every line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from salabatch.jobs.ingest.documents import (
    Document,
    FileDocuments,
    identify_documents,
    read_documents,
)
from salabatch.jobs.run.openai_batch import plan_requests
from salabatch.jobs.run.plan import POOL_FACTOR, DocPlan, Limit, Row
from salabatch.jobs.run.prepare import JobSetup


@dataclass(frozen=True)
class Unit:
    """One piece of a run for one worker: the rows it is to produce, and where they come from
    (a file to read there, or request lines planned here)."""

    rows: tuple[Row, ...]  # of a file: its documents' identities only (Document.text is "")
    file: FileDocuments | None = None
    done: frozenset[str] = frozenset()  # keys of the file's rows done already
    plans: tuple[DocPlan, ...] = ()  # request lines, with their prompts
    size: int = 0  # bytes of the file, which orders the units


@dataclass
class Manifest:
    """The units of a run, and what the driver needs to finish it like the local runner."""

    units: list[Unit] = field(default_factory=list)
    errors: list[DocPlan] = field(default_factory=list)  # request lines that cannot be served
    documents: int = 0  # documents with rows to do
    requests: int = 0  # request lines to do
    skipped: int = 0  # rows already in the results
    job_keys: set[str] = field(default_factory=set)  # every row of the job, done or not
    request_lines: dict[str, int] = field(default_factory=dict)  # request key -> its line
    complete: bool = False  # the whole job was listed (no --limit cut)


def plan_manifest(setup: JobSetup, done: frozenset[str], limit: int | None = None) -> Manifest:
    """The units of `setup`'s job still to do, `done`: the keys in the results. `limit` cuts
    the job after that many rows, as `--limit` does in the local runner."""
    planner, every = setup.planner(done), setup.planner(())
    manifest = Manifest()
    cut = Limit(limit)
    for found in identify_documents(setup.spec.sources()):
        path = str(found.file.path)
        read_as = found.file.read_as
        docs = [Document(doc_id, path, "", sha, read_as=read_as) for doc_id, sha in found.ids]
        todo = [planner.rows_of(doc) for doc in docs]
        rows = [row for doc_rows in todo for row in doc_rows]
        if not rows:
            continue
        if (rows := cut.trim(rows)) is None:
            break
        keys = {row.key for doc in docs for row in every.rows_of(doc)}
        unit = Unit(tuple(rows), found, frozenset(keys & done), size=_size(found.file.path))
        manifest.units.append(unit)
        kept = {row.key for row in rows}
        manifest.documents += sum(any(r.key in kept for r in doc_rows) for doc_rows in todo)
    if setup.spec.requests and not cut.cut:
        pool: list[DocPlan] = []
        for plan in cut.take(plan_requests(setup.spec, setup.tok, planner)):
            manifest.requests += len(plan.rows)
            if plan.error:
                manifest.errors.append(plan)
            elif setup.is_pooled(plan):
                pool.append(plan)
                if sum(len(p.rows) for p in pool) >= POOL_FACTOR * setup.spec.engine.batch_size:
                    manifest.units.append(_requests(pool))
                    pool = []
            else:
                manifest.units.append(_requests([plan]))
        if pool:
            manifest.units.append(_requests(pool))
    manifest.units.sort(key=lambda unit: -unit.size)  # stable: request lines keep their order
    manifest.skipped, manifest.job_keys = planner.skipped, planner.job_keys
    manifest.request_lines, manifest.complete = planner.request_lines, not cut.cut
    return manifest


def unit_plans(setup: JobSetup, unit: Unit) -> list[DocPlan]:
    """What a worker answers for `unit`: the plans of its file's documents (read here) with
    the unit's rows, or its request lines' plans. Raises JobSpecError when the file is not the
    one listed (see `read_documents`)."""
    if unit.file is None:
        return list(unit.plans)
    planner = setup.planner(unit.done)
    todo = {row.key for row in unit.rows}
    plans = []
    for doc in read_documents(unit.file.file, unit.file.ids):
        for plan in planner.plan(doc):
            plan.rows = [row for row in plan.rows if row.key in todo]  # --limit cut the rest
            if plan.rows:
                plans.append(plan)
    return plans


def _requests(plans: list[DocPlan]) -> Unit:
    return Unit(tuple(row for plan in plans for row in plan.rows), plans=tuple(plans))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # unreadable: its documents become error rows, quickly
        return 0
