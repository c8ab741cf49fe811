"""What a row's logprobs and grammar cost the decode loop: builtin:tiny, float32, 8 rows of 64
tokens sampled together (temperature 1), plain, with logprobs=5, and under a regular expression
of 400 lowercase characters (which 64 tokens cannot complete: every row decodes all 64), 5 rounds
alternating, medians.

    .venv/bin/python benchmarks/decode-options.py

On the CPU a tiny model's step is ~2 ms, so this is the worst case for per-step overhead: the
logprobs' logsumexp and top-20, the grammar's host mask and its unpipelined step. A 9B's step
is tens of ms; time it there on a GPU before reading these ratios as the 9B's.
"""

import statistics
import tempfile
import time

from salabatch.engine import activate_blas

activate_blas()

from salabatch.engine.generate import Generator, Request  # noqa: E402
from salabatch.engine.load import load_model  # noqa: E402
from salabatch.engine.memory import cache_limit  # noqa: E402
from salabatch.engine.runtime import engine_runtime  # noqa: E402
from salabatch.engine.sampling import SamplingParams  # noqa: E402
from salabatch.engine.tokenizer import load_tokenizer  # noqa: E402
from salabatch.models import resolve_model  # noqa: E402

ROWS, TOKENS, ROUNDS = 8, 64, 5


def main() -> None:
    path = resolve_model("builtin:tiny", tempfile.mkdtemp())
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    question = [{"role": "user", "content": "Who is the provider of the agreement?"}]
    prompt = tuple(tok.chat_prompt_ids(question, think=False))
    lowercase = tok.grammars.regex("[a-z ]{400}")

    def tok_s(kind: str) -> float:
        reqs = [
            Request(
                f"r{i}",
                prompt,
                SamplingParams(temperature=1.0, seed=i),
                TOKENS,
                frozenset(),
                logprobs=5 if kind == "logprobs" else None,
                grammar=lowercase if kind == "grammar" else None,
            )
            for i in range(ROWS)
        ]
        start = time.perf_counter()
        out = list(Generator(model, batch_size=ROWS).generate(reqs))
        return sum(len(g.tokens) for g in out) / (time.perf_counter() - start)

    kinds = ("plain", "logprobs", "grammar")
    with engine_runtime(cache_limit(model.config, 2048, False)):
        for kind in kinds:  # warm-up
            tok_s(kind)
        runs = {kind: [] for kind in kinds}
        for _ in range(ROUNDS):
            for kind in kinds:
                runs[kind].append(tok_s(kind))
    plain = statistics.median(runs["plain"])
    for kind, values in runs.items():
        median = statistics.median(values)
        shown = [round(v) for v in values]
        print(f"{kind:9s} {median:7.0f} tok/s  {median / plain:.2f}× plain  {shown}")


if __name__ == "__main__":
    main()
