"""lm-eval-harness's loglikelihood over a long context, through the serving engine: builtin:tiny,
float32, a 16,384-token context (the demo documents' text, repeated) and 4 choices, each a job
scoring context + choice with its most likely alternative (`echo` with `logprobs: 1`,
`max_tokens: 0`, as `/v1/completions` makes it: `text_job`, its boundary QUESTION_TAIL tokens
before its end). Timed: the 4 jobs as the server gets them (the first prefills the context, the
others resume from its snapshot held with its scores) against the same jobs without that
boundary (each prefills and scores its whole prompt, as before session 66); 3 rounds
alternating, each on a fresh engine, medians.

    .venv/bin/python benchmarks/loglikelihood.py
"""

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from salabatch.engine import activate_blas

activate_blas()

from salabatch.engine.load import load_model  # noqa: E402
from salabatch.engine.sampling import SamplingParams  # noqa: E402
from salabatch.engine.tokenizer import load_tokenizer  # noqa: E402
from salabatch.models import resolve_model  # noqa: E402
from salabatch.serve.completion import text_job  # noqa: E402
from salabatch.serve.engine import Finished, ServeEngine  # noqa: E402

TOKENS, CHUNK, ROUNDS = 16384, 2048, 3
CHOICES = (" Acme Corp", " Bolt Ltd", " the Client", " nobody")
DOCS = Path(__file__).resolve().parent.parent / "jobs" / "demo" / "docs"


def main() -> None:
    path = resolve_model("builtin:tiny", tempfile.mkdtemp())
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.txt")))
    ids = tok.encode(text, add_bos=True)
    context = (ids * (TOKENS // len(ids) + 1))[:TOKENS] + tok.encode("\nThe Provider is")
    prompts = [context + tok.encode(c) for c in CHOICES]

    def seconds(tail: bool) -> tuple[float, int]:
        jobs = []
        for p in prompts:
            job = text_job(tok, p, params=SamplingParams(), max_tokens=0)
            jobs.append(replace(job, prompt_logprobs=1, boundaries=job.boundaries if tail else ()))
        with ServeEngine(model, tok, batch_size=4, prefill_chunk=CHUNK) as engine:
            start = time.perf_counter()
            tickets = [engine.submit(j) for j in jobs]
            ends = [list(t)[-1] for t in tickets]
            took = time.perf_counter() - start
        assert all(isinstance(e, Finished) for e in ends), ends
        return took, sum(e.cached_tokens for e in ends)

    seconds(True)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    cached = {}
    for _ in range(ROUNDS):
        for tail in (False, True):
            took, cached[tail] = seconds(tail)
            times[tail].append(took)
    whole, resumed = statistics.median(times[False]), statistics.median(times[True])
    n = sum(len(p) for p in prompts)
    print(f"{len(prompts)} choices over a {len(context):,}-token context ({n:,} tokens scored)")
    print(f"each scored whole     {whole:6.2f} s  (cached tokens {cached[False]:,})")
    print(f"resumed at the tail   {resumed:6.2f} s  (cached tokens {cached[True]:,})")
    print(f"speed-up              {whole / resumed:6.2f}x")


if __name__ == "__main__":
    main()
