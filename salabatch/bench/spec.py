"""Speculative decoding, side by side in one run: decode without drafts (`off`) and with each
drafter (`lookup`, `layers`, `auto`), at several batch sizes, on three workloads:

* extraction: the demo job's seven questions over its text documents, on builtin:tiny (the
  answers are names, amounts and dates copied from the document: where lookup shines);
* free-form: open questions over the same documents, on builtin:tiny, longer answers;
* cost: random weights over a random document, the 9B's layer layout (32 layers, 8 sparse) at
  1/16 width on a CPU, the 9B itself in bfloat16 over a 32K-token document on a GPU (`shapes`,
  `context`): acceptance means nothing there, the rows show what drafting costs.

Beside each workload and batch, a verify pass's time in plain decode steps (`pass_cost`, over
the workload's first document): the figure that bounds every drafter's gain on that device.

Per workload and batch size, each document is prefilled once; then, in each of `rounds`
rounds, every document's questions decode with every setting in turn (document by document,
the settings' order reversed every round), so that the machine's drift falls on all of them
alike. Reported per row: decode tokens/s (batch 1: each answer's tokens after its first over
its decode time, as `Generation.decode_tok_s`; larger batches: all tokens over the wall time
of the batch, its questions' own prefill included, the same for every setting), the median
round's; the ratio to `off`, the median of the rounds' ratios (each round's settings ran side
by side); drafts made and accepted; and whether every greedy answer is token for token
`off`'s.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from salabatch.engine.decode import decode
from salabatch.engine.generate import Generator, Request, prefill
from salabatch.engine.sampling import SamplingParams
from salabatch.engine.speculative import Speculation

WORKLOADS = ("extraction", "free-form", "cost")
DRAFTS = ("off", "lookup", "layers", "auto")
BATCHES = (1, 2, 8)
DEMO = Path(__file__).resolve().parents[2] / "jobs"  # the repository's jobs/ (demo documents)
FREE_FORM = (
    "Summarize this agreement.",
    "Describe the obligations of the Provider.",
    "Explain how the agreement can be terminated.",
    "What does the Client have to pay, and when?",
)


def run(
    workloads: tuple[str, ...] = WORKLOADS,
    batches: tuple[int, ...] = BATCHES,
    drafts: tuple[str, ...] = DRAFTS,
    rounds: int = 5,
    tokens: int = 4,
    layers: int = 2,
    shapes: str | None = None,
    context: int | None = None,
    progress=None,
) -> dict:
    """`shapes` ("small" or "9b") and `context` (tokens) size the cost workload; None: by the
    device (`cost_defaults`)."""
    chosen = {
        **cost_defaults(),
        **{k: v for k, v in (("shapes", shapes), ("context", context)) if v},
    }
    rows, costs = [], []
    for workload in workloads:
        model, documents = _workload(workload, **chosen)
        # each document prefilled once: every batch size and setting decodes forks of it
        prefixes = [(_prefilled(model, doc), asks) for doc, asks in documents]
        for batch in batches:
            rows += _measure(model, prefixes, workload, batch, drafts, rounds, tokens, layers)
            costs.append({"workload": workload, **pass_cost(model, prefixes[0][0], batch, tokens)})
            if progress:
                progress(table({"rows": rows[-len(drafts) :], "pass_cost": costs[-1:]}))
    return {
        "settings": {"tokens": tokens, "layers": layers, "rounds": rounds, **chosen},
        "rows": rows,
        "pass_cost": costs,
    }


def cost_defaults() -> dict:
    """The cost workload's model and document by device: the 9B over 32K tokens on a GPU (what
    users run there), the 9B's layout at 1/16 width over 2K on a CPU."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return {"shapes": "9b", "context": 32768}
    return {"shapes": "small", "context": 2048}


def _workload(name: str, shapes: str = "small", context: int = 2048) -> tuple:
    """The model and [(document tokens, [Request])] of a workload."""
    if name not in WORKLOADS:  # else it would run as free-form
        from salabatch.errors import ConfigError

        raise ConfigError("unknown workload", field="workloads", expected=WORKLOADS, got=name)
    if name == "cost":
        return _cost(shapes, context)
    from salabatch.api import load

    model, tok = load("builtin:tiny")
    import yaml

    job = yaml.safe_load((DEMO / "demo.yaml").read_text())
    extraction = name == "extraction"
    questions = [q["text"] for q in job["questions"]] if extraction else list(FREE_FORM)
    max_tokens = job["generation"]["max_tokens"] if extraction else 64
    stop = frozenset(tok.eos_ids)
    documents = []
    for path in sorted((DEMO / "demo" / "docs").glob("*")):
        if path.suffix not in (".txt", ".md"):
            continue
        doc = tuple(tok.document_prompt(path.read_text(), system=None, think=False))
        asks = [
            Request(
                f"{path.stem}/{i}",
                tuple(tok.prompt_suffix(q, system=None, think=False)),
                SamplingParams(),
                max_tokens,
                stop,
                context=doc,
            )
            for i, q in enumerate(questions)
        ]
        documents.append((doc, asks))
    return model, documents


def _cost(shapes: str, context: int) -> tuple:
    from salabatch.bench.long import SALA_9B_SPARSE_LAYERS, SHAPES, _sala, random_init
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.model import Model
    from salabatch.engine.runtime import resolve_dtype

    if shapes not in SHAPES:
        raise ValueError(f"shapes must be one of {', '.join(SHAPES)}, got {shapes!r}")
    if shapes == "9b":
        config = SHAPES["9b"].sala
    else:  # the 9B's 32 layers, 8 of them sparse, at the small shapes' width
        small = SHAPES["small"].sala
        config = _sala(256, 32, 8, 2, 32, 1024, small["vocab_size"], SALA_9B_SPARSE_LAYERS, 16)
    model = random_init(Model(ModelConfig.from_dict(config)), resolve_dtype(None), seed=0)
    model.fuse()
    rng = np.random.default_rng(0)
    doc = tuple(rng.integers(3, 4000, size=context).tolist())
    asks = [
        Request(f"random/{i}", tuple(rng.integers(3, 4000, size=16).tolist()), max_tokens=64,
                context=doc)
        for i in range(8)
    ]  # fmt: skip
    return model, [(doc, asks)]


def _prefilled(model, doc: tuple[int, ...]):
    """A one-row cache of the document: 1K-token chunks (the demo's short documents, as before),
    8K past 8K tokens (the GPU's chunk)."""
    cache = model.make_cache()
    prefill(model, doc, cache, 8192 if len(doc) > 8192 else 1024)
    return cache


def _measure(model, prefixes, workload, batch, drafts, rounds, tokens, layers) -> list[dict]:
    specs = {d: Speculation(d, tokens=tokens, layers=layers) for d in drafts}
    seen: dict[str, list[dict]] = {d: [] for d in drafts}
    for i in range(rounds + 1):  # the first round warms every trace and is not kept
        runs: dict[str, list] = {d: [] for d in drafts}
        for cache, asks in prefixes:
            for draft in drafts[:: 1 if i % 2 == 0 else -1]:
                runs[draft].append(_decode(model, cache, asks, batch, specs[draft]))
        for draft in drafts:
            seen[draft].append(_total(runs[draft], batch))
    base = _kept(seen["off"]) if "off" in seen else None
    rows = []
    for draft in drafts:
        kept = _kept(seen[draft])
        row = {
            "workload": workload,
            "batch": batch,
            "draft": draft,
            "tok_s": round(kept["tok_s"], 1),
            "tok_s_rounds": [round(r["tok_s"], 1) for r in seen[draft][1:]],
            "drafted": kept["drafted"],
            "accepted": kept["accepted"],
            "acceptance": round(kept["accepted"] / kept["drafted"], 3) if kept["drafted"] else None,
            "tokens": kept["tokens"],
        }
        if base is not None:
            pairs = [
                mine["tok_s"] / theirs["tok_s"]
                for mine, theirs in zip(seen[draft][1:], seen["off"][1:], strict=True)
            ]
            row["vs_off"] = round(statistics.median(pairs), 3)
            row["vs_off_rounds"] = [round(r, 3) for r in pairs]
            row["same_answers"] = all(
                r["answers"] == b["answers"] for r, b in zip(seen[draft], seen["off"], strict=True)
            )
        rows.append(row)
    return rows


def pass_cost(model, prefix, batch: int, tokens: int, steps: int = 48) -> dict:
    """A verify pass's time against a plain decode step's, at `batch` rows forked from the
    prefilled document `prefix` (a one-row cache, left as it is), each run as `Batch` runs it:
    plain steps pipelined (the next built and queued before the last is read), passes of
    `tokens` drafts + 1 positions not (each reads the model's tokens, then the rollback keeps
    one position, as a pass whose drafts all fail). → the median step and pass in
    milliseconds, and the pass in steps: a drafter gains only where a pass keeps more tokens
    than that."""
    cache = prefix.fork(batch)
    # room for every step, every pass's kept position and the last pass's whole length: the
    # buffers keep one shape (a growth mid-measure would retrace the GPU's compiled step)
    cache.reserve(cache.own_length() + 2 * steps + tokens + 1)
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size  # (builtin:tiny's is 1,024: an id past it reads past the table)
    feed = mx.array(rng.integers(3, vocab, size=batch), dtype=mx.int32)
    step_times, pass_times = [], []
    last = time.perf_counter()
    for _ in range(steps):
        drawn = mx.argmax(decode(model, feed, cache), axis=-1).astype(mx.int32)
        mx.async_eval(drawn, *cache.arrays())
        feed.tolist()  # the last step's tokens: what a plain step reads
        now = time.perf_counter()
        step_times.append(now - last)
        last, feed = now, drawn
    feed.tolist()
    for _ in range(steps):
        start = time.perf_counter()
        ids = mx.array(rng.integers(3, vocab, size=(batch, tokens + 1)), dtype=mx.int32)
        point = cache.checkpoint()
        mx.argmax(model(ids, cache, queue=True), axis=-1).tolist()
        cache.rollback(point, [1] * batch)  # queued with the next pass, as `Batch` leaves it
        pass_times.append(time.perf_counter() - start)
    step_ms = 1000 * statistics.median(step_times[2:])
    pass_ms = 1000 * statistics.median(pass_times[2:])
    return {
        "batch": batch,
        "positions": tokens + 1,
        "step_ms": round(step_ms, 3),
        "pass_ms": round(pass_ms, 3),
        "pass_steps": round(pass_ms / step_ms, 2),
    }


def _decode(model, cache, asks, batch, spec) -> tuple[list, float]:
    start = time.perf_counter()
    done = list(Generator(model, batch_size=batch, speculation=spec).generate(asks, cache))
    return done, time.perf_counter() - start


def _total(runs, batch) -> dict:
    done = [g for gens, _ in runs for g in gens]
    if batch == 1:
        steps = sum(max(len(g.tokens) - 1, 0) for g in done)
        rate = steps / sum(g.decode_s for g in done)
    else:
        rate = sum(len(g.tokens) for g in done) / sum(wall for _, wall in runs)
    return {
        "tok_s": rate,
        "drafted": sum(g.draft_tokens for g in done),
        "accepted": sum(g.accepted_tokens for g in done),
        "tokens": sum(len(g.tokens) for g in done),
        "answers": {g.request.id: g.tokens for g in done},
    }


def _kept(rounds: list[dict]) -> dict:
    """The median round of the timed ones (the first warmed up)."""
    timed = rounds[1:] or rounds
    middle = statistics.median_low([r["tok_s"] for r in timed])
    return next(r for r in timed if r["tok_s"] == middle)


def table(result: dict) -> str:
    lines = [
        f"{'workload':11s} {'batch':>5s} {'draft':7s} {'tok/s':>8s} {'vs off':>7s} "
        f"{'accepted':>14s} same"
    ]
    for r in result["rows"]:
        acc = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
        vs = f"{r['vs_off']:.2f}×" if "vs_off" in r else "-"
        same = {True: "yes", False: "NO"}.get(r.get("same_answers"), "-")
        lines.append(
            f"{r['workload']:11s} {r['batch']:5d} {r['draft']:7s} {r['tok_s']:8.1f} {vs:>7s} "
            f"{acc:>14s} {same}"
        )
    for c in result.get("pass_cost", []):
        lines.append(
            f"{c['workload']}, batch {c['batch']}: a verify pass of {c['positions']} positions "
            f"{c['pass_ms']:.2f} ms = {c['pass_steps']:.2f} plain steps ({c['step_ms']:.2f} ms)"
        )
    return "\n".join(lines)


def chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["draft"] != "off" and "vs_off" in r]
    groups = sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda g: (g[0], g[1]))
    drafts = [d for d in DRAFTS if any(r["draft"] == d for r in rows)]
    width = 0.8 / max(len(drafts), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(groups)), 4))
    ratio = {(r["workload"], r["batch"], r["draft"]): r["vs_off"] for r in rows}
    for i, d in enumerate(drafts):
        values = [ratio.get((*g, d), 0) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=d)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(drafts) - 1) / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{w}\nb{b}" for w, b in groups], fontsize=8)
    ax.set_ylabel("decode tokens/s vs off")
    ax.set_title(f"salabatch bench spec — {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
