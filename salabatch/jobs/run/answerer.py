"""What turns plans into result rows with one loaded model (`Answerer`), and what every row of
a run says about where it comes from (`RunIdentity`). The local runner writes the rows as they
come; a Ray worker collects a unit's.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import mlx.core as mx

from salabatch import openai_api
from salabatch.engine import memory
from salabatch.engine.cache import ModelCache
from salabatch.engine.chat import ThinkingTokens, split_thinking
from salabatch.engine.choose import choice_scores, pick, probabilities, spelled_choices
from salabatch.engine.config import ModelConfig
from salabatch.engine.detokenizer import CONTEXT_TOKENS, StreamingDetokenizer
from salabatch.engine.generate import Generation, Generator, Request, prefill
from salabatch.engine.model import Model
from salabatch.engine.sampling import TokenLogprob
from salabatch.engine.speculative import Speculation
from salabatch.errors import GenerationError, OutputError, error_text
from salabatch.jobs.results.schema import TEXT_ROWS, ResultRow
from salabatch.jobs.run.plan import POOL_FACTOR, DocPlan, Row
from salabatch.jobs.run.prepare import JobSetup
from salabatch.jobs.run.progress import Progress
from salabatch.jobs.spec.models import JobSpec, spec_fingerprint
from salabatch.jobs.store.document_cache import DocumentCaches, Prefix
from salabatch.jobs.store.prefix_store import PrefixKey


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
        progress: Progress | None,
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
        drafts = spec.engine.speculative
        self.speculation = Speculation(drafts.draft, drafts.tokens, drafts.layers)

    def answer(self, plans: Iterable[DocPlan]) -> Iterator[list[ResultRow]]:
        """The rows of `plans` as they finish: one finished row at a time, or the error rows of
        a document together. Pooled rows wait for a full pool, or for the last plan."""
        pool: list[tuple[Row, DocPlan]] = []
        for plan in plans:
            for note in plan.notes:  # a truncated document
                self.echo(f"note: {plan_name(plan)}: {note}")
            if not plan.error:
                yield from self._compile(plan)
                if not plan.rows:
                    continue
            if plan.error:
                self.echo(f"error in {plan_name(plan)}: {plan.error}")
                yield [self._error_row(r, plan, plan.error) for r in plan.rows]
            elif self.setup.is_pooled(plan):
                pool += [(r, plan) for r in plan.rows]
                if len(pool) >= POOL_FACTOR * self.spec.engine.batch_size:
                    yield from self._pool(pool)
                    pool = []
            else:
                yield from self._document(plan)
        yield from self._pool(pool)

    def _compile(self, plan: DocPlan) -> Iterator[list[ResultRow]]:
        """Error rows of the plan's rows whose pattern (response_format) cannot be compiled
        against the vocabulary, which leave it; the others' are compiled (the tokenizer's
        `grammars` keep them)."""
        failed = {}
        for r in plan.rows:
            if r.grammar is not None:
                try:
                    self.tok.grammars.regex(r.grammar)
                except GenerationError as e:
                    failed[r.key] = self._report(e, f"request {r.custom_id}")
        if failed:
            yield [self._error_row(r, plan, failed[r.key]) for r in plan.rows if r.key in failed]
            plan.rows = [r for r in plan.rows if r.key not in failed]

    # -- a long document: prefix once, questions together ------------------------------------
    def _document(self, plan: DocPlan) -> Iterator[list[ResultRow]]:
        started = _Start()
        mx.reset_peak_memory()
        key = self.setup.prefix_key(plan)
        rows = {r.key: r for r in plan.rows}
        self.caches.keep_only(key)  # the check must see the previous document's memory free
        try:
            needs = self.memory_plan(plan)
            memory.check(needs)
            with memory.bounded(needs):
                yield from self._answer_document(plan, key, rows, started)
        except OutputError:
            raise  # the results cannot be written: nothing more can be saved
        except Exception as e:  # one document's failure must not end an overnight run
            reason = self._report(e, f"document {plan.doc.doc_id}")
            yield [self._error_row(r, plan, reason) for r in rows.values()]

    def _answer_document(
        self, plan: DocPlan, key: PrefixKey, rows: dict[str, Row], started: _Start
    ) -> Iterator[list[ResultRow]]:
        """The rows of `plan`, answered from its document's prefix (taken from the store, or
        prefilled); each answered row leaves `rows`."""
        with self._tokens(f"prefill {plan.doc.doc_id}", len(plan.doc_prompt)) as advance:
            seen = 0

            def prefilled(done: int, _total: int) -> None:
                nonlocal seen
                advance(done - seen)
                seen = done

            prefix = self.caches.get(key, plan.doc_prompt, prefilled)
        # a choices question's rows: their choices scored over the prefix together, no decoding
        spelled = {r.key: ids for r in plan.rows if (ids := self._spelled(r)) is not None}
        chosen = [r for r in plan.rows if r.key in spelled]
        if chosen:
            start = time.perf_counter()
            asks = [(r.prompt, spelled[r.key]) for r in chosen]
            top = max(r.logprobs or 0 for r in chosen)
            engine = self.spec.engine
            scores = choice_scores(
                self.model, prefix.cache, asks, top, engine.batch_size, engine.prefill_chunk
            )
            seconds = (time.perf_counter() - start) / len(chosen)
            for r, s in zip(chosen, scores, strict=True):
                seen = _row_prefix(prefix, r, plan)
                row = self._finished(
                    self._chosen, r, plan, s, len(r.prompt), seconds, seen, started
                )
                rows.pop(r.key)
                yield [row]
        # one tuple for all the rows: the lookup drafter searches the document
        context = tuple(plan.doc_prompt)
        requests = [self._request(r, r.prompt, context) for r in plan.rows if r.key not in spelled]
        for g in self._decode(requests, prefix.cache, f"decode {plan.doc.doc_id}"):
            r = rows[g.request.id]
            row = self._finished(self._row, r, plan, g, _row_prefix(prefix, r, plan), started)
            rows.pop(r.key)
            yield [row]

    def memory_plan(self, plan: DocPlan) -> memory.MemoryPlan:
        """What answering `plan` from its document's prefix holds at its peak."""
        return memory.model_plan(
            self.model,
            doc_tokens=len(plan.doc_prompt),
            rows=[len(r.prompt) + r.max_tokens for r in plan.rows],
            chunk=self.spec.engine.prefill_chunk,
            batch_size=self.spec.engine.batch_size,
        )

    # -- short documents and requests: whole prompts, batched across documents ---------------
    def _pool(self, pool: list[tuple[Row, DocPlan]]) -> Iterator[list[ResultRow]]:
        if not pool:
            return
        started = _Start()
        mx.reset_peak_memory()
        by_key = {r.key: (r, plan) for r, plan in pool}
        spelled = {r.key: ids for r, _ in pool if (ids := self._spelled(r)) is not None}
        # no context: each prompt holds its document, and the drafter searches the prompt
        requests = [
            self._request(r, (*(plan.doc_prompt or ()), *r.prompt))
            for r, plan in pool
            if r.key not in spelled
        ]
        self.caches.keep_only(None)  # a pool's plan counts no document's prefix
        try:
            needs = self.pool_memory_plan(pool)
            memory.check(needs)
            with memory.bounded(needs):
                for key in spelled:
                    r, plan = by_key[key]
                    row = self._finished(self._chosen_pooled, r, plan, spelled[key], started)
                    by_key.pop(key)
                    yield [row]
                for g in self._decode(requests, None, f"decode {len(requests)} pooled rows"):
                    r, plan = by_key[g.request.id]
                    row = self._finished(self._row, r, plan, g, None, started)
                    by_key.pop(r.key)
                    yield [row]
        except OutputError:
            raise
        except Exception as e:
            reason = self._report(e, "a pooled batch")
            yield [self._error_row(r, plan, reason) for r, plan in by_key.values()]

    def pool_memory_plan(self, pool: list[tuple[Row, DocPlan]]) -> memory.MemoryPlan:
        """What a pooled batch holds at its peak (no shared prefix: each row its whole
        prompt, its document too)."""
        return memory.model_plan(
            self.model,
            doc_tokens=0,
            rows=[len(plan.doc_prompt or ()) + len(r.prompt) + r.max_tokens for r, plan in pool],
            chunk=self.spec.engine.prefill_chunk,
            batch_size=self.spec.engine.batch_size,
        )

    def _decode(
        self, requests: list[Request], prefix: ModelCache | None, what: str
    ) -> Iterator[Generation]:
        """Each request's finished Generation, decoded from `prefix` (or its whole prompt),
        counted on a bar of tokens: each token as it comes, a row's unused budget as it ends."""
        with self._tokens(what, sum(r.max_tokens for r in requests)) as advance:
            generator = Generator(
                self.model,
                batch_size=self.spec.engine.batch_size,
                prefill_chunk=self.spec.engine.prefill_chunk,
                on_token=lambda request, token: advance(1),
                detokenizer=self._detokenizer,
                speculation=self.speculation,
            )
            for g in generator.generate(requests, prefix):
                advance(max(0, g.request.max_tokens - len(g.tokens)))
                yield g

    def _tokens(self, what: str, total: int) -> AbstractContextManager[Callable[[int], None]]:
        return self.progress.tokens(what, total) if self.progress else nullcontext(_ignore)

    def _report(self, e: Exception, where: str) -> str:
        """Says in one line (with the traceback under --debug) that `where` failed; returns the
        reason its error rows carry."""
        reason = f"{type(e).__name__}: {error_text(e)}"
        trace = f"\n{traceback.format_exc().rstrip()}" if self.debug else ""
        self.echo(f"error in {where}: {reason}{trace}")
        return reason

    # -- rows ----------------------------------------------------------------------------------
    def _request(self, row: Row, prompt: tuple[int, ...], context: tuple[int, ...] = ()) -> Request:
        # a text completion's answer continues its prompt's text (a chat answer's stands alone)
        text = row.question_id == TEXT_ROWS
        after = (*context[-CONTEXT_TOKENS:], *prompt)[-CONTEXT_TOKENS:] if text else ()
        return Request(
            row.key,
            tuple(prompt),
            row.params,
            row.max_tokens,
            self.stop,
            row.stop_strings,
            context=context,
            after=after,
            logprobs=row.logprobs,
            grammar=None if row.grammar is None else self.tok.grammars.regex(row.grammar),
        )

    def _spelled(self, row: Row) -> list[list[int]] | None:
        """A choices question's choices as the answer's tokens, each with the answer's end
        token, where the row is chosen by likelihood: not thinking (its reasoning comes
        first), and every choice spelled alone (`choice_ids`); else None (decoded under its
        grammar, as any pattern)."""
        if row.choices is None or row.think:
            return None
        try:
            return spelled_choices(self.tok, row.choices)
        except GenerationError:
            return None

    def _chosen_pooled(
        self, row: Row, plan: DocPlan, spelled: list[list[int]], started: _Start
    ) -> ResultRow:
        """A pooled choices row: its whole prompt but the last token prefilled, its choices
        scored after that token."""
        start = time.perf_counter()
        prompt = [*(plan.doc_prompt or ()), *row.prompt]
        base = self.model.make_cache()
        prefill(self.model, prompt[:-1], base, self.spec.engine.prefill_chunk)
        (scores,) = choice_scores(
            self.model, base, [(prompt[-1:], spelled)], row.logprobs or 0,
            self.spec.engine.batch_size, self.spec.engine.prefill_chunk,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        return self._chosen(row, plan, scores, len(prompt), seconds, None, started)

    def _chosen(
        self,
        row: Row,
        plan: DocPlan,
        scores: list[list[TokenLogprob]],
        prompt_tokens: int,
        prefill_s: float,
        prefix: Prefix | None,
        started: _Start,
    ) -> ResultRow:
        """A choices row's result from its choices' scores (`choice_scores`): the answer the
        likeliest (or one drawn by their probabilities, at a temperature), its logprobs those
        of its tokens (with the row's alternatives). `prompt_tokens`, `prefill_s`: the row's
        own (its whole prompt's when pooled)."""
        totals = [sum(x.logprob for x in s) for s in scores]
        i = pick(totals, row.params.temperature, row.params.seed)
        own = scores[i][:-1]  # the chosen answer's tokens, less its end token
        top = row.logprobs or 0
        chances = probabilities(totals)
        return ResultRow(
            **self.identity.columns(row),
            answer=row.choices[i],
            finish_reason="stop",
            logprobs=None
            if row.logprobs is None
            else [openai_api.logprob_entry(self.tok, replace(lp, top=lp.top[:top])) for lp in own],
            choice_logprobs=[
                {"choice": c, "logprob": v, "probability": p}
                for c, v, p in zip(row.choices, totals, chances, strict=True)
            ],
            **_prefill_columns(plan, prompt_tokens, prefill_s, prefix),
            completion_tokens=len(own),
            ttft_s=time.perf_counter() - started.clock,
            decode_s=0.0,
            batch_size=len(scores),
            draft_tokens=0,
            accepted_tokens=0,
            peak_mem_gb=mx.get_peak_memory() / 2**30,
            started_at=started.at,
            finished_at=_now(),
        )

    def _detokenizer(self, after: Sequence[int] = ()) -> StreamingDetokenizer:
        """The decoder the Generator follows a row's text with (rows with stop strings only)."""
        return self.tok.detokenizer(skip_special=True, after=after)

    def _decoded(self, g: Generation, think: bool) -> tuple[str, int | None]:
        """Row g's answer text, as the server streams it (what its tokens add to its prompt's
        text, for a text completion; the Generator's where a stop string cut it), and for a
        row that thought, the tokens of its think block as the server counts them: one
        streaming decode gives both."""
        detok = self._detokenizer(g.request.after)
        thought = ThinkingTokens() if think else None
        if g.text is None or thought is not None:
            for token in g.tokens:
                detok.add_token(token)
                if thought is not None:
                    thought.add(detok.text)
            detok.finalize()
        text = g.text if g.text is not None else detok.text
        return text, None if thought is None else thought.count

    def _row(
        self, row: Row, plan: DocPlan, g: Generation, prefix: Prefix | None, started: _Start
    ) -> ResultRow:
        text, reasoning_tokens = self._decoded(g, row.think)
        # a text completion's answer is the text as generated; a chat answer's <think> block
        # is its reasoning (an answer held to a pattern keeps its own spaces: they are its text)
        if row.question_id == TEXT_ROWS:
            reasoning, answer = None, text
        else:
            reasoning, answer = split_thinking(text, strip=row.grammar is None)
        return ResultRow(
            **self.identity.columns(row),
            answer=answer,
            reasoning=reasoning if row.think else None,
            finish_reason=g.finish_reason,
            logprobs=None
            if row.logprobs is None
            else [openai_api.logprob_entry(self.tok, lp) for lp in g.logprobs],
            **_prefill_columns(plan, g.prompt_tokens, g.prefill_s, prefix),
            completion_tokens=g.completion_tokens,
            reasoning_tokens=reasoning_tokens,
            # from the start of its document's prefix (or pool), waiting for a slot included
            ttft_s=max(0.0, g.first_token_at - started.clock) if g.first_token_at else g.ttft_s,
            decode_s=g.decode_s,
            decode_tok_s=g.decode_tok_s,
            batch_size=g.batch_size,
            draft_tokens=g.draft_tokens,
            accepted_tokens=g.accepted_tokens,
            peak_mem_gb=mx.get_peak_memory() / 2**30,
            started_at=started.at,
            finished_at=_now(),
        )

    def _finished(
        self, build: Callable[..., ResultRow], row: Row, plan: DocPlan, *more: Any
    ) -> ResultRow:
        """`build(row, plan, *more)`: the result row of an answer, or, where that fails (an
        answer the tokenizer cannot decode), the row's own error row: the rows of its batch are
        not lost with it, and the others are made as they come."""
        try:
            return build(row, plan, *more)
        except OutputError:
            raise
        except Exception as e:
            return self._error_row(row, plan, self._report(e, f"row {row.custom_id}"))

    def _error_row(self, row: Row, plan: DocPlan, reason: str) -> ResultRow:
        return self.identity.error_row(row, reason, plan.doc_tokens or None)


@dataclass(frozen=True)
class _Start:
    """When the work for some rows began: for `started_at`, and on the clock `ttft_s` is
    read from (`Generation.first_token_at`)."""

    at: datetime = field(default_factory=lambda: _now())
    clock: float = field(default_factory=time.perf_counter)


def _ignore(n: int) -> None:
    """No bar to advance."""


def plan_name(plan: DocPlan) -> str:
    """A plan as a report names it: its document, or its request line."""
    row = plan.rows[0] if plan.rows else None
    if row is not None and row.request_line is not None:
        return f"request {row.custom_id}"
    return f"document {plan.doc.doc_id}"


def _row_prefix(prefix: Prefix, row: Row, plan: DocPlan) -> Prefix:
    """The prefix as `row` saw it. Request lines sharing a prefix (automatic prefix caching)
    are separate requests: the first line prefilled it, the others found it in memory. A
    document's questions all show where the document came from."""
    if row.request_line is None or prefix.source != "none" or row is plan.rows[0]:
        return prefix
    return Prefix(prefix.cache, "memory")


def _prefill_columns(
    plan: DocPlan, prompt_tokens: int, prefill_s: float, prefix: Prefix | None
) -> dict[str, Any]:
    """A finished row's prompt columns: doc_tokens, prompt_tokens, cached_tokens, cache_source,
    doc_prefill_s and prefill_tok_s (of the document when this run prefilled it, else of the
    row's own tokens). `prompt_tokens` and `prefill_s`: the row's own (its whole prompt's when
    pooled, without a prefix)."""
    if prefix is None:  # pooled: the row prefilled its whole prompt itself
        return {
            "doc_tokens": plan.doc_tokens if plan.doc_prompt is not None else None,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": 0,
            "cache_source": "none",
            "doc_prefill_s": prefill_s,
            "prefill_tok_s": prompt_tokens / prefill_s if prefill_s else None,
        }
    columns = {
        "doc_tokens": plan.doc_tokens,
        "prompt_tokens": plan.doc_tokens + prompt_tokens,
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
        "prefill_tok_s": prompt_tokens / prefill_s if prefill_s else None,
    }


def _run_id(spec: JobSpec) -> str:
    # to the microsecond: runs of one results file take its lock in turn, so no two share an id
    # (a retry series is named by its runs' ids, see ResultWriter)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{stamp}-{spec_fingerprint(spec)[:8]}"


def _now() -> datetime:
    return datetime.now(timezone.utc)
