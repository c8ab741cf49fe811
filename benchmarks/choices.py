"""What a choices question costs: scored (`engine.choose`, how `salabatch run` answers one) or
decoded under its pattern (how the server's `guided_choice` and the API's `choices=` do).
builtin:tiny, float32, the longest demo document (~6K tokens) prefilled once, 8 questions each
with the choices "yes", "no", "not stated": scoring the 24 choices 8 rows to a call (what
`salabatch run` does with batch_size 8) against one batch of 8 decoding under the pattern
(greedy), 5 rounds alternating, medians. Both begin from the same prefilled prefix; its prefill
is not timed.

    .venv/bin/python benchmarks/choices.py
"""

import statistics
import tempfile
import time
from pathlib import Path

from salabatch.engine import activate_blas

activate_blas()

from salabatch.engine.choose import choice_scores, spelled_choices  # noqa: E402
from salabatch.engine.generate import Generator, Request, prefill  # noqa: E402
from salabatch.engine.load import load_model  # noqa: E402
from salabatch.engine.memory import cache_limit  # noqa: E402
from salabatch.engine.runtime import engine_runtime  # noqa: E402
from salabatch.engine.tokenizer import load_tokenizer  # noqa: E402
from salabatch.models import resolve_model  # noqa: E402
from salabatch.structure import choice_pattern  # noqa: E402

ROUNDS = 5
ROWS = 8  # choices to a call: what `salabatch run` scores at batch_size 8
CHOICES = ["yes", "no", "not stated"]
QUESTIONS = [
    "Does the agreement renew automatically?",
    "Is there a late fee?",
    "Is the fee paid monthly?",
    "Can either party end it early?",
    "Is the law of Ireland the governing law?",
    "Is there a confidentiality clause?",
    "Does the provider give a warranty?",
    "Is the client the buyer?",
]
DOC = Path(__file__).resolve().parent.parent / "jobs" / "demo" / "docs" / "rivercrest-labs-long.txt"


def main() -> None:
    path = resolve_model("builtin:tiny", tempfile.mkdtemp())
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    doc_prompt = tok.document_prompt(DOC.read_text(), system=None, think=False)
    suffixes = [tok.prompt_suffix(q, system=None, think=False) for q in QUESTIONS]
    grammar = tok.grammars.regex(choice_pattern(CHOICES))
    spelled = spelled_choices(tok, CHOICES)
    stop = frozenset(tok.eos_ids)
    with engine_runtime(cache_limit(model.config, 2048, False)):
        prefix = model.make_cache()
        prefill(model, doc_prompt, prefix, 2048)

        def scored() -> float:
            start = time.perf_counter()
            choice_scores(model, prefix, [(s, spelled) for s in suffixes], rows=ROWS)
            return time.perf_counter() - start

        def decoded() -> float:
            requests = [
                Request(str(i), tuple(s), max_tokens=8, stop=stop, grammar=grammar)
                for i, s in enumerate(suffixes)
            ]
            start = time.perf_counter()
            list(Generator(model, batch_size=8).generate(requests, prefix))
            return time.perf_counter() - start

        scored(), decoded()  # warm-up
        times = {"scored": [], "decoded": []}
        for _ in range(ROUNDS):
            times["scored"].append(scored())
            times["decoded"].append(decoded())
    s, d = (statistics.median(times[k]) for k in ("scored", "decoded"))
    print(f"prefix {len(doc_prompt)} tokens, {len(QUESTIONS)} rows of {len(CHOICES)} choices")
    print(f"scored  {s * 1000:7.1f} ms  ({len(QUESTIONS) / s:6.1f} rows/s)")
    rate = len(QUESTIONS) / d
    print(f"decoded {d * 1000:7.1f} ms  ({rate:6.1f} rows/s): scoring {d / s:.2f}x as fast")


if __name__ == "__main__":
    main()
