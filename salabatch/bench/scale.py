"""Scale-out on one machine: the same N synthetic documents through the local executor, then
through the Ray executor on a local Ray cluster with 1, 2, 4 … model actors.

Every configuration runs in its own folder with its own, empty, prefix store and results file,
so nothing one configuration computed is reused by the next: each pays for every prefill. The
model is builtin:random (an untrained test model), built once. What is measured is the executor:
per-document scheduling, actor start-up and model load per actor, rows streamed back to the
driver; so every document takes its own prefix path, as a long one does (`pool_max_tokens: 0`),
and answers are short.

Ray is started once, in this process, before the Ray configurations (`startup_s`); each
configuration's wall time counts from `run_job_ray` to its return (actors, model loads, the run).
More actors than CPU cores cannot speed a CPU-bound run up: they share the cores.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.compute as pc

from salabatch.jobs.spec.models import JobSpec
from salabatch.plural import counted

if TYPE_CHECKING:
    from salabatch.jobs.run.runner import RunSummary

# The synthetic documents draw their words from this: plain English, as a tokenizer sees it.
VOCABULARY = (
    "the ferry to the island leaves at seven and returns before noon when the harbour master "
    "signs the inspection report for the quay fenders cost four thousand pounds under a contract "
    "with the council whose budget covers repairs to the pier lights and the waiting room"
)
QUESTIONS = (
    "Summarize this document in two sentences.",
    "Who is named in this document?",
    "What does it cost, and for what?",
    "When does it happen?",
    "Where does it take place?",
    "What should be repaired first?",
    "Which contract is mentioned?",
    "What is the main risk?",
)


def write_documents(folder: Path, n: int, tokens: int, encode: Callable[[str], list[int]]) -> None:
    """`n` documents of about `tokens` tokens each (deterministic: one seed per document, so
    no two share a prefix) as doc-NNNN.txt in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    words = VOCABULARY.split()
    rng = random.Random("sample")
    sample = " ".join(rng.choice(words) for _ in range(400))
    words_per_token = 400 / len(encode(sample))
    count = max(1, round(tokens * words_per_token))
    for i in range(n):
        rng = random.Random(f"doc-{i}")
        text = f"Document {i}. " + " ".join(rng.choice(words) for _ in range(count))
        (folder / f"doc-{i:04d}.txt").write_text(text + "\n", encoding="utf-8")


def job_spec(folder: Path, model: Path, docs: Path, questions: int, max_tokens: int) -> JobSpec:
    """The job of one configuration: its own cache dir (an empty prefix store) and output."""
    data = {
        "name": f"bench-scale-{folder.name}",
        "model": str(model),
        "documents": [{"path": str(docs)}],
        "questions": [
            {"id": f"q{i}", "text": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}
            for i in range(questions)
        ],
        "generation": {"max_tokens": max_tokens, "temperature": 0.0, "seed": 0},
        "engine": {"batch_size": max(questions, 1), "pool_max_tokens": 0},
        "cache": {"dir": str(folder / "cache")},
        "output": {"path": str(folder / "results.parquet")},
    }
    return JobSpec.model_validate(data, context={"base_dir": folder})


def run(
    docs: int = 16,
    tokens: int = 1000,
    actors: tuple[int, ...] = (1, 2, 4),
    questions: int = 4,
    max_tokens: int = 8,
    *,
    progress: Callable[[str], None] = print,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """The local executor once, then the Ray executor with each count of `actors`; `on_result`
    gets the result so far after each configuration (a run cut short keeps what it measured).
    Raises RayNotInstalled without Ray."""
    from salabatch.jobs.ray.executor import INSTALL, LOCAL_CPUS, SLOT, RayNotInstalled

    try:
        import ray
        import ray.data  # noqa: F401  (the [data] extra)
    except ImportError as e:
        raise RayNotInstalled(f"bench scale needs Ray Data ({e.name or e}): {INSTALL}") from None

    from salabatch.engine.tokenizer import load_tokenizer
    from salabatch.jobs.ray.executor import run_job_ray
    from salabatch.jobs.results.read import read_results
    from salabatch.jobs.run.runner import run_job
    from salabatch.models import resolve_model

    def silent(_line: str) -> None:
        pass

    with tempfile.TemporaryDirectory(prefix="salabatch-bench-scale-") as tmp:
        root = Path(tmp)
        model = resolve_model("builtin:random", root)
        write_documents(root / "docs", docs, tokens, load_tokenizer(model).encode)
        result = {
            "docs": docs,
            "tokens": tokens,
            "doc_tokens": None,  # of the document prompts, as the rows count them
            "questions": questions,
            "max_tokens": max_tokens,
            "cpus": os.cpu_count(),
            "ray": ray.__version__,
            "startup_s": None,
            "results": [],
        }

        def measure(executor: str, workers: int, execute: Callable[[JobSpec], RunSummary]) -> None:
            progress(f"{executor}, {counted(workers, 'actor')} …")
            folder = root / f"{executor}-{workers}"
            spec = job_spec(folder, model, root / "docs", questions, max_tokens)
            start = time.perf_counter()
            summary = execute(spec)
            wall = time.perf_counter() - start
            table = read_results(spec.output.path)
            result["results"].append(
                {
                    "executor": executor,
                    "actors": workers,
                    "wall_s": round(wall, 2),
                    "docs_per_hour": round(docs / wall * 3600, 1),
                    "rows": table.num_rows,
                    "errors": summary.errors,
                }
            )
            if result["doc_tokens"] is None and table.num_rows:
                result["doc_tokens"] = round(pc.mean(table["doc_tokens"]).as_py(), 1)
            result["ratios"] = ratios(result["results"])
            if on_result is not None:
                on_result(result)

        measure("local", 1, lambda spec: run_job(spec, progress=False, echo=silent))
        start = time.perf_counter()
        ray.init(  # as run_job_ray starts a local Ray, with a slot for the most actors
            num_cpus=max(LOCAL_CPUS, os.cpu_count() or 1),
            resources={SLOT: max(actors)},
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        result["startup_s"] = round(time.perf_counter() - start, 2)
        try:
            for n in actors:
                measure(
                    "ray",
                    n,
                    lambda spec, n=n: run_job_ray(spec, workers=n, progress=False, echo=silent),
                )
        finally:
            ray.shutdown()
    result["note"] = note(result)
    return result


def ratios(rows: list[dict]) -> dict:
    """Ray at 1 actor against the local executor (its overhead), and each actor count against
    Ray at 1 actor (its speedup)."""
    local = next((r for r in rows if r["executor"] == "local"), None)
    ray1 = next((r for r in rows if r["executor"] == "ray" and r["actors"] == 1), None)
    out: dict = {}
    if local and ray1:
        out["ray1_over_local"] = round(ray1["wall_s"] / local["wall_s"], 2)
    if ray1:
        out["speedup_vs_ray1"] = {
            str(r["actors"]): round(ray1["wall_s"] / r["wall_s"], 2)
            for r in rows
            if r["executor"] == "ray"
        }
    return out


def note(result: dict) -> str:
    """What the numbers mean on this machine."""
    cpus = result["cpus"] or 1
    most = max((r["actors"] for r in result["results"] if r["executor"] == "ray"), default=1)
    text = (
        "wall_s includes each executor's model loads (once per actor); Ray's start-up is "
        "startup_s, apart."
    )
    if most >= cpus:
        text += (
            f" This machine has {cpus} CPU cores, shared by the driver and every actor: more "
            "actors than cores cannot speed a CPU-bound run up; on a cluster each machine adds "
            "its own cores (or GPU)."
        )
    return text


def table(result: dict) -> str:
    """The terminal table: one line per configuration, then the note."""
    lines = [
        f"{result['docs']} documents of ~{result['doc_tokens'] or 0:.0f} tokens × "
        f"{result['questions']} questions; {result['cpus']} CPU cores; "
        f"Ray {result['ray']} start-up {result['startup_s']} s",
        f"{'executor':>8} {'actors':>6} {'wall s':>8} {'docs/hour':>10} {'rows':>6} "
        f"{'x local':>8} {'speedup':>8}",
    ]
    local = next((r for r in result["results"] if r["executor"] == "local"), None)
    speedups = result.get("ratios", {}).get("speedup_vs_ray1", {})
    for r in result["results"]:
        over = f"{r['wall_s'] / local['wall_s']:.2f}" if local else "–"
        speed = speedups.get(str(r["actors"])) if r["executor"] == "ray" else None
        lines.append(
            f"{r['executor']:>8} {r['actors']:>6} {r['wall_s']:>8.2f} {r['docs_per_hour']:>10,.0f} "
            f"{r['rows']:>6} {over:>8} {speed if speed is not None else '–':>8}"
        )
    if "note" in result:
        lines.append(result["note"])
    return "\n".join(lines)
