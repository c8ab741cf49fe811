"""`salabatch run --dry-run`: what a run would do, without loading the model weights.

Prepares the job as a run does (`prepare.JobSetup`), reads and tokenizes the documents, and says
per document how many tokens its prompt has, how many rows are still to do, and whether its
prefix cache is already stored. The results file is read as a resumed run reads it, never
written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from salabatch.engine import memory
from salabatch.engine.config import ModelConfig
from salabatch.engine.kernels.attention import on_gpu
from salabatch.engine.memory import MemoryPlan
from salabatch.jobs.results.read import parts_dir_of, read_results
from salabatch.jobs.results.schema import decode_metadata
from salabatch.jobs.results.writer import counts_done, stale_rows
from salabatch.jobs.run.openai_batch import plan_requests
from salabatch.jobs.run.plan import POOL_FACTOR, DocPlan, Limit, Planner
from salabatch.jobs.run.prepare import JobSetup
from salabatch.jobs.spec.models import JobSpec
from salabatch.models import model_note
from salabatch.plural import counted


def dry_run(
    spec: JobSpec,
    *,
    resume: bool = True,
    retry_errors: bool = False,
    limit: int | None = None,
    echo: Callable[[str], None] = print,
) -> None:
    """Prints the plan of `run_job(spec, resume=resume, retry_errors=retry_errors,
    limit=limit)`: with a limit, only the documents and rows that run would do."""
    setup = JobSetup.of(spec)
    config = ModelConfig.from_file(setup.model_path)  # checked; no weights are read
    earlier, series = _earlier_rows(spec.output.path)
    limited = limit is not None
    done = [  # the keys a run skips, as its ResultWriter.done_keys() gives them
        key
        for key, (ok, by) in earlier.items()
        if resume and counts_done(ok, by, retry_errors, limited, series)
    ]
    planner = setup.planner(done)
    note = model_note(spec.model)
    note = f" ({note})" if note else ""
    echo(f"job {spec.name}: model {spec.model}{note}, {setup.dtype}, output {spec.output.path}")
    echo(f"{counted(len(spec.questions), 'question')}:")
    for q in spec.questions:
        echo(f"  {q.id}: {q.text}")
    echo("documents:")
    cut = Limit(limit)
    prefixes = _Prefixes(setup)
    largest = _Largest(config, _sizes(setup, config))
    rows = _show_documents(setup, planner, cut, prefixes, largest, echo)
    if spec.requests and not cut.cut:
        plans = list(cut.take(plan_requests(spec, setup.tok, planner)))
        for plan in plans:
            if not plan.error:
                largest.add(plan, setup.is_pooled(plan))
                prefixes.state(plan)
        todo = sum(len(p.rows) for p in plans)
        bad = sum(len(p.rows) for p in plans if p.error)
        shared = [p for p in plans if p.doc_prompt is not None]
        rows += todo
        echo(
            f"requests {spec.requests}: {todo} to do ({bad} invalid; "
            f"{sum(len(p.rows) for p in shared)} in {counted(len(shared), 'group')} sharing a "
            "prefix)"
        )
    skipped, later = planner.skipped, ""
    if cut.cut:  # the run plans no further: the rest of the job is counted as it would count it
        job = setup.outstanding(done)
        todo, skipped = job.todo, job.done
        later = f" (--limit {limit}; {todo - rows} more of the job left for later runs)"
    echo(
        f"plan: {counted(rows, 'row')} to do{later}, {skipped} already done; prefill "
        f"{prefixes.prefill} document tokens, {prefixes.cached} from stored prefixes"
    )
    if largest.document is not None:
        plan, what = largest.document
        echo(_memory_line(plan, f"the largest of the documents, {what}"))
    if largest.pooled:
        what = f"the longest pooled row ({max(largest.pooled)} tokens, its document with it)"
        echo(_memory_line(largest.pooled_plan(), what))
    # a run cut by --limit drops nothing: it has not seen the whole job
    stale = len(earlier.keys() - planner.job_keys) if resume and not cut.cut else 0
    if stale:
        echo(stale_rows(stale))


@dataclass
class _Largest:
    """What decides a run's peak memory, as the run plans it (`engine.memory`): of the
    documents answered from their own prefix, the one whose prefix and rows still to do
    (question and answer, in tokens) plan the most (not always the longest: a resumed one may
    have a row left, a shorter one all of them); every pooled row (its whole prompt, document
    included, and its answer)."""

    config: ModelConfig
    sizes: dict
    document: tuple[MemoryPlan, str] | None = None  # its plan, and what it is
    pooled: list[int] = field(default_factory=list)

    def add(self, plan: DocPlan, pooled: bool) -> None:
        own = [len(r.prompt) + r.max_tokens for r in plan.rows]
        if pooled:
            self.pooled += [len(plan.doc_prompt or ()) + n for n in own]
            return
        needs = memory.answer_plan(self.config, doc_tokens=plan.doc_tokens, rows=own, **self.sizes)
        if self.document is None or needs.peak > self.document[0].peak:
            what = f"{plan.doc.doc_id} ({plan.doc_tokens} tokens, {counted(len(own), 'row')})"
            self.document = needs, what

    def pooled_plan(self) -> MemoryPlan:
        return memory.answer_plan(self.config, doc_tokens=0, rows=self.pooled, **self.sizes)


class _Prefixes:
    """Where each prefix a run answers from would come from, as `DocumentCaches` takes it:
    the last one in memory (until a full pool of short rows decodes, as the run lets it go
    then), a stored one (before the run, or saved by it earlier), the furthest snapshot of a
    killed prefill, or a prefill; with the tokens to prefill and those already held, in all."""

    def __init__(self, setup: JobSetup) -> None:
        self.setup, self.prefill, self.cached = setup, 0, 0
        self._saved: set[str] = set()  # prefixes this run stores as it goes
        self._last: str | None = None
        self._pool = 0  # short rows waiting for a full pool

    def state(self, plan: DocPlan) -> str:
        setup, tokens = self.setup, plan.doc_tokens
        if setup.is_pooled(plan):
            self.prefill += tokens * len(plan.rows)
            self._pool += len(plan.rows)
            if self._pool >= POOL_FACTOR * setup.spec.engine.batch_size:
                self._pool, self._last = 0, None  # the pool decodes, the prefix is let go
            return "short: prefilled with each question, batched across documents"
        key, store = setup.prefix_key(plan), setup.store
        last, self._last = self._last, key.digest
        if key.digest == last:
            self.cached += tokens
            return "prefix in memory (the one before)"
        if store is not None and (key.digest in self._saved or store.has(key)):
            self.cached += tokens
            return "prefix stored"
        resumed = 0 if store is None else min(store.snapshot_tokens(key), tokens)
        self.cached += resumed
        self.prefill += tokens - resumed
        if store is not None:
            self._saved.add(key.digest)
        return f"resumes a snapshot at {resumed} tokens" if resumed else "to prefill once"


def _show_documents(
    setup: JobSetup,
    planner: Planner,
    cut: Limit,
    prefixes: _Prefixes,
    largest: _Largest,
    echo: Callable[[str], None],
) -> int:
    """One line per document the run would take (`cut`: its --limit), its prefix counted by
    `prefixes`, its memory by `largest`; returns the rows to do."""
    rows = 0
    for plan in cut.take(planner.documents()):
        rows += len(plan.rows)
        if plan.error:
            echo(
                f"  {plan.doc.doc_id}: error, {counted(len(plan.rows), 'error row')}: {plan.error}"
            )
            continue
        n_pages = plan.doc.n_pages
        pages = f", {counted(n_pages, 'page')}" if n_pages else ""
        notes = "".join(f", {n}" for n in plan.notes)
        largest.add(plan, setup.is_pooled(plan))
        state = prefixes.state(plan)
        echo(
            f"  {plan.doc.doc_id}: {counted(plan.doc_tokens, 'token')}{pages}, "
            f"{counted(len(plan.rows), 'row')}, {state}{notes}"
        )
    return rows


def _sizes(setup: JobSetup, config: ModelConfig) -> dict:
    """`memory.answer_plan`'s arguments of the job as a whole (its weights, chunk, batch)."""
    import mlx.core as mx

    engine = setup.spec.engine
    itemsize = getattr(mx, setup.dtype).size
    return {
        "weights": memory.checkpoint_weights_bytes(setup.model_path, config, itemsize),
        "chunk": engine.prefill_chunk,
        "batch_size": engine.batch_size,
        "itemsize": itemsize,
        "gpu": on_gpu(),
    }


def _memory_line(plan: MemoryPlan, what: str) -> str:
    """The peak the run plans for `what` (as the run's own check sizes it), and the memory
    free now."""
    free = memory.available_bytes(on_gpu())
    fits = "fits" if plan.peak <= free else "does NOT fit: the run refuses it"
    return f"memory: {what} needs {plan.line()}; {memory.gb(free)} free now ({fits})"


def _earlier_rows(path: Path) -> tuple[dict[str, tuple[bool, str]], frozenset[str]]:
    """(request_key -> (whether it is an ok row, its run_id), for the rows already in the
    results file; the retry runs the file names, see ResultWriter). Nothing when there is no
    file yet. Like a run, raises OutputError for a file that is not salabatch's."""
    if not path.exists() and not parts_dir_of(path).is_dir():
        return {}, frozenset()
    table = read_results(path)
    columns = [table.column(name).to_pylist() for name in ("request_key", "status", "run_id")]
    rows = {key: (status == "ok", by) for key, status, by in zip(*columns, strict=True)}
    return rows, decode_metadata(table.schema.metadata)["retried_by"]
