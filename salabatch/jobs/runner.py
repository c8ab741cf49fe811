"""`salabatch run`: documents → each prefilled once (or found cached) → its questions decoded as
one batch → result rows, made durable as they finish.

A long document's questions share its prefix cache; short documents with few questions are
pooled, each row carrying its whole prompt, so that they still decode in full batches. A row
that cannot be answered (unreadable document, overflow, a failure while generating) becomes an
error row and the run goes on; Ctrl-C stops after the rows already finished are written.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import chain

import mlx.core as mx
from tqdm import tqdm

from salabatch.engine import builtin
from salabatch.engine.chat import split_thinking
from salabatch.engine.fingerprint import model_fingerprint
from salabatch.engine.generate import Generation, Generator, Request
from salabatch.engine.load import load_model
from salabatch.engine.runtime import engine_runtime
from salabatch.engine.tokenizer import Tokenizer, load_tokenizer
from salabatch.jobs.document_cache import DocumentCaches, Prefix
from salabatch.jobs.documents import expand_sources
from salabatch.jobs.openai_batch import plan_requests
from salabatch.jobs.output import ResultRow, current_versions
from salabatch.jobs.output_write import ResultWriter
from salabatch.jobs.plan import DocPlan, Planner, Row, pooled
from salabatch.jobs.prefix_store import PrefixKey, PrefixStore
from salabatch.jobs.spec import JobSpec, spec_json

POOL_FACTOR = 4  # pooled short rows are decoded once this many batches' worth are waiting


@dataclass
class RunSummary:
    output: str
    written: int = 0
    errors: int = 0
    skipped: int = 0  # rows already in the results file
    documents: int = 0
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
) -> RunSummary:
    """Runs the job; returns what was done. KeyboardInterrupt stops it after finished rows."""
    start = time.perf_counter()
    summary = RunSummary(str(spec.output.path))
    path = builtin.resolve(spec.model, spec.cache.dir)
    if builtin.is_builtin(spec.model):
        echo(f"note: {builtin.WARNING}")
    model = load_model(path, dtype=spec.engine.dtype)
    tok = load_tokenizer(path)
    model_sha = model_fingerprint(path, memo=spec.cache.dir / "fingerprints.json")
    store = PrefixStore(spec.cache.dir, spec.cache.max_gb) if spec.cache.enabled else None
    try:
        with (
            engine_runtime(),
            ResultWriter(
                spec.output.path,
                job_spec_json=spec_json(spec),
                versions=current_versions(),
                resume=resume,
                retry_errors=retry_errors,
            ) as writer,
        ):
            runner = _Runner(spec, model, tok, model_sha, store, writer, summary, progress, echo)
            runner.run(limit)
    except KeyboardInterrupt:
        summary.interrupted = True
    summary.seconds = time.perf_counter() - start
    return summary


class _Runner:
    def __init__(
        self, spec, model, tok: Tokenizer, model_sha, store, writer, summary, progress, echo
    ) -> None:
        self.spec, self.model, self.tok, self.model_sha = spec, model, tok, model_sha
        self.writer, self.summary, self.echo = writer, summary, echo
        self.dtype = str(model.dtype).removeprefix("mlx.core.")
        quant = model.config.quantization  # bits per weight: the quantization's, or the dtype's
        self.quant_bits = quant.bits if quant else model.dtype.size * 8
        self.run_id = _run_id(spec)
        self.caches = DocumentCaches(
            model, store, chunk=spec.engine.prefill_chunk, snapshot_every=spec.cache.snapshot_every
        )
        self.store = store
        self.stop = frozenset(tok.eos_ids)
        self.bar = tqdm(
            total=count_rows(spec),
            unit="row",
            desc=spec.name,
            disable=not progress,
            dynamic_ncols=True,
        )
        self.progress = progress

    def run(self, limit: int | None) -> None:
        planner = Planner(self.spec, self.tok, self.model_sha, self.dtype, self.writer.done_keys())
        plans: Iterable[DocPlan] = planner.documents()
        if self.spec.requests:
            plans = chain(plans, plan_requests(self.spec, self.tok, planner))
        pool: list[tuple[Row, DocPlan]] = []
        budget = limit if limit is not None else -1
        try:
            for plan in plans:
                self._count_skipped(planner)
                if budget == 0:
                    break
                if budget > 0:
                    plan.rows = plan.rows[:budget]
                    budget -= len(plan.rows)
                self.summary.documents += 1
                if plan.error:
                    self._write([self._error_row(r, plan, plan.error) for r in plan.rows])
                elif pooled(plan, self.spec.engine.prefill_chunk, self.spec.engine.batch_size):
                    pool += [(r, plan) for r in plan.rows]
                    if len(pool) >= POOL_FACTOR * self.spec.engine.batch_size:
                        self._pool(pool)
                        pool = []
                else:
                    self._document(plan)
            self._pool(pool)
            self._count_skipped(planner)
        finally:
            self.bar.close()

    def _count_skipped(self, planner: Planner) -> None:
        self.bar.update(planner.skipped - self.summary.skipped)
        self.summary.skipped = planner.skipped

    # -- a long document: prefix once, questions together ------------------------------------
    def _document(self, plan: DocPlan) -> None:
        started = _now()
        mx.reset_peak_memory()
        key = PrefixKey.of(
            self.spec.model, self.model_sha, self.tok.fingerprint, self.dtype, plan.prefix
        )
        rows = {r.key: r for r in plan.rows}
        try:
            with tqdm(
                total=len(plan.prefix),
                unit="tok",
                desc=f"prefill {plan.doc.doc_id}",
                leave=False,
                disable=not self.progress,
                dynamic_ncols=True,
            ) as bar:
                prefix = self.caches.get(key, plan.prefix, lambda done, _: bar.update(done - bar.n))
            requests = [self._request(r, r.prompt) for r in plan.rows]
            gen = Generator(
                self.model,
                batch_size=self.spec.engine.batch_size,
                prefill_chunk=self.spec.engine.prefill_chunk,
            )
            for g in gen.generate(requests, prefix.cache):
                row = rows.pop(g.request.id)
                self._write([self._row(row, plan, g, prefix, started)])
        except Exception as e:  # one document's failure must not end an overnight run
            reason = f"{type(e).__name__}: {e}"
            self.echo(f"error in document {plan.doc.doc_id}: {reason}\n{traceback.format_exc()}")
            self._write([self._error_row(r, plan, reason) for r in rows.values()])

    # -- short documents and requests: whole prompts, batched across documents ---------------
    def _pool(self, pool: list[tuple[Row, DocPlan]]) -> None:
        if not pool:
            return
        started = _now()
        by_key = {r.key: (r, plan) for r, plan in pool}
        requests = [self._request(r, (*(plan.prefix or ()), *r.prompt)) for r, plan in pool]
        try:
            gen = Generator(
                self.model,
                batch_size=self.spec.engine.batch_size,
                prefill_chunk=self.spec.engine.prefill_chunk,
            )
            for g in gen.generate(requests):
                row, plan = by_key.pop(g.request.id)
                self._write([self._row(row, plan, g, None, started)])
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            self.echo(f"error in a pooled batch: {reason}\n{traceback.format_exc()}")
            self._write([self._error_row(r, plan, reason) for r, plan in by_key.values()])

    # -- rows ----------------------------------------------------------------------------------
    def _request(self, row: Row, prompt: tuple[int, ...]) -> Request:
        return Request(row.key, tuple(prompt), row.params, row.max_tokens, self.stop)

    def _row(self, row: Row, plan: DocPlan, g: Generation, prefix: Prefix | None, started):
        reasoning, answer = split_thinking(self.tok.decode(g.tokens, skip_special=True))
        doc_tokens = plan.doc_tokens if plan.prefix is not None else None
        if prefix is None:  # pooled: the row prefilled its whole prompt itself
            prompt_tokens, cached, source, doc_prefill = g.prompt_tokens, 0, "none", g.prefill_s
            rate = g.prompt_tokens / g.prefill_s if g.prefill_s else None
        else:
            prompt_tokens, source = plan.doc_tokens + g.prompt_tokens, prefix.source
            if source == "none":  # prefilled in this run (perhaps from a snapshot)
                cached, doc_prefill = prefix.resumed_from, prefix.prefill_s
                done = plan.doc_tokens - prefix.resumed_from
                rate = done / prefix.prefill_s if prefix.prefill_s else None
            else:
                cached, doc_prefill = plan.doc_tokens, 0.0
                rate = g.prompt_tokens / g.prefill_s if g.prefill_s else None
        return ResultRow(
            **self._identity(row, plan),
            answer=answer,
            reasoning=reasoning if row.think else None,
            finish_reason=g.finish_reason,
            doc_tokens=doc_tokens,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            completion_tokens=g.completion_tokens,
            doc_prefill_s=doc_prefill,
            prefill_tok_s=rate,
            ttft_s=g.ttft_s,
            decode_s=g.decode_s,
            decode_tok_s=g.decode_tok_s,
            batch_size=g.batch_size,
            cache_source=source,
            peak_mem_gb=mx.get_peak_memory() / 2**30,
            started_at=started,
            finished_at=_now(),
        )

    def _error_row(self, row: Row, plan: DocPlan, reason: str) -> ResultRow:
        return ResultRow(
            **self._identity(row, plan),
            status="error",
            finish_reason="error",
            error=reason,
            doc_tokens=plan.doc_tokens or None,
            finished_at=_now(),
        )

    def _identity(self, row: Row, plan: DocPlan) -> dict:
        return {
            "run_id": self.run_id,
            "job_name": self.spec.name,
            "doc_id": plan.doc.doc_id,
            "doc_path": plan.doc.path,
            "doc_sha256": plan.doc.sha256,
            "question_id": row.question_id,
            "question": row.question,
            "custom_id": row.custom_id,
            "request_key": row.key,
            "model": self.spec.model,
            "model_sha": self.model_sha,
            "quant_bits": self.quant_bits,
        }

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


def _run_id(spec: JobSpec) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{hashlib.sha256(spec_json(spec).encode()).hexdigest()[:8]}"


def _now() -> datetime:
    return datetime.now(timezone.utc)
