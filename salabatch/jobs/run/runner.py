"""`salabatch run`: documents → each prefilled once (or found cached) → its questions decoded as
one batch → result rows, made durable as they finish.

A long document's questions share its prefix cache; short documents with few questions are
pooled, each row carrying its whole prompt, so that they still decode in full batches. A row
that cannot be answered (unreadable document, overflow, a failure while generating) becomes an
error row and the run goes on; Ctrl-C stops after the rows already finished are written.

Rows already in the results are skipped; once the whole job is planned, rows of earlier runs
that are no longer in it are dropped when the results are merged (the run says so first). A run
that `--limit` cut plans no further, drops nothing, and counts the rows it leaves. What happens
before the model loads (`prepare`: results writer, tokenizer, weights digest, dtype, prefix
store) is shared with `--dry-run` and the Ray executor; what turns plans into rows
(`answerer.Answerer`) with the Ray executor's workers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from salabatch.engine.kernels.attention import on_gpu
from salabatch.engine.load import load_model
from salabatch.engine.memory import cache_limit
from salabatch.engine.model import Model
from salabatch.engine.runtime import engine_runtime
from salabatch.jobs.ingest.documents import count_documents, expand_sources
from salabatch.jobs.results.export import export_openai_jsonl
from salabatch.jobs.results.schema import ResultRow
from salabatch.jobs.results.writer import ResultWriter, stale_rows
from salabatch.jobs.run.answerer import Answerer, RunIdentity
from salabatch.jobs.run.plan import DocPlan, Limit, Planner
from salabatch.jobs.run.prepare import JobSetup, prepared
from salabatch.jobs.run.progress import Progress
from salabatch.jobs.spec.models import JobSpec


@dataclass
class RunSummary:
    output: str
    written: int = 0
    errors: int = 0
    skipped: int = 0  # rows of the job already in the results file (of it, before planned)
    failed: int = 0  # error rows of the job in the results, this run's and earlier ones'
    left: int = 0  # rows of the job --limit left for a later run
    dropped: int = 0  # rows of earlier runs no longer in the job, dropped from the results
    documents: int = 0  # with rows to do
    requests: int = 0  # request lines to do
    seconds: float = 0.0
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)


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
        limited = limit is not None
        with prepared(
            spec, resume=resume, retry_errors=retry_errors, limited=limited, echo=echo
        ) as (writer, setup):
            # until the plan counts those of the job: a run stopped before then says this
            summary.skipped = len(writer.done_keys())
            model = load_model(setup.model_path, dtype=setup.dtype, tokens=setup.tok.vocab_size)
            chunk = setup.spec.engine.prefill_chunk
            with engine_runtime(cache_limit(model.config, chunk, on_gpu())):
                runner = _Runner(setup, model, writer, summary, progress, echo, debug)
                runner.run(limit)
        if jsonl is not None:  # from the merged results, earlier runs' rows included
            export_openai_jsonl(spec.output.path, jsonl, lines=runner.request_lines)
    except KeyboardInterrupt:
        summary.interrupted = True
    summary.seconds = time.perf_counter() - start
    return summary


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
        self.progress = Progress.to(
            sys.stderr, setup.spec.name, count_rows(setup.spec), enabled=progress, echo=echo
        )
        self.answerer = Answerer(
            setup, model, identity, progress=self.progress, echo=self.progress.write, debug=debug
        )
        self.request_lines: dict[str, int] = {}  # request key -> its line, once planned

    def run(self, limit: int | None) -> None:
        planner = self.setup.planner(self.writer.done_keys())
        cut = Limit(limit)
        try:
            for rows in self.answerer.answer(self._plans(planner, cut)):
                self._write(rows)
            self._count_skipped(planner)
            self.summary.skipped = planner.skipped  # the plan is whole: the job's rows alone
            if cut.cut:
                # The rest of the job is unplanned: nothing is dropped; what is done and left
                # is counted over the whole job without reading the documents' text.
                job = cut_short(self.setup, self.writer, self.summary)
                self.progress.found_done(self.summary.skipped)
            else:
                # Rows of earlier runs outside the job go when the writer closes (a document or
                # question removed from the job, a changed document).
                job = frozenset(planner.job_keys)
                self.summary.dropped = self.writer.retain(job)
                if self.summary.dropped:
                    self.progress.write(f"warning: {stale_rows(self.summary.dropped)}")
            self.summary.failed = len(job & self.writer.failed_keys())
            self.request_lines = planner.request_lines
        finally:
            self.progress.close()

    def _plans(self, planner: Planner, cut: Limit) -> Iterator[DocPlan]:
        """The job's plans in order, as many as `cut` (--limit) takes."""
        for plan in cut.take(self.setup.plans(planner)):
            self._count_skipped(planner)
            if plan.of_requests:
                self.summary.requests += len(plan.rows)
            else:
                self.summary.documents += 1
            yield plan

    def _count_skipped(self, planner: Planner) -> None:
        self.progress.found_done(planner.skipped)

    def _write(self, rows: list[ResultRow]) -> None:
        if not rows:
            return
        self.writer.write(rows)
        self.summary.written += len(rows)
        self.summary.errors += sum(r.status == "error" for r in rows)
        self.progress.rows(len(rows))


def cut_short(setup: JobSetup, writer: ResultWriter, summary: RunSummary) -> frozenset[str]:
    """The counts of a run `--limit` cut, over the whole job: the rows left (this run's error
    rows are not left, even when it retried errors), the rows done before it; the keys of the
    job's rows."""
    job = setup.outstanding(writer.done_keys() | writer.written_keys())
    summary.left = job.todo
    summary.skipped = job.done - len(writer.written_keys())
    return job.keys


def count_rows(spec: JobSpec) -> int:
    """Rows the job asks for (documents × questions + request lines), without reading files
    beyond counting jsonl lines."""
    files = expand_sources(spec.sources())
    total = sum(count_documents(f) for f in files) * len(spec.questions)
    if spec.requests:
        with open(spec.requests, "rb") as handle:
            total += sum(1 for line in handle if line.strip())
    return total
