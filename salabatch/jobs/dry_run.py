"""`salabatch run --dry-run`: what a run would do, without loading the model weights.

Reads and tokenizes the documents, and says per document how many tokens its prompt has, how
many rows are still to do, and whether its prefix cache is already stored.
"""

from __future__ import annotations

from collections.abc import Callable

from salabatch.engine import builtin
from salabatch.engine.config import ModelConfig
from salabatch.engine.fingerprint import model_fingerprint
from salabatch.engine.runtime import resolve_dtype
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.errors import OutputError
from salabatch.jobs.openai_batch import plan_requests
from salabatch.jobs.output_read import read_results
from salabatch.jobs.plan import Planner, pooled
from salabatch.jobs.prefix_store import PrefixKey, PrefixStore
from salabatch.jobs.spec import JobSpec


def dry_run(spec: JobSpec, *, resume: bool = True, echo: Callable[[str], None] = print) -> None:
    path = builtin.resolve(spec.model, spec.cache.dir)
    ModelConfig.from_file(path)  # the config is checked; no weights are read into memory
    tok = load_tokenizer(path)
    dtype = str(resolve_dtype(spec.engine.dtype)).removeprefix("mlx.core.")
    model_sha = model_fingerprint(path, memo=spec.cache.dir / "fingerprints.json")
    done: frozenset[str] = frozenset()
    if resume:
        try:  # read only: a dry run must not touch the results
            table = read_results(spec.output.path)
            done = frozenset(table.column("request_key").to_pylist())
        except OutputError:
            pass  # no results yet
    planner = Planner(spec, tok, model_sha, dtype, done)
    store = PrefixStore(spec.cache.dir, spec.cache.max_gb) if spec.cache.enabled else None
    note = f" ({builtin.WARNING})" if builtin.is_builtin(spec.model) else ""
    echo(f"job {spec.name}: model {spec.model}{note}, {dtype}, output {spec.output.path}")
    echo(f"{len(spec.questions)} question(s):")
    for q in spec.questions:
        echo(f"  {q.id}: {q.text}")
    echo("documents:")
    rows = prefill = cached = 0
    for plan in planner.documents():
        rows += len(plan.rows)
        if plan.error:
            echo(f"  {plan.doc.doc_id}: error, {len(plan.rows)} error row(s): {plan.error}")
            continue
        pages = f", {plan.doc.n_pages} pages" if plan.doc.n_pages else ""
        notes = "".join(f", {n}" for n in plan.notes)
        if pooled(plan, spec.engine.prefill_chunk, spec.engine.batch_size):
            state = "short: prefilled with each question, batched across documents"
            prefill += plan.doc_tokens * len(plan.rows)
        else:
            key = PrefixKey.of(spec.model, model_sha, tok.fingerprint, dtype, plan.prefix)
            hit = store is not None and store.has(key)
            cached += plan.doc_tokens if hit else 0
            prefill += 0 if hit else plan.doc_tokens
            state = "prefix stored" if hit else "to prefill once"
        echo(
            f"  {plan.doc.doc_id}: {plan.doc_tokens} tokens{pages}, {len(plan.rows)} row(s), "
            f"{state}{notes}"
        )
    if spec.requests:
        requests = list(plan_requests(spec, tok, planner))
        bad = sum(1 for p in requests if p.error)
        rows += len(requests)
        echo(f"requests {spec.requests}: {len(requests)} to do ({bad} invalid)")
    echo(
        f"plan: {rows} row(s) to do, {planner.skipped} already done; prefill {prefill} document "
        f"tokens, {cached} from stored prefixes"
    )
