"""`salabatch run`: documents → each prefilled once (or found cached) → its questions decoded as
one batch → result rows, made durable as they finish.

A long document's questions share its prefix cache; short documents with few questions are
pooled, each row carrying its whole prompt, so that they still decode in full batches. A row
that cannot be answered (unreadable document, overflow, a failure while generating) becomes an
error row and the run goes on; Ctrl-C stops after the rows already finished are written.

Rows already in the results are skipped; once the whole job is planned, rows of earlier runs
that are no longer in it are dropped when the results are merged. What happens before the model
loads (`JobSetup`: tokenizer, weights digest, dtype, planning, prefix keys) is shared with
`--dry-run`; what turns plans into rows (`answerer.Answerer`) with the Ray executor's workers.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

from tqdm import tqdm

from salabatch.engine.fingerprint import model_fingerprint
from salabatch.engine.load import load_model
from salabatch.engine.model import Model
from salabatch.engine.runtime import dtype_name, engine_runtime, resolve_dtype
from salabatch.engine.tokenizer import Tokenizer, load_tokenizer
from salabatch.errors import OutputError
from salabatch.jobs.answerer import Answerer, RunIdentity
from salabatch.jobs.ingest.documents import expand_sources
from salabatch.jobs.openai_batch import plan_requests
from salabatch.jobs.plan import DocPlan, Planner, pooled
from salabatch.jobs.results.export import export_openai_jsonl
from salabatch.jobs.results.schema import ResultRow, current_versions
from salabatch.jobs.results.writer import ResultWriter
from salabatch.jobs.spec.models import JobSpec, spec_json
from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore
from salabatch.models import model_note, resolve_model

MIN_FREE_BYTES = 64 * 2**20  # refuse to start a run with less room than this for its results


@dataclass
class RunSummary:
    output: str
    written: int = 0
    errors: int = 0
    skipped: int = 0  # rows already in the results file
    failed: int = 0  # error rows of the job in the results, this run's and earlier ones'
    documents: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class JobSetup:
    """What a run prepares before its model loads, and what `--dry-run` shows without loading
    it: the checkpoint folder, the tokenizer, the weights digest, the dtype, the prefix store."""

    spec: JobSpec
    model_path: Path
    tok: Tokenizer
    model_sha: str
    dtype: str  # e.g. "bfloat16": the weights are loaded in it, and it is part of every key
    store: PrefixStore | None

    @classmethod
    def of(cls, spec: JobSpec) -> JobSetup:
        """Resolves the model (a builtin one is made on first use); reads no weights into memory."""
        path = resolve_model(spec.model, spec.cache.dir)
        return cls(
            spec=spec,
            model_path=path,
            tok=load_tokenizer(path),
            model_sha=model_fingerprint(path, memo=spec.cache.dir / "fingerprints.json"),
            dtype=dtype_name(resolve_dtype(spec.engine.dtype)),
            store=PrefixStore(spec.cache.dir, spec.cache.max_gb) if spec.cache.enabled else None,
        )

    def planner(self, done: Iterable[str]) -> Planner:
        """A planner of the job's rows that skips the request keys `done`."""
        return Planner(self.spec, self.tok, self.model_sha, self.dtype, done)

    def plans(self, planner: Planner) -> Iterator[DocPlan]:
        """The rows still to do: the documents' first, then the request lines'."""
        if not self.spec.requests:
            return planner.documents()
        return chain(planner.documents(), plan_requests(self.spec, self.tok, planner))

    def is_pooled(self, plan: DocPlan) -> bool:
        """Whether the rows of `plan` decode in batches across documents, each with its whole
        prompt (see `plan.pooled`), rather than from the document's shared prefix."""
        return pooled(plan, self.spec.engine.pool_max_tokens, self.spec.engine.batch_size)

    def prefix_key(self, plan: DocPlan) -> PrefixKey:
        """Where the prefix of `plan` (its document prompt, prefilled) is stored."""
        return PrefixKey.of(
            self.spec.model, self.model_sha, self.tok.fingerprint, self.dtype, plan.doc_prompt
        )


def run_job(
    spec: JobSpec,
    *,
    resume: bool = True,
    retry_errors: bool = False,
    limit: int | None = None,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    debug: bool = False,
    jsonl: Path | None = None,
) -> RunSummary:
    """Runs the job; returns what was done. KeyboardInterrupt stops it after finished rows.
    A document that fails becomes error rows, reported by `echo` in one line (with its
    traceback when `debug`); a failure of the results file (OutputError) ends the run.
    `jsonl`: when the run was not interrupted, every row of the results is also written there
    as OpenAI Batch output lines, request lines in the requests file's order (atomically)."""
    start = time.perf_counter()
    summary = RunSummary(str(spec.output.path))
    try:
        with prepared(spec, resume=resume, retry_errors=retry_errors, echo=echo) as (
            writer,
            setup,
        ):
            model = load_model(setup.model_path, dtype=setup.dtype)
            with engine_runtime():
                runner = _Runner(setup, model, writer, summary, progress, echo, debug)
                runner.run(limit)
        if jsonl is not None:  # from the merged results, earlier runs' rows included
            export_openai_jsonl(spec.output.path, jsonl, lines=runner.request_lines)
    except KeyboardInterrupt:
        summary.interrupted = True
    summary.seconds = time.perf_counter() - start
    return summary


@contextmanager
def prepared(
    spec: JobSpec, *, resume: bool, retry_errors: bool, echo: Callable[[str], None]
) -> Iterator[tuple[ResultWriter, JobSetup]]:
    """What every executor does before its expensive part, cheap checks first: the results
    writer (writable, not another run's: its lock), room for the results, then the model's
    files (`JobSetup`). The writer merges the results when the block ends."""
    with ResultWriter(
        spec.output.path,
        job_spec_json=spec_json(spec),
        versions=current_versions(),
        resume=resume,
        retry_errors=retry_errors,
    ) as writer:
        check_free_space(spec.output.path.parent)
        setup = JobSetup.of(spec)
        if note := model_note(spec.model):
            echo(f"note: {note}")
        yield writer, setup


def check_free_space(folder: Path, needed: int = MIN_FREE_BYTES) -> None:
    """OutputError unless the file system of `folder` has `needed` bytes free for results."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise OutputError(
            f"only {free / 2**20:.1f} MB free for the results; free at least "
            f"{needed / 2**20:.0f} MB or choose another output path",
            path=folder,
        )


class _Runner:
    """The local executor: plans the job in order (`--limit` cuts it), answers it with one
    model and writes each finished row."""

    def __init__(
        self,
        setup: JobSetup,
        model: Model,
        writer: ResultWriter,
        summary: RunSummary,
        progress: bool,
        echo: Callable[[str], None],
        debug: bool = False,
    ) -> None:
        self.setup, self.writer, self.summary = setup, writer, summary
        identity = RunIdentity.of(setup, model.config)
        self.answerer = Answerer(setup, model, identity, progress=progress, echo=echo, debug=debug)
        self.request_lines: dict[str, int] = {}  # request key -> its line, once planned
        self.planned_all = False  # every plan of the job was drawn (no --limit cut)
        self.bar = tqdm(
            total=count_rows(setup.spec),
            unit="row",
            desc=setup.spec.name,
            disable=not progress,
            dynamic_ncols=True,
        )

    def run(self, limit: int | None) -> None:
        planner = self.setup.planner(self.writer.done_keys())
        try:
            for rows in self.answerer.answer(self._plans(planner, limit)):
                self._write(rows)
            if self.planned_all:
                # Rows of earlier runs outside the job go when the writer closes (a document or
                # question removed from the job, a changed document).
                self.writer.retain(planner.job_keys)
            self._count_skipped(planner)
            self.summary.failed = len(planner.job_keys & self.writer.failed_keys())
            self.request_lines = planner.request_lines
        finally:
            self.bar.close()

    def _plans(self, planner: Planner, limit: int | None) -> Iterator[DocPlan]:
        """The job's plans in order, at most `limit` rows in all."""
        budget = limit if limit is not None else -1
        for plan in self.setup.plans(planner):
            self._count_skipped(planner)
            if budget == 0:
                return  # --limit: the rest of the job stays unplanned, so no row is dropped
            if budget > 0:
                plan.rows = plan.rows[:budget]
                budget -= len(plan.rows)
            self.summary.documents += 1
            yield plan
        self.planned_all = True

    def _count_skipped(self, planner: Planner) -> None:
        self.bar.update(planner.skipped - self.summary.skipped)
        self.summary.skipped = planner.skipped

    def _write(self, rows: list[ResultRow]) -> None:
        if not rows:
            return
        self.writer.write(rows)
        self.summary.written += len(rows)
        self.summary.errors += sum(r.status == "error" for r in rows)
        self.bar.update(len(rows))


def count_rows(spec: JobSpec) -> int:
    """Rows the job asks for (documents × questions + request lines), without reading files
    beyond counting jsonl lines."""
    total = 0
    for f in expand_sources(spec.sources()):
        if f.path.suffix.lower() == ".jsonl":
            with open(f.path, "rb") as handle:
                total += sum(1 for line in handle if line.strip()) * len(spec.questions)
        else:
            total += len(spec.questions)
    if spec.requests:
        with open(spec.requests, "rb") as handle:
            total += sum(1 for line in handle if line.strip())
    return total
