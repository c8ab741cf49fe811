"""Needle retrieval through the real pipeline: does a fact survive chunked prefill, InfLLM-v2
block selection and batched decoding over a shared document prefix?

Per context length, documents from the held-out split of `salabatch.train.data` (entity names,
value formats, fact sentences and question phrasings never used in training), each holding one
unrelated key → value fact at every depth; no two documents of a run share their facts, so a
grid of C contexts × D documents × N depths asks C·D·N different facts. The document's prompt
is prefilled once in chunks and all of its questions are answered as one greedy batch over that
prefix (`Generator`, as `salabatch run` does). An answer is right when it is exactly the value
(whitespace around it aside): what a trained model says and then stops. A wrong answer is put
in one of three kinds (`MISSES`), which tell finding from copying: another needle's value (the
wrong fact found), a slip (the right value copied with an error: at most two characters
changed, or half of it right from its start), or other. Each needle also says whether its value
ends its sentence ("the gate code of Unit Velora is 47-1182.") or comes before words of its key
("47-1182 is the gate code of Unit Velora."): a causal model's value tokens cannot see the words
after them, so the second kind is harder to find, and the summary counts each apart.

Block selection: for each question, a fork of the same prefix is given the question's prompt
with the sparse layers recording their choice; for the query that produces the first answer
token, a needle counts as selected by a layer when any of its kv heads chose a block holding
one of the value's tokens. Below `dense_len` every block is attended, and no share is given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from salabatch.errors import ConfigError

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
QUICK = {"contexts": (4096, 8192), "depths": (0.1, 0.5, 0.9), "documents": 1}
MAX_TOKENS = 24  # longer than every value format, so a wrong answer is seen whole
MISSES = ("another needle", "slip", "other")
PLACES = ("value last", "value before its key")  # where the value sits in its fact sentence


@dataclass(frozen=True)
class Needle:
    """One question of a needle document: its depth, the answer, and the value's prompt tokens
    [start, end) in the document's prompt."""

    depth: float
    question: str
    value: str
    start: int
    end: int
    place: str  # one of PLACES


def run(
    model,
    tokenizer,
    contexts: Sequence[int] = CONTEXTS,
    depths: Sequence[float] = DEPTHS,
    *,
    documents: int = 1,
    seed: int = 0,
    chunk: int = 2048,
    progress: Callable[[str], None] = print,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Every (context, document): answers and selections. `on_result` gets the result so far
    after each document (a run cut short keeps what it measured)."""
    from salabatch.engine.kernels.attention import on_gpu
    from salabatch.engine.memory import cache_limit
    from salabatch.engine.runtime import engine_runtime
    from salabatch.train.data import EVAL, TaskGenerator

    if documents < 1 or not contexts or not depths:
        raise ConfigError("need at least one context, depth and document", field="needle")
    tasks = TaskGenerator(tokenizer, split=EVAL, seed=seed, kinds=("needle",))
    rows = []
    with engine_runtime(cache_limit(model.config, chunk, on_gpu())):
        for i, n in enumerate(contexts):
            for index in range(documents):
                progress(f"needle: {n} tokens, document {index + 1}/{documents} …")
                sample = i * documents + index  # each context its own facts
                rows += _document(model, tokenizer, tasks, n, index, sample, depths, chunk)
                if on_result is not None:
                    on_result(summary(rows, model))
    return summary(rows, model)


def _document(
    model, tokenizer, tasks, n: int, index: int, sample: int, depths, chunk: int
) -> list[dict]:
    """Document `index` of context `n`: held-out sample `sample`'s facts at `depths`."""
    from salabatch.engine.generate import Generator, Request, prefill

    samples = tasks.needle_document(sample, n, list(depths))
    document = samples[0].document
    doc_prompt = tokenizer.document_prompt(document, system=None, think=False)
    if len(doc_prompt) > 1.25 * n + 32:  # its facts alone: a row would say n, untrue
        raise ConfigError(
            f"{n} tokens hold no document with {len(samples)} needles: it takes "
            f"{len(doc_prompt)}; give a longer context or fewer depths",
            field="contexts",
        )
    needles = [_locate(tokenizer, document, s) for s in samples]
    start = time.perf_counter()
    prefix = model.make_cache()
    prefill(model, doc_prompt, prefix, chunk)
    prefill_s = time.perf_counter() - start
    suffixes = [tokenizer.prompt_suffix(x.question, system=None, think=False) for x in needles]
    stop = frozenset(tokenizer.eos_ids)
    requests = [
        Request(str(i), tuple(ids), max_tokens=MAX_TOKENS, stop=stop)
        for i, ids in enumerate(suffixes)
    ]
    generator = Generator(model, batch_size=len(requests), prefill_chunk=chunk)
    answers = {g.request.id: g.tokens for g in generator.generate(requests, prefix)}
    rows = []
    values = [x.value for x in needles]
    for i, (needle, ids) in enumerate(zip(needles, suffixes, strict=True)):
        answer = tokenizer.decode(answers[str(i)], skip_special=True)
        kind = miss(answer.strip(), needle.value, values[:i] + values[i + 1 :])
        rows.append(
            {
                "context": n,
                "document": index,
                "depth": needle.depth,
                "prompt_tokens": len(doc_prompt) + len(ids),
                "value": needle.value,
                "answer": answer,
                "correct": kind is None,
                "miss": kind,
                "place": needle.place,
                "value_tokens": [needle.start, needle.end],
                "selected": _selected(model, prefix, ids, needle),
                "prefill_s": round(prefill_s, 3),
            }
        )
    return rows


def miss(answer: str, value: str, others: Sequence[str]) -> str | None:
    """The kind of a wrong answer (one of MISSES); None for a right one."""
    if answer == value:
        return None
    if answer in others:
        return "another needle"
    shared = len(os.path.commonprefix([answer, value]))
    if _edits(answer, value) <= 2 or 2 * shared >= len(value):
        return "slip"
    return "other"


def _edits(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions turning a into b."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _locate(tokenizer, document: str, sample) -> Needle:
    """The value's token span in the document's prompt: the prompt of the text before it and
    the prompt of the text through it (a boundary may move by a token; a block is 64)."""
    at = document.index(sample.answer)
    start = len(tokenizer.document_prompt(document[:at], system=None, think=False))
    through = document[: at + len(sample.answer)]
    end = len(tokenizer.document_prompt(through, system=None, think=False))
    after = document[at + len(sample.answer) :].split("\n", 1)[0]
    place = PLACES[0] if after.startswith(".") and after[1:2] in ("", " ") else PLACES[1]
    return Needle(sample.depth, sample.question, sample.answer, start, max(end, start + 1), place)


def _selected(model, prefix, suffix: Sequence[int], needle: Needle) -> dict[str, bool] | None:
    """Per sparse layer (by index): whether the query before the first answer token selected a
    block holding the value, in any kv head; None when the layers ran dense (nothing chosen)."""
    from salabatch.engine.sparse_cache import SparseKVCache

    row = prefix.fork(1)
    layers = {i: c for i, c in enumerate(row.layers) if isinstance(c, SparseKVCache)}
    for c in layers.values():
        c.trace = []
    mx.eval(model.hidden(mx.array([list(suffix)], dtype=mx.int32), row))
    block = model.config.sparse.block_size
    wanted = mx.arange(needle.start // block, (needle.end - 1) // block + 1)
    if not all(c.trace for c in layers.values()):
        return None
    out = {}
    for i, c in layers.items():
        idx = c.trace[-1][0, :, -1, :]  # [Hk, K]: the last query's blocks
        out[str(i)] = bool((idx[..., None] == wanted).any().item())
    return out


def summary(rows: list[dict], model) -> dict:
    """The rows, accuracy per (context, depth) and per sparse layer the share of needles whose
    block it selected (sparse contexts only)."""
    cells = {}
    for r in rows:
        cells.setdefault((r["context"], r["depth"]), []).append(r)
    grid = []
    for (n, depth), group in sorted(cells.items()):
        cell = {"context": n, "depth": depth, "needles": len(group)}
        cell["accuracy"] = round(sum(r["correct"] for r in group) / len(group), 4)
        picks = [r["selected"] for r in group if r["selected"] is not None]
        if picks:
            cell["selected"] = {
                layer: round(sum(p[layer] for p in picks) / len(picks), 4) for layer in picks[0]
            }
        grid.append(cell)
    from salabatch.engine.config import LIGHTNING

    cfg = model.config
    return {
        "dense_len": cfg.sparse.dense_len,
        "sparse_layers": [i for i, k in enumerate(cfg.layer_kinds) if k != LIGHTNING],
        "accuracy": round(sum(r["correct"] for r in rows) / len(rows), 4) if rows else None,
        "misses": {kind: sum(r["miss"] == kind for r in rows) for kind in MISSES},
        "places": {
            place: {
                "needles": sum(r["place"] == place for r in rows),
                "right": sum(r["correct"] for r in rows if r["place"] == place),
            }
            for place in PLACES
        },
        "grid": grid,
        "rows": rows,
    }


def table(result: dict) -> str:
    """Accuracy in % per context (rows) and depth (columns) with each context's right answers,
    then the selection shares, the overall accuracy with its 95 % interval and the misses."""
    contexts = sorted({c["context"] for c in result["grid"]})
    depths = sorted({c["depth"] for c in result["grid"]})
    cell = {(c["context"], c["depth"]): c for c in result["grid"]}
    head = f"{'context':>8} | " + " ".join(f"{f'{d:.0%}':>6}" for d in depths) + " |   all"
    lines = ["accuracy by depth", head]
    for n in contexts:
        vals = [cell.get((n, d)) for d in depths]
        rights = [r["correct"] for r in result["rows"] if r["context"] == n]
        lines.append(
            f"{n:>8} | "
            + " ".join(f"{c['accuracy']:>6.0%}" if c else f"{'–':>6}" for c in vals)
            + f" | {sum(rights)}/{len(rights)}"
        )
    shares = [c for c in result["grid"] if "selected" in c]
    if shares:
        layers = list(shares[0]["selected"])
        lines += ["", "needle block selected, by sparse layer"]
        lines.append(f"{'context':>8} {'depth':>6} | " + " ".join(f"{'L' + s:>5}" for s in layers))
        for c in shares:
            picks = " ".join(f"{c['selected'][s]:>5.0%}" for s in layers)
            lines.append(f"{c['context']:>8} {c['depth']:>6.0%} | {picks}")
    n = len(result["rows"])
    low, high = wilson(sum(r["correct"] for r in result["rows"]), n)
    lines.append(
        f"\noverall accuracy: {result['accuracy']:.1%} of {n} needles "
        f"(95 % interval {low:.0%}–{high:.0%})"
    )
    misses = result.get("misses") or {}
    if any(misses.values()):
        lines.append("misses: " + ", ".join(f"{n} {kind}" for kind, n in misses.items()))
    places = result.get("places") or {}
    if places:
        lines.append(
            "right by where the value sits in its sentence: "
            + ", ".join(f"{place} {p['right']}/{p['needles']}" for place, p in places.items())
        )
    return "\n".join(lines)


def wilson(right: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share right/n (95 % for z = 1.96): how far a grid of n
    needles can be from the model's accuracy on all such needles."""
    p, spread = right / n, z * z / n
    centre = (p + spread / 2) / (1 + spread)
    half = z * ((p * (1 - p) + spread / 4) / n) ** 0.5 / (1 + spread)
    return max(0.0, centre - half), min(1.0, centre + half)


def heatmap(result: dict, path: str, title: str) -> None:
    """Accuracy per (context, depth) as a PNG heatmap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({c["context"] for c in result["grid"]})
    depths = sorted({c["depth"] for c in result["grid"]})
    cell = {(c["context"], c["depth"]): c["accuracy"] for c in result["grid"]}
    grid = [[cell.get((n, d), float("nan")) for n in contexts] for d in depths]
    fig, ax = plt.subplots(figsize=(1.4 * len(contexts) + 2.5, 0.6 * len(depths) + 1.8))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    labels = [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in contexts]
    ax.set_xticks(range(len(contexts)), labels)
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    for y, row in enumerate(grid):
        for x, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(x, y, f"{value:.0%}", ha="center", va="center", fontsize=9)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("needle depth")
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
