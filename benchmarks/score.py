"""What scoring costs a prefill (`Prefill(score=k)`: `salabatch perplexity`, `salabatch.score`,
the server's `echo`): builtin:tiny, float32, a 16,384-token document (the demo documents' text,
repeated) in 2,048-token chunks, prefilled plain, scored (score=0: each token's
log-probability) and scored with its 5 most likely alternatives (score=5); 3 rounds
alternating, medians.

    .venv/bin/python benchmarks/score.py

builtin:tiny's head (128 × 1,024) is a small share of its work, as the 9B's is: there a
position's head is 2 · 4,096 · 73,448 = 0.60 GFLOP against ~17 GFLOP of its layers' weight
products (~3.5 %), before attention; score=k adds a top-k over the vocabulary per position.
"""

import statistics
import tempfile
import time
from pathlib import Path

from salabatch.engine import activate_blas

activate_blas()

from salabatch.engine.generate import Prefill  # noqa: E402
from salabatch.engine.load import load_model  # noqa: E402
from salabatch.engine.memory import cache_limit  # noqa: E402
from salabatch.engine.runtime import engine_runtime  # noqa: E402
from salabatch.engine.tokenizer import load_tokenizer  # noqa: E402
from salabatch.models import resolve_model  # noqa: E402

TOKENS, CHUNK, ROUNDS = 16384, 2048, 3
DOCS = Path(__file__).resolve().parent.parent / "jobs" / "demo" / "docs"


def main() -> None:
    path = resolve_model("builtin:tiny", tempfile.mkdtemp())
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.txt")))
    ids = tok.encode(text, add_bos=True)
    ids = (ids * (TOKENS // len(ids) + 1))[:TOKENS]

    def seconds(score: int | None) -> float:
        start = time.perf_counter()
        feed = Prefill(model, ids, model.make_cache(), CHUNK, score)
        while not feed.finished:
            feed.step()
        if score is not None:
            feed.scores()
        return time.perf_counter() - start

    kinds = {"plain": None, "score=0": 0, "score=5": 5}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with engine_runtime(cache_limit(model.config, CHUNK, False)):
        seconds(None)  # warm-up
        for _ in range(ROUNDS):
            for kind, score in kinds.items():
                times[kind].append(seconds(score))
    plain = statistics.median(times["plain"])
    for kind, ts in times.items():
        t = statistics.median(ts)
        print(f"{kind:<8} {t:6.2f} s  {TOKENS / t:8.0f} tok/s  {t / plain:5.2f}x plain")


if __name__ == "__main__":
    main()
