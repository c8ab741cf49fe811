"""What a run prepares before its model loads, cheap checks first: the results writer (`prepared`)
and the job's `JobSetup` (checkpoint folder, tokenizer, weights digest, dtype, prefix store), with
which it plans its rows and names their prefixes. `--dry-run` shows the plan from a JobSetup
without loading the weights; the local runner and the Ray executor go on to answer it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from salabatch.engine.config import ModelConfig
from salabatch.engine.fingerprint import model_fingerprint
from salabatch.engine.runtime import dtype_name, resolve_dtype
from salabatch.engine.tokenizer import Tokenizer, load_tokenizer
from salabatch.errors import OutputError
from salabatch.jobs.ingest.documents import Document, identify_documents
from salabatch.jobs.results.schema import current_versions
from salabatch.jobs.results.writer import ResultWriter
from salabatch.jobs.run.openai_batch import plan_requests
from salabatch.jobs.run.plan import DocPlan, Planner, pooled
from salabatch.jobs.spec.models import JobSpec, spec_json
from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore
from salabatch.models import model_note, resolve_model

MIN_FREE_BYTES = 64 * 2**20  # refuse to start a run with less room than this for its results


@dataclass(frozen=True)
class Outstanding:
    """The rows of a whole job against its results (`JobSetup.outstanding`)."""

    todo: int  # rows still to do
    done: int  # rows already done
    keys: frozenset[str]  # every row's request_key


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
    config: ModelConfig | None = None  # the model's (config.json; no weights)

    @classmethod
    def of(cls, spec: JobSpec) -> JobSetup:
        """Resolves the model (a builtin one is made on first use); reads no weights into memory."""
        path = resolve_model(spec.model, spec.cache.dir)
        config = ModelConfig.from_file(path)
        return cls(
            spec=spec,
            model_path=path,
            tok=load_tokenizer(path),
            model_sha=model_fingerprint(path, memo=spec.cache.dir / "fingerprints.json"),
            dtype=dtype_name(resolve_dtype(spec.engine.dtype)),
            store=PrefixStore(spec.cache.dir, spec.cache.max_gb) if spec.cache.enabled else None,
            config=config,
        )

    def planner(self, done: Iterable[str]) -> Planner:
        """A planner of the job's rows that skips the request keys `done`."""
        return Planner(self.spec, self.tok, self.model_sha, self.dtype, done)

    def plans(self, planner: Planner) -> Iterator[DocPlan]:
        """The rows still to do: the documents' first, then the request lines'."""
        if not self.spec.requests:
            return planner.documents()
        return chain(planner.documents(), plan_requests(self.spec, self.tok, planner))

    def outstanding(self, done: Iterable[str]) -> Outstanding:
        """The rows of the whole job, `done` the keys in the results, without extracting any
        text: files are hashed (their rows' keys need no more), request lines read. What a run
        cut by --limit leaves, and what it would do."""
        planner = self.planner(done)
        todo = 0
        for found in identify_documents(self.spec.sources()):
            for doc_id, sha256 in found.ids:
                doc = Document(doc_id, str(found.file.path), "", sha256, read_as=found.file.read_as)
                todo += len(planner.rows_of(doc))
        if self.spec.requests:
            todo += sum(len(p.rows) for p in plan_requests(self.spec, self.tok, planner))
        return Outstanding(todo, planner.skipped, frozenset(planner.job_keys))

    def is_pooled(self, plan: DocPlan) -> bool:
        """Whether the rows of `plan` decode in batches across documents, each with its whole
        prompt (see `plan.pooled`), rather than from the document's shared prefix."""
        engine = self.spec.engine
        return pooled(plan, engine.pool_max_tokens, engine.batch_size, self.config)

    def prefix_key(self, plan: DocPlan) -> PrefixKey:
        """Where the prefix of `plan` (its document prompt, prefilled) is stored."""
        return PrefixKey.of(
            self.spec.model,
            self.model_sha,
            self.tok.fingerprint,
            self.dtype,
            plan.doc_prompt,
            document=plan.doc.doc_id,
        )


@contextmanager
def prepared(
    spec: JobSpec,
    *,
    resume: bool,
    retry_errors: bool,
    limited: bool,
    echo: Callable[[str], None],
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
        limited=limited,
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
