"""Prompts that share a long context, through the serving engine: builtin:tiny, float32, a
16,384-token context (the demo documents' text, repeated), 2,048-token chunks, the jobs of each
case submitted together to a fresh `ServeEngine` (batch 4); 3 rounds alternating, medians.

- choices: lm-eval-harness's loglikelihood, 4 choices after the context, each a job scoring
  context + choice with its most likely alternative (`echo` with `logprobs: 1`, `max_tokens: 0`,
  as `/v1/completions` makes it: `text_job`, its boundary QUESTION_TAIL tokens before its end).
  The first prefills the context and the others resume from its snapshot, held with its scores;
  against the same jobs without that boundary nor `SeenPrompts` (each prefills and scores its
  whole prompt, as every scoring job did before session 66).
- questions: 6 questions of 300-550 tokens after the context, no boundary marking it off (a
  document in the user message, or a completions prompt): from the third on they resume where
  the second snapshotted, where its prompt starts as the first's did (`SeenPrompts`); against
  the engine without it (`SeenPrompts(most=0)` remembers nothing).

    .venv/bin/python benchmarks/shared-context.py
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
from salabatch.serve.prefixes import SeenPrompts  # noqa: E402

TOKENS, CHUNK, ROUNDS = 16384, 2048, 3
CHOICES = (" Acme Corp", " Bolt Ltd", " the Client", " nobody")
DOCS = Path(__file__).resolve().parent.parent / "jobs" / "demo" / "docs"


def main() -> None:
    path = resolve_model("builtin:tiny", tempfile.mkdtemp())
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.txt")))
    ids = tok.encode(text, add_bos=True)
    context = (ids * (TOKENS // len(ids) + 1))[:TOKENS]
    greedy = SamplingParams()

    def choices(new: bool):
        jobs = []
        for c in CHOICES:
            job = text_job(
                tok, context + tok.encode("\nThe Provider is" + c), params=greedy, max_tokens=0
            )
            jobs.append(replace(job, prompt_logprobs=1, boundaries=job.boundaries if new else ()))
        return jobs, None if new else SeenPrompts(most=0)

    def questions(new: bool):
        jobs = []
        for i in range(6):
            question = ids[100 * i : 100 * i + 300 + 50 * i]  # demo text as a long question
            job = text_job(tok, context + question, params=greedy, max_tokens=8)
            jobs.append(job)
        return jobs, None if new else SeenPrompts(most=0)

    def seconds(case, new: bool) -> tuple[float, int]:
        jobs, seen = case(new)
        with ServeEngine(model, tok, batch_size=4, prefill_chunk=CHUNK) as engine:
            if seen is not None:
                engine._seen = seen  # the engine as it was before
            start = time.perf_counter()
            tickets = [engine.submit(j) for j in jobs]
            ends = [list(t)[-1] for t in tickets]
            took = time.perf_counter() - start
        assert all(isinstance(e, Finished) for e in ends), ends
        return took, sum(e.cached_tokens for e in ends)

    for name, case in (("choices", choices), ("questions", questions)):
        seconds(case, True)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        cached = {}
        for _ in range(ROUNDS):
            for new in (False, True):
                took, cached[new] = seconds(case, new)
                times[new].append(took)
        before, now = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"{name}: before {before:6.2f} s (cached tokens {cached[False]:,}), "
            f"now {now:6.2f} s (cached tokens {cached[True]:,}): {before / now:.2f}x"
        )


if __name__ == "__main__":
    main()
