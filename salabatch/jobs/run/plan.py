"""The plan of a run: which rows (document × question) to produce, their prompts and keys.

Pure stage, no model weights: documents are read and tokenized, rows already done are dropped,
documents over `max_context` follow `on_overflow`. A row's `key` is the sha256 of everything
that decides its answer (model, tokenizer, dtype, document, question, system prompt, generation
settings, context limits), so a rerun skips exactly the rows it already has.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from salabatch.engine.config import ModelConfig
from salabatch.engine.sampling import SamplingParams
from salabatch.engine.tokenizer import Tokenizer
from salabatch.jobs.ingest.documents import Document, iter_documents
from salabatch.jobs.spec.models import (
    GenerationSettings,
    JobSpec,
    effective_generation,
    generation_key,
)

TRUNCATION_MARK = "\n\n[…]\n\n"


@dataclass(frozen=True)
class Row:
    """One answer to produce."""

    key: str
    doc: Document
    question_id: str
    question: str
    custom_id: str
    params: SamplingParams
    max_tokens: int
    think: bool
    prompt: tuple[int, ...] = ()  # after the document prompt; the whole prompt without one
    stop_strings: tuple[str, ...] = ()  # the answer ends before the first one it contains
    request_line: int | None = None  # its line in the requests file; None for a document's row
    logprobs: int | None = None  # None: none; k: each token's, with k alternatives'
    grammar: str | None = None  # the regular expression the answer must match (response_format)
    choices: tuple[str, ...] | None = None  # a choices question's: chosen by their likelihood


@dataclass
class DocPlan:
    """A document's rows still to do, and its document prompt (None: rows hold whole prompts)."""

    doc: Document
    rows: list[Row]
    doc_prompt: list[int] | None = None
    error: str | None = None  # every row fails with this (unreadable document, overflow)
    notes: list[str] = field(default_factory=list)  # e.g. "truncated to 1000 of 1500 tokens"

    @property
    def doc_tokens(self) -> int:
        return len(self.doc_prompt) if self.doc_prompt else 0

    @property
    def of_requests(self) -> bool:
        """Whether its rows are request lines (one, or a group sharing a prefix), not a
        document's questions."""
        return any(r.request_line is not None for r in self.rows)


POOL_FACTOR = 4  # pooled short rows are decoded once this many batches' worth are waiting


def _no_room(row: Row, need: int, limit: int) -> str:
    """The error of a row whose question and answer leave no room for a document."""
    return (
        f"question {row.question_id} has {len(row.prompt)} tokens with its prompt and room for "
        f"a {row.max_tokens}-token answer: {need} of engine.max_context {limit}, which leaves "
        "no room for the document; raise max_context, or lower max_tokens, the question or "
        "the system prompt"
    )


def _too_long(full: int, limit: int, need: int) -> str:
    """The error of a row the document does not fit beside (on_overflow `error`)."""
    return (
        f"document has {full} tokens with its prompt; engine.max_context {limit} leaves "
        f"{limit - need} after the question and answer ({need}); raise max_context or set "
        "engine.on_overflow to truncate_middle or truncate_end"
    )


def pooled(
    plan: DocPlan, pool_max_tokens: int, batch_size: int, config: ModelConfig | None = None
) -> bool:
    """Rows without a shared prefix (request lines that share none with another), and short
    documents (`engine.pool_max_tokens`) with fewer questions than a batch, whose rows carry
    their whole prompt so they decode in full batches across documents. Also a document
    below dense_len whose rows' prompts reach it (`ModelConfig.splits_modes`): one call over
    a row's whole prompt runs the sparse layers over the document too, a prefix prefilled
    alone runs them dense, so no shared prefix answers those rows as their own prompts
    would (SPEC P7)."""
    if plan.doc_prompt is None:
        return True
    short = plan.doc_tokens <= pool_max_tokens and len(plan.rows) < batch_size
    longest = plan.doc_tokens + max((len(r.prompt) for r in plan.rows), default=0)
    return short or (config is not None and config.splits_modes(plan.doc_tokens, longest))


class Limit:
    """`--limit N`: at most N rows in all, taken from the job's plans (or units) in order; `cut`
    once rows of the job were left out (the rest stays unplanned: nothing is known of it yet)."""

    def __init__(self, rows: int | None) -> None:
        self.left, self.cut = rows, False

    def trim(self, rows: list) -> list | None:
        """The next rows of the job, cut to what is left of the limit; None once it is spent."""
        if self.left is None:
            return rows
        if self.left == 0:
            self.cut = True
            return None
        self.cut = len(rows) > self.left
        rows = rows[: self.left]
        self.left -= len(rows)
        return rows

    def take(self, plans: Iterable[DocPlan]) -> Iterator[DocPlan]:
        """`plans` until the limit is spent, the last one cut to what is left of it."""
        for plan in plans:
            rows = self.trim(plan.rows)
            if rows is None:
                return
            plan.rows = rows
            yield plan


def request_key(**parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def sampling(spec: JobSpec, generation: GenerationSettings) -> SamplingParams:
    return SamplingParams(
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        repetition_penalty=generation.repetition_penalty,
        seed=generation.seed,
    )


class Planner:
    """Turns the job's documents into DocPlans for one model/tokenizer/dtype."""

    def __init__(
        self, spec: JobSpec, tok: Tokenizer, model_sha: str, dtype: str, done: Iterable[str] = ()
    ) -> None:
        self.spec, self.tok, self.done = spec, tok, frozenset(done)
        self.identity = {"model": model_sha, "tokenizer": tok.fingerprint, "dtype": dtype}
        self.skipped = 0  # rows found already done
        self.job_keys: set[str] = set()  # every row's key planned so far, done ones too
        self.request_lines: dict[str, int] = {}  # request line keys -> line, done ones too
        self.custom_ids: set[str] = set()  # every document row's planned so far, done ones too
        self._suffixes: dict[tuple[str, bool], tuple[int, ...]] = {}  # the same for every doc
        self._arounds: dict[bool, int] = {}  # by think, see _around
        self._patterns = {q.id: q.pattern() for q in spec.questions}  # what answers must match

    def documents(self) -> Iterator[DocPlan]:
        for doc in iter_documents(self.spec.sources()):
            yield from self.plan(doc)

    def rows_of(self, doc: Document) -> list[Row]:
        """The document's rows that are not done yet (prompts not filled in)."""
        spec, rows = self.spec, []
        for q in spec.questions:
            gen = effective_generation(spec, q)
            pattern = self._patterns[q.id]
            # parts a key holds only where they are set: the keys of rows without them stay
            extra = {} if pattern is None else {"structure": pattern}
            if doc.read_as:
                extra["read_as"] = doc.read_as
            if q.choices is not None and not gen.think:  # chosen by likelihood, not decoded
                extra["choose"] = "likelihood"
            key = request_key(
                **self.identity,
                doc_id=doc.doc_id,
                doc_sha256=doc.sha256,
                question_id=q.id,
                question=q.text,
                system=spec.system,
                generation=generation_key(spec, q),
                max_context=spec.engine.max_context,
                on_overflow=spec.engine.on_overflow,
                **extra,
            )
            self.job_keys.add(key)
            custom_id = f"{doc.doc_id}/{q.id}"
            self.custom_ids.add(custom_id)
            if key in self.done:
                self.skipped += 1
            else:
                rows.append(
                    Row(
                        key,
                        doc,
                        q.id,
                        q.text,
                        custom_id,
                        sampling(spec, gen),
                        gen.max_tokens,
                        gen.think,
                        logprobs=gen.logprobs,
                        grammar=pattern,
                        choices=None if q.choices is None else tuple(q.choices),
                    )
                )
        return rows

    def plan(self, doc: Document) -> list[DocPlan]:
        """One DocPlan per distinct document prompt (questions that differ in `think` may need
        their own when a chat template depends on it), and one per error the rows of the
        document get; [] when every row is done."""
        rows = self.rows_of(doc)
        if not rows:
            return []
        if not doc.ok:
            return [DocPlan(doc, rows, error=doc.error)]
        plans: dict[tuple, DocPlan] = {}
        for think in sorted({r.think for r in rows}):
            group = [r for r in rows if r.think == think]
            for plan in self._prompts(doc, group, think):
                key = tuple(plan.doc_prompt or ()) if plan.error is None else ("error", plan.error)
                if key in plans:
                    plans[key].rows += plan.rows
                else:
                    plans[key] = plan
        return list(plans.values())

    def _suffix(self, question: str, think: bool) -> tuple[int, ...]:
        """A question's prompt suffix: it does not depend on the document, so it is encoded once."""
        key = (question, think)
        if key not in self._suffixes:
            ids = self.tok.prompt_suffix(question, system=self.spec.system, think=think)
            self._suffixes[key] = tuple(ids)
        return self._suffixes[key]

    def _prompts(self, doc: Document, rows: list[Row], think: bool) -> list[DocPlan]:
        """The plans of a document's rows that share `think`, within engine.max_context: each
        row needs its question's prompt and its answer's room after the document prompt. A
        row that leaves no room for any document fails alone, naming its question; with
        on_overflow `error` the rows the document does not fit beside fail, the others are
        answered; with truncate_* the document is cut to fit beside the one needing the most
        room (one prefix for all)."""
        tok, system = self.tok, self.spec.system
        limit, mode = self.spec.engine.max_context, self.spec.engine.on_overflow
        with_prompts = [replace(r, prompt=self._suffix(r.question, think)) for r in rows]
        doc_prompt = tok.document_prompt(doc.text, system=system, think=think)
        full = len(doc_prompt)
        around = self._around(think)
        plans = []
        fitting = []
        for r in with_prompts:
            need = len(r.prompt) + r.max_tokens
            if limit - need <= around:
                plans.append(DocPlan(doc, [r], error=_no_room(r, need, limit)))
            elif full <= limit - need or mode != "error":
                fitting.append(r)
            else:
                plans.append(DocPlan(doc, [r], error=_too_long(full, limit, need)))
        if not fitting:
            return plans
        room = max(len(r.prompt) + r.max_tokens for r in fitting)
        plan = DocPlan(doc, fitting, doc_prompt)
        if full > limit - room:
            cut = self._truncated(doc, full, limit - room, think)
            if cut is None:
                plan.doc_prompt = None
                plan.error = f"could not truncate the document to {limit - room} tokens"
            else:
                plan.doc_prompt = cut
                plan.notes.append(f"{mode}: document cut from {full} to {len(cut)} tokens")
        return [plan, *plans]

    def _around(self, think: bool) -> int:
        """The document prompt's tokens around the document's own (system prompt, template):
        the same for every document, so counted once."""
        if think not in self._arounds:
            prompt = self.tok.document_prompt(".", system=self.spec.system, think=think)
            self._arounds[think] = len(prompt) - 1
        return self._arounds[think]

    def _truncated(self, doc: Document, full: int, budget: int, think: bool) -> list[int] | None:
        """The document prompt of `doc`'s text (`full` tokens with its prompt) cut (at its end,
        or in its middle with TRUNCATION_MARK, as engine.on_overflow says) to the most
        characters whose prompt fits in `budget` tokens, as near as a few steps find it; None
        if none is found."""
        tok, system, mode = self.tok, self.spec.system, self.spec.engine.on_overflow
        around = self._around(think)
        keep, tokens = len(doc.text), full - around
        for _ in range(16):  # tokens follow characters about evenly: a step or two fits
            keep = min(keep - 1, int(keep * (budget - around) / max(tokens, 1)))
            if keep <= 0:
                return None
            if mode == "truncate_end":
                text = doc.text[:keep]
            else:
                text = (
                    doc.text[: keep // 2] + TRUNCATION_MARK + doc.text[len(doc.text) - keep // 2 :]
                )
            doc_prompt = tok.document_prompt(text, system=system, think=think)
            if len(doc_prompt) <= budget:
                return doc_prompt
            tokens = len(doc_prompt) - around
        return None
        return None
