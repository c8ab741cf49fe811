"""`salabatch run`: documents → each prefilled once (or found cached) → its questions decoded as
one batch → result rows, made durable as they finish.

A long document's questions share its prefix cache; short documents with few questions are
pooled, each row carrying its whole prompt, so that they still decode in full batches. A row
that cannot be answered (unreadable document, overflow, a failure while generating) becomes an
error row and the run goes on; Ctrl-C stops after the rows already finished are written.

Rows already in the results are skipped; once the whole job is planned, rows of earlier runs
that are no longer in it are dropped when the results are merged. What happens before the model
loads (`JobSetup`: tokenizer, weights digest, dtype, planning, prefix keys) is shared with
`--dry-run`; what turns plans into rows (`Answerer`) with the Ray executor's workers.
"""

from __future__ import annotations

import hashlib
import shutil
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import chain
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

from salabatch.demo import builtin
from salabatch.engine.chat import split_thinking
from salabatch.engine.config import ModelConfig
from salabatch.engine.detokenizer import StreamingDetokenizer
from salabatch.engine.fingerprint import model_fingerprint
from salabatch.engine.generate import Generation, Generator, Request
from salabatch.engine.load import load_model
from salabatch.engine.model import Model
from salabatch.engine.models import resolve_model
from salabatch.engine.runtime import dtype_name, engine_runtime, resolve_dtype
from salabatch.engine.tokenizer import Tokenizer, load_tokenizer
from salabatch.errors import OutputError, error_text
from salabatch.jobs.document_cache import DocumentCaches, Prefix
from salabatch.jobs.documents import expand_sources
from salabatch.jobs.export import export_openai_jsonl
from salabatch.jobs.openai_batch import plan_requests
from salabatch.jobs.plan import DocPlan, Planner, Row, pooled
from salabatch.jobs.prefix_store import PrefixKey, PrefixStore
from salabatch.jobs.result_writer import ResultWriter
from salabatch.jobs.results import ResultRow, current_versions
from salabatch.jobs.spec import JobSpec, spec_json

POOL_FACTOR = 4  # pooled short rows are decoded once this many batches' worth are waiting
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
        if builtin.is_builtin(spec.model):
            echo(f"note: {builtin.WARNING}")
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


@dataclass(frozen=True)
class RunIdentity:
    """What every row of one run says about where it comes from (run, job, model), and the
    error rows, which need no loaded model: a Ray driver writes them for a document whose
    workers all died."""

    run_id: str
    job_name: str
    model: str
    model_sha: str
    quant_bits: int | None  # bits per weight of a quantized checkpoint, else None

    @classmethod
    def of(cls, setup: JobSetup, config: ModelConfig, run_id: str | None = None) -> RunIdentity:
        """The identity of a new run of `setup`'s job (`run_id`: a run already under way)."""
        quant = config.quantization
        return cls(
            run_id=run_id or _run_id(setup.spec),
            job_name=setup.spec.name,
            model=setup.spec.model,
            model_sha=setup.model_sha,
            quant_bits=quant.bits if quant else None,
        )

    def columns(self, row: Row) -> dict[str, Any]:
        """The identity columns of `row`'s result."""
        return {
            "run_id": self.run_id,
            "job_name": self.job_name,
            "doc_id": row.doc.doc_id,
            "doc_path": row.doc.path,
            "doc_sha256": row.doc.sha256,
            "question_id": row.question_id,
            "question": row.question,
            "custom_id": row.custom_id,
            "request_key": row.key,
            "request_line": row.request_line,
            "model": self.model,
            "model_sha": self.model_sha,
            "quant_bits": self.quant_bits,
        }

    def error_row(self, row: Row, reason: str, doc_tokens: int | None = None) -> ResultRow:
        return ResultRow(
            **self.columns(row),
            status="error",
            finish_reason="error",
            error=reason,
            doc_tokens=doc_tokens,
            finished_at=_now(),
        )


class Answerer:
    """Turns DocPlans into result rows with one loaded model: a document's questions decoded
    together from its prefix (prefilled once, or found in memory or the store), short documents
    and request lines pooled into batches with their whole prompts, error rows for whatever
    fails. The local runner writes the rows as they come; a Ray worker collects a unit's."""

    def __init__(
        self,
        setup: JobSetup,
        model: Model,
        identity: RunIdentity,
        *,
        progress: bool,
        echo: Callable[[str], None],
        debug: bool = False,
    ) -> None:
        spec = setup.spec
        self.setup, self.spec, self.model, self.tok = setup, spec, model, setup.tok
        self.identity, self.progress, self.echo, self.debug = identity, progress, echo, debug
        self.caches = DocumentCaches(
            model,
            setup.store,
            chunk=spec.engine.prefill_chunk,
            snapshot_every=spec.cache.snapshot_every,
        )
        self.stop = frozenset(setup.tok.eos_ids)

    def answer(self, plans: Iterable[DocPlan]) -> Iterator[list[ResultRow]]:
        """The rows of `plans` as they finish: one finished row at a time, or the error rows of
        a document together. Pooled rows wait for a full pool, or for the last plan."""
        pool: list[tuple[Row, DocPlan]] = []
        for plan in plans:
            if plan.error:
                yield [self._error_row(r, plan, plan.error) for r in plan.rows]
            elif self.setup.is_pooled(plan):
                pool += [(r, plan) for r in plan.rows]
                if len(pool) >= POOL_FACTOR * self.spec.engine.batch_size:
                    yield from self._pool(pool)
                    pool = []
            else:
                yield from self._document(plan)
        yield from self._pool(pool)

    # -- a long document: prefix once, questions together ------------------------------------
    def _document(self, plan: DocPlan) -> Iterator[list[ResultRow]]:
        started = _now()
        mx.reset_peak_memory()
        key = self.setup.prefix_key(plan)
        rows = {r.key: r for r in plan.rows}
        try:
            with tqdm(
                total=len(plan.doc_prompt),
                unit="tok",
                desc=f"prefill {plan.doc.doc_id}",
                leave=False,
                disable=not self.progress,
                dynamic_ncols=True,
            ) as bar:
                prefix = self.caches.get(
                    key, plan.doc_prompt, lambda done, _: bar.update(done - bar.n)
                )
            requests = [self._request(r, r.prompt) for r in plan.rows]
            for g in self._generator().generate(requests, prefix.cache):
                row = rows.pop(g.request.id)
                yield [self._row(row, plan, g, _row_prefix(prefix, row, plan), started)]
        except OutputError:
            raise  # the results cannot be written: nothing more can be saved
        except Exception as e:  # one document's failure must not end an overnight run
            reason = self._report(e, f"document {plan.doc.doc_id}")
            yield [self._error_row(r, plan, reason) for r in rows.values()]

    # -- short documents and requests: whole prompts, batched across documents ---------------
    def _pool(self, pool: list[tuple[Row, DocPlan]]) -> Iterator[list[ResultRow]]:
        if not pool:
            return
        started = _now()
        by_key = {r.key: (r, plan) for r, plan in pool}
        requests = [self._request(r, (*(plan.doc_prompt or ()), *r.prompt)) for r, plan in pool]
        try:
            for g in self._generator().generate(requests):
                row, plan = by_key.pop(g.request.id)
                yield [self._row(row, plan, g, None, started)]
        except OutputError:
            raise
        except Exception as e:
            reason = self._report(e, "a pooled batch")
            yield [self._error_row(r, plan, reason) for r, plan in by_key.values()]

    def _generator(self) -> Generator:
        return Generator(
            self.model,
            batch_size=self.spec.engine.batch_size,
            prefill_chunk=self.spec.engine.prefill_chunk,
            detokenizer=self._detokenizer,
        )

    def _report(self, e: Exception, where: str) -> str:
        """Says in one line (with the traceback under --debug) that `where` failed; returns the
        reason its error rows carry."""
        reason = f"{type(e).__name__}: {error_text(e)}"
        trace = f"\n{traceback.format_exc().rstrip()}" if self.debug else ""
        self.echo(f"error in {where}: {reason}{trace}")
        return reason

    # -- rows ----------------------------------------------------------------------------------
    def _request(self, row: Row, prompt: tuple[int, ...]) -> Request:
        return Request(
            row.key, tuple(prompt), row.params, row.max_tokens, self.stop, row.stop_strings
        )

    def _detokenizer(self) -> StreamingDetokenizer:
        """The decoder the Generator follows a row's text with (rows with stop strings only)."""
        return self.tok.detokenizer(skip_special=True)

    def _row(
        self, row: Row, plan: DocPlan, g: Generation, prefix: Prefix | None, started: datetime
    ) -> ResultRow:
        text = g.text if g.text is not None else self.tok.decode(g.tokens, skip_special=True)
        reasoning, answer = split_thinking(text)
        return ResultRow(
            **self.identity.columns(row),
            answer=answer,
            reasoning=reasoning if row.think else None,
            finish_reason=g.finish_reason,
            **_prefill_columns(plan, g, prefix),
            completion_tokens=g.completion_tokens,
            ttft_s=g.ttft_s,
            decode_s=g.decode_s,
            decode_tok_s=g.decode_tok_s,
            batch_size=g.batch_size,
            peak_mem_gb=mx.get_peak_memory() / 2**30,
            started_at=started,
            finished_at=_now(),
        )

    def _error_row(self, row: Row, plan: DocPlan, reason: str) -> ResultRow:
        return self.identity.error_row(row, reason, plan.doc_tokens or None)


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


def _row_prefix(prefix: Prefix, row: Row, plan: DocPlan) -> Prefix:
    """The prefix as `row` saw it. Request lines sharing a prefix (automatic prefix caching)
    are separate requests: the first line prefilled it, the others found it in memory. A
    document's questions all show where the document came from."""
    if row.request_line is None or prefix.source != "none" or row is plan.rows[0]:
        return prefix
    return Prefix(prefix.cache, "memory")


def _prefill_columns(plan: DocPlan, g: Generation, prefix: Prefix | None) -> dict[str, Any]:
    """A finished row's prompt columns: doc_tokens, prompt_tokens, cached_tokens, cache_source,
    doc_prefill_s and prefill_tok_s (of the document when this run prefilled it, else of the
    row's own tokens)."""
    if prefix is None:  # pooled: the row prefilled its whole prompt itself
        return {
            "doc_tokens": plan.doc_tokens if plan.doc_prompt is not None else None,
            "prompt_tokens": g.prompt_tokens,
            "cached_tokens": 0,
            "cache_source": "none",
            "doc_prefill_s": g.prefill_s,
            "prefill_tok_s": g.prompt_tokens / g.prefill_s if g.prefill_s else None,
        }
    columns = {
        "doc_tokens": plan.doc_tokens,
        "prompt_tokens": plan.doc_tokens + g.prompt_tokens,
        "cache_source": prefix.source,
    }
    if prefix.source == "none":  # prefilled in this run (perhaps from a snapshot)
        prefilled = plan.doc_tokens - prefix.resumed_from
        return columns | {
            "cached_tokens": prefix.resumed_from,
            "doc_prefill_s": prefix.prefill_s,
            "prefill_tok_s": prefilled / prefix.prefill_s if prefix.prefill_s else None,
        }
    return columns | {
        "cached_tokens": plan.doc_tokens,
        "doc_prefill_s": 0.0,
        "prefill_tok_s": g.prompt_tokens / g.prefill_s if g.prefill_s else None,
    }


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


def _run_id(spec: JobSpec) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{hashlib.sha256(spec_json(spec).encode()).hexdigest()[:8]}"


def _now() -> datetime:
    return datetime.now(timezone.utc)
