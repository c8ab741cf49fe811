"""`salabatch cache …` and `salabatch bench …`: the prefix store and the benchmarks. Like
cli.py, nothing heavy is imported until a command runs."""

from __future__ import annotations

import click


@click.group()
def cache() -> None:
    """The prefix cache store: saved document prefixes and prefill snapshots."""


_cache_dir = click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    help="Store folder (default: $XDG_CACHE_HOME/salabatch or ~/.cache/salabatch, the jobs' "
    "default cache.dir).",
)


def _store(root: str | None):
    from salabatch.files import cache_dir
    from salabatch.jobs.prefix_store import PrefixStore

    return PrefixStore(root or cache_dir())


@cache.command("ls")
@_cache_dir
def cache_ls(root: str | None) -> None:
    """List stored prefixes and snapshots: size, tokens, model, dtype, age; and the temporary
    files that killed writers left behind."""
    import time

    store = _store(root)
    entries = store.entries()
    if not entries:
        click.echo("no stored prefixes")
    else:
        click.echo(
            f"{'digest':14s} {'kind':8s} {'size':>9s} {'tokens':>15s} {'dtype':9s} "
            f"{'last used':>10s}  model"
        )
        now = time.time()
        for e in entries:
            tokens = f"{e.tokens}" if e.kind == "prefix" else f"{e.tokens}/{e.total_tokens}"
            click.echo(
                f"{e.digest[:12]:14s} {e.kind:8s} {human_size(e.bytes):>9s} {tokens:>15s} "
                f"{e.dtype:9s} {_age(now - e.last_used):>10s}  {e.model}"
            )
        total = sum(e.bytes for e in entries)
        click.echo(f"{len(entries)} entries, {human_size(total)}")
    stale = [t for t in store.temps() if t.stale]
    if stale:
        click.echo(
            f"{len(stale)} stale temporary files, {human_size(sum(t.bytes for t in stale))} "
            "(left by killed writes; the next run or `salabatch cache prune` removes them)"
        )


@cache.command("prune")
@_cache_dir
@click.option("--max-gb", type=click.FloatRange(min=0), help="Keep at most this much (LRU).")
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    metavar="DAYS",
    help="Remove entries unused for this many days.",
)
def cache_prune(root: str | None, max_gb: float | None, older_than: float | None) -> None:
    """Remove least recently used entries over a size, or entries unused for a while; and the
    temporary files that killed writers left behind."""
    if max_gb is None and older_than is None:
        raise click.UsageError("give --max-gb and/or --older-than")
    store = _store(root)
    removed = store.prune(
        max_bytes=None if max_gb is None else int(max_gb * 2**30),
        older_than_s=None if older_than is None else older_than * 86400,
    )
    line = f"removed {len(removed)} entries, {human_size(sum(e.bytes for e in removed))}"
    if store.swept:
        swept = human_size(sum(t.bytes for t in store.swept))
        line += f"; {len(store.swept)} stale temporary files, {swept}"
    click.echo(line)


@cache.command("clear")
@_cache_dir
@click.option("--yes", is_flag=True, help="Do not ask.")
def cache_clear(root: str | None, yes: bool) -> None:
    """Remove every stored prefix and snapshot."""
    store = _store(root)
    if not yes:
        click.confirm(f"remove every stored prefix in {store.root}?", abort=True)
    click.echo(f"freed {human_size(store.clear())}")


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f} {unit}"
    return f"{seconds:.0f} s"


@click.group()
def bench() -> None:
    """Benchmarks; each prints its results as JSON (and writes them with --out)."""


def _emit(name: str, result: dict, out: str | None) -> None:
    import json

    from salabatch.bench import environment

    text = json.dumps({"bench": name, **environment(), **result}, indent=2)
    click.echo(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


@bench.command("sparse")
@click.option(
    "--contexts",
    default="8192,32768,131072",
    show_default=True,
    help="Context lengths for the decode timing, comma-separated.",
)
@click.option(
    "--prefill-tokens",
    default=65536,
    show_default=True,
    help="Tokens of the chunked prefill whose peak memory is measured (0: skip).",
)
@click.option("--chunk", default=2048, show_default=True, help="Prefill chunk size.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_sparse(contexts: str, prefill_tokens: int, chunk: int, out: str | None) -> None:
    """InfLLM-v2: sparse-layer decode time vs context, and chunked-prefill peak memory."""
    from salabatch.bench import sparse

    sizes = [int(c) for c in contexts.split(",") if c.strip()]
    _emit("sparse", sparse.run(sizes, prefill_tokens, chunk), out)


@bench.command("prefix")
@click.option("--doc-tokens", default=16384, show_default=True)
@click.option("--questions", default=8, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_prefix(doc_tokens: int, questions: int, max_tokens: int, out: str | None) -> None:
    """Prefix store on builtin:tiny: questions over one document, re-prefilled per question vs
    prefilled once (stored) and answered as one batch, then a second run from disk."""
    from salabatch.bench import prefix

    _emit("prefix", prefix.run(doc_tokens, questions, max_tokens), out)


@bench.command("quant")
@click.option("--hidden", default=1024, show_default=True)
@click.option("--layers", default=8, show_default=True)
@click.option("--prefill", default=32, show_default=True)
@click.option("--steps", default=16, show_default=True)
@click.option("--formats", default="float32,bfloat16,8bit,4bit", show_default=True)
@click.option(
    "--act-dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
)
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_quant(
    hidden: int,
    layers: int,
    prefill: int,
    steps: int,
    formats: str,
    act_dtype: str,
    out: str | None,
) -> None:
    """Decode tok/s and memory of float32 / bf16 / 8-bit / 4-bit weights on a random model."""
    from salabatch.bench import quant

    chosen = tuple(f.strip() for f in formats.split(",") if f.strip())
    _emit("quant", quant.run(hidden, layers, prefill, steps, chosen, act_dtype), out)


@bench.command("gla")
@click.option("--repeat", default=5, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_gla(repeat: int, out: str | None) -> None:
    """Lightning kernels at the 9B's shape: 2048-token chunked prefill, decode steps."""
    from salabatch.bench import gla

    _emit("gla", gla.run(repeat), out)


@bench.command("long")
@click.option(
    "--contexts",
    help="Context lengths, comma-separated; K = 1024 [GPU: 8K,32K,128K; CPU: 4K,16K,32K].",
)
@click.option(
    "--shapes",
    type=click.Choice(["9b", "small"]),
    help="9b: the 9B vs Qwen3-8B shapes; small: both at 1/16 width [GPU: 9b; CPU: small].",
)
@click.option("--batch", default=8, show_default=True, help="Rows of SALA's batched decode.")
@click.option("--steps", default=48, show_default=True, help="Decode steps timed (median).")
@click.option("--chunk", type=int, help="Prefill chunk [GPU: 8192; CPU: 2048].")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
)
@click.option("--peer/--no-peer", default=True, help="Also run mlx-lm's dense llama.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option(
    "--chart",
    type=click.Path(dir_okay=False),
    help="PNG chart here (default: beside --out, as .png).",
)
def bench_long(
    contexts: str | None,
    shapes: str | None,
    batch: int,
    steps: int,
    chunk: int | None,
    dtype: str,
    peer: bool,
    out: str | None,
    chart: str | None,
) -> None:
    """SALA vs mlx-lm's dense llama at long context: prefill, decode at batch 1 and --batch,
    peak memory, the ratios. Random weights, the current device. Needs `salabatch[bench]`."""
    import json

    from salabatch.bench import environment, long

    sizes = [_tokens(c) for c in contexts.split(",") if c.strip()] if contexts else None

    def save(partial: dict) -> None:  # after every measurement: a run cut short keeps its rows
        if out:
            with open(out, "w", encoding="utf-8") as f:
                f.write(json.dumps({"bench": "long", **env, **partial}, indent=2) + "\n")

    env = environment()
    result = long.run(
        sizes,
        shapes=shapes,
        batch=batch,
        steps=steps,
        chunk=chunk,
        dtype=dtype,
        peer=peer,
        progress=lambda line: click.echo(line, err=True),
        on_result=save,
    )
    result = {"bench": "long", **env, **result}
    click.echo(long.table(result))
    if out:
        save(result)
        click.echo(f"wrote {out}")
    chart = chart or (out.rsplit(".", 1)[0] + ".png" if out else None)
    if chart:
        try:
            long.chart(result, chart, f"salabatch bench long — {result['device']}")
        except ImportError:
            click.echo(
                "no chart: matplotlib is not installed (pip install salabatch[bench])", err=True
            )
        else:
            click.echo(f"wrote {chart}")


@bench.command("needle")
@click.option(
    "--model",
    "model_ref",
    default="builtin:tiny",
    show_default=True,
    help="Checkpoint folder, builtin:tiny or a Hub id.",
)
@click.option(
    "--contexts", help="Document lengths, comma-separated; K = 1024 [4K,16K,32K,64K,128K]."
)
@click.option("--depths", help="Needle depths in %: a list (10,50,90) or A..B, every 20 [10..90].")
@click.option(
    "--documents",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Documents per context (each holds one needle per depth).",
)
@click.option("--quick", is_flag=True, help="4K and 8K, depths 10,50,90: a few minutes on a CPU.")
@click.option("--seed", default=0, show_default=True)
@click.option("--chunk", default=2048, show_default=True, type=click.IntRange(min=1))
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option(
    "--chart",
    type=click.Path(dir_okay=False),
    help="PNG heatmap here (default: beside --out, as .png).",
)
def bench_needle(
    model_ref: str,
    contexts: str | None,
    depths: str | None,
    documents: int,
    quick: bool,
    seed: int,
    chunk: int,
    out: str | None,
    chart: str | None,
) -> None:
    """Needle retrieval through the pipeline: held-out facts at known depths, asked as one batch
    over each document's prefix; accuracy per (context, depth) and, per sparse layer, the share
    of needles whose block it selected."""
    import json

    from salabatch.api import load
    from salabatch.bench import environment, needle

    preset = needle.QUICK if quick else {}
    sizes = [_tokens(c) for c in contexts.split(",") if c.strip()] if contexts else None
    chosen = _depths(depths) if depths else None

    def save(partial: dict) -> None:  # after every document: a run cut short keeps its rows
        if out:
            with open(out, "w", encoding="utf-8") as f:
                f.write(json.dumps({"bench": "needle", **env, **partial}, indent=2) + "\n")

    env = {**environment(), "model": model_ref}
    model, tokenizer = load(model_ref)
    result = needle.run(
        model,
        tokenizer,
        sizes or preset.get("contexts", needle.CONTEXTS),
        chosen or preset.get("depths", needle.DEPTHS),
        documents=documents if not quick else preset["documents"],
        seed=seed,
        chunk=chunk,
        progress=lambda line: click.echo(line, err=True),
        on_result=save,
    )
    result = {"bench": "needle", **env, **result}
    click.echo(needle.table(result))
    if out:
        save(result)
        click.echo(f"wrote {out}")
    chart = chart or (out.rsplit(".", 1)[0] + ".png" if out else None)
    if chart:
        try:
            needle.heatmap(result, chart, f"salabatch bench needle — {model_ref}, {env['device']}")
        except ImportError:
            click.echo(
                "no chart: matplotlib is not installed (pip install salabatch[bench])", err=True
            )
        else:
            click.echo(f"wrote {chart}")


def _depths(text: str) -> list[float]:
    """Percent depths: "10,50,90" or "A..B" (every 20 from A to B) → fractions."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            values = list(range(lo, hi + 1, 20))
        else:
            values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"not depths in %: {text!r}", param_hint="--depths") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise click.BadParameter(f"depths must be 0 to 100 %: {text!r}", param_hint="--depths")
    return [v / 100 for v in values]


@bench.command("scale")
@click.option("--docs", default=16, show_default=True, help="Synthetic documents.")
@click.option("--tokens", default=1000, show_default=True, help="Tokens per document, about.")
@click.option(
    "--actors",
    default="1,2,4",
    show_default=True,
    help="Ray model actors of each Ray run, comma-separated.",
)
@click.option("--questions", default=4, show_default=True, help="Questions per document.")
@click.option("--max-tokens", default=8, show_default=True, help="Tokens per answer.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_scale(
    docs: int, tokens: int, actors: str, questions: int, max_tokens: int, out: str | None
) -> None:
    """Documents/hour of the local executor and of the Ray executor on a local Ray cluster
    with 1, 2, 4 actors: Ray's overhead, its speedup, its start-up. builtin:tiny, a fresh prefix
    store per run. Needs `salabatch[ray]`."""
    import json

    from salabatch.bench import environment, scale

    counts = tuple(_count(a, "--actors") for a in actors.split(",") if a.strip())
    if not counts:
        raise click.BadParameter("give at least one actor count", param_hint="--actors")
    env = environment()

    def save(partial: dict) -> None:  # after every configuration: a run cut short keeps its rows
        if out:
            with open(out, "w", encoding="utf-8") as f:
                f.write(json.dumps({"bench": "scale", **env, **partial}, indent=2) + "\n")

    result = scale.run(
        docs,
        tokens,
        counts,
        questions,
        max_tokens,
        progress=lambda line: click.echo(line, err=True),
        on_result=save,
    )
    click.echo(scale.table(result))
    if out:
        save(result)
        click.echo(f"wrote {out}", err=True)


def _count(text: str, option: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise click.BadParameter(f"not a count of 1 or more: {text.strip()!r}", param_hint=option)
    return n


def _sizes(text: str) -> dict[str, int]:
    """`hidden=128,heads=4` → {"hidden": 128, "heads": 4} (names checked by the trainer)."""
    sizes = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        try:
            sizes[key.strip()] = int(value)
        except ValueError:
            raise click.BadParameter(f"not KEY=N: {item!r}", param_hint="--model") from None
    return sizes


def _tokens(text: str) -> int:
    text = text.strip().upper()
    try:
        return int(text[:-1]) * 1024 if text.endswith("K") else int(text)
    except ValueError:
        raise click.BadParameter(f"not a token count: {text!r}", param_hint="--contexts") from None


@click.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--steps", default=2000, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True)
@click.option("--length", default=3072, show_default=True, type=click.IntRange(min=64),
              help="Longest prompt in tokens (sparse from dense_len).")  # fmt: skip
@click.option("--min-length", default=512, show_default=True, type=click.IntRange(min=0),
              help="Shortest prompt; each step draws one in between (0: --length).")  # fmt: skip
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--lr", default=1e-3, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--warmup", default=100, show_default=True, type=click.IntRange(min=0))
@click.option("--kinds", default="needle,multi,contract", show_default=True,
              help="Task kinds to draw from.")  # fmt: skip
@click.option("--turns", default=1, show_default=True, type=click.IntRange(1, 6),
              help="Questions per document (the rest as follow-up chat turns).")  # fmt: skip
@click.option("--model", "sizes", default="", metavar="KEY=N,...",
              help="Model sizes (hidden, intermediate, layers, heads, kv_heads, head_dim, "
              "dense_len, window, topk); with --init only dense_len, window, topk.")  # fmt: skip
@click.option("--init", type=click.Path(file_okay=False, exists=True),
              help="Start from this checkpoint (a previous stage).")  # fmt: skip
@click.option("--eval-every", default=200, show_default=True, type=click.IntRange(min=1))
@click.option("--log-every", default=10, show_default=True, type=click.IntRange(min=1))
def train(
    out: str,
    steps: int,
    seed: int,
    length: int,
    min_length: int,
    batch: int,
    lr: float,
    warmup: int,
    kinds: str,
    turns: int,
    sizes: str,
    init: str | None,
    eval_every: int,
    log_every: int,
) -> None:
    """Train a small MiniCPM-SALA on synthetic document questions (CPU or GPU, MLX); writes a
    checkpoint folder that `run` and `generate` load, with loss.jsonl and training.json (and
    the checkpoint so far at every evaluation)."""
    from salabatch.train.train import TrainConfig
    from salabatch.train.train import train as run_training

    def show(r: dict) -> None:
        if r["step"] % log_every == 0 or "eval_loss" in r or r["step"] == steps:
            extra = "".join(f" {k} {r[k]:.3f}" for k in ("eval_loss", "eval_exact") if k in r)
            click.echo(
                f"step {r['step']:6d}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
                f"{r['seconds']:.2f}s/step{extra}"
            )

    cfg = TrainConfig(
        out=out, steps=steps, seed=seed, length=length, min_length=min(min_length, length),
        batch=batch, lr=lr, warmup=warmup, turns=turns, init=init, eval_every=eval_every,
        kinds=tuple(k.strip() for k in kinds.split(",") if k.strip()), model=_sizes(sizes),
    )  # fmt: skip
    click.echo(f"wrote {run_training(cfg, log=show)}")
