"""What the prefix store buys: N questions over one long document on builtin:random (an
untrained test model), answered three ways, side by side in one run:

* per_question: every question prefills document + question from scratch (no reuse);
* stored: the document is prefilled once into the store, the questions decode as one batch;
* second_run: a new run over the same store: the document comes from disk, no prefill.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from salabatch.api import load
from salabatch.engine.generate import Generator, Request
from salabatch.engine.kernels.attention import on_gpu
from salabatch.engine.memory import cache_limit
from salabatch.engine.runtime import engine_runtime
from salabatch.jobs.store.document_cache import DocumentCaches
from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore


def run(doc_tokens: int, questions: int, max_tokens: int) -> dict:
    model, tok = load("builtin:random")
    rng = np.random.default_rng(0)
    doc = rng.integers(3, tok.vocab_size - 8, size=doc_tokens).tolist()
    asks = [tuple(rng.integers(3, 500, size=12 + 3 * i).tolist()) for i in range(questions)]
    requests = [Request(f"q{i}", q, max_tokens=max_tokens) for i, q in enumerate(asks)]
    key = PrefixKey.of("builtin:random", "bench", tok.fingerprint, "float32", doc)
    limit = cache_limit(model.config, 2048, on_gpu())
    with engine_runtime(limit), tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        for r in requests:  # no reuse: each question pays the whole document
            whole = Request(r.id, (*doc, *r.prompt), r.params, max_tokens)
            list(Generator(model, batch_size=1).generate([whole]))
        per_question = time.perf_counter() - start

        def with_store() -> tuple[float, str, float]:
            t0 = time.perf_counter()
            prefix = DocumentCaches(model, PrefixStore(root)).get(key, doc)
            done = list(Generator(model, batch_size=questions).generate(requests, prefix.cache))
            assert len(done) == questions
            return time.perf_counter() - t0, prefix.source, prefix.prefill_s

        stored, first_source, first_prefill = with_store()
        second, second_source, second_prefill = with_store()
    return {
        "doc_tokens": doc_tokens,
        "questions": questions,
        "max_tokens": max_tokens,
        "per_question_s": round(per_question, 2),
        "stored_s": round(stored, 2),
        "stored_doc_prefill_s": round(first_prefill, 2),
        "second_run_s": round(second, 2),
        "second_run_doc_source": second_source,
        "second_run_doc_prefill_s": round(second_prefill, 2),
        "speedup_stored_vs_per_question": round(per_question / stored, 2),
        "speedup_second_run_vs_per_question": round(per_question / second, 2),
        "first_run_doc_source": first_source,
    }
