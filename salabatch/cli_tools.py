"""`salabatch cache …` and `salabatch train`: the prefix store and the training entry point.
Like cli.py, nothing heavy is imported until a command runs."""

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
    from salabatch.jobs.store.prefix_store import PrefixStore

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


@click.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--steps", default=2000, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True)
@click.option("--length", default=3072, show_default=True, type=click.IntRange(min=32),
              help="Longest prompt in tokens (sparse from dense_len).")  # fmt: skip
@click.option("--min-length", default=512, show_default=True, type=click.IntRange(min=0),
              help="Shortest prompt; each step draws one in between (0: --length).")  # fmt: skip
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--lr", default=1e-3, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--warmup", default=100, show_default=True, type=click.IntRange(min=0))
@click.option("--kinds", default="needle,multi,contract", show_default=True,
              help="Task kinds to draw from; the warm-ups before them: induction, lookup, recall, "
              "copy.")  # fmt: skip
@click.option("--eval-kinds", default="", show_default=False,
              help="Kinds each evaluation measures (held-out split); default --kinds.")  # fmt: skip
@click.option("--turns", default=1, show_default=True, type=click.IntRange(1, 6),
              help="Questions per document (the rest as follow-up chat turns).")  # fmt: skip
@click.option("--model", "sizes", default="", metavar="KEY=N,...",
              help="Model sizes (hidden, intermediate, layers, heads, kv_heads, head_dim, "
              "dense_len, window, topk); with --init only dense_len, window, topk.")  # fmt: skip
@click.option("--init", type=click.Path(file_okay=False, exists=True),
              help="Start from this checkpoint (a previous stage).")  # fmt: skip
@click.option("--deepen", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --init: add this many layers (a multiple of 4) behind the trained "
              "ones, each an identity until trained.")  # fmt: skip
@click.option("--deepen-front", is_flag=True,
              help="Add the --deepen layers in front of the trained ones instead.")  # fmt: skip
@click.option("--eval-every", default=200, show_default=True, type=click.IntRange(min=1))
@click.option("--eval-samples", default=64, show_default=True, type=click.IntRange(min=0),
              help="Held-out documents per eval kind at each evaluation (0: none); with 16, "
              "a kind's share of answers right moves by about ±7 points.")  # fmt: skip
@click.option("--grow-from", default=0, show_default=True, type=click.IntRange(min=0),
              help="A length curriculum: the longest sample starts here and doubles, up "
              "to --length, at each evaluation whose held-out token accuracy reaches "
              "--grow-at.")  # fmt: skip
@click.option("--grow-at", default=0.8, show_default=True, type=click.FloatRange(0, 1))
@click.option("--select-weight", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Weight of the selection loss: the sparse layers' compressed-key scores "
              "taught to point where their attention goes (0: none).")  # fmt: skip
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
    eval_kinds: str,
    turns: int,
    sizes: str,
    init: str | None,
    deepen: int,
    deepen_front: bool,
    eval_every: int,
    eval_samples: int,
    grow_from: int,
    grow_at: float,
    select_weight: float,
    log_every: int,
) -> None:
    """Train a small MiniCPM-SALA on synthetic document questions (CPU or GPU, MLX); writes a
    checkpoint folder that `run` and `generate` load, with loss.jsonl and training.json (and
    the checkpoint so far at every evaluation, and in best/ the one with the lowest held-out
    loss)."""
    from salabatch.train.train import TrainConfig
    from salabatch.train.train import train as run_training

    def show(r: dict) -> None:
        if r["step"] % log_every == 0 or "eval_loss" in r or r["step"] == steps:
            keys = ("eval_loss", "eval_answers", "eval_token_acc")
            shown = [k for k in r if k in keys or k.startswith("eval_answers_")]
            extra = "".join(f" {k} {r[k]:.3f}" for k in shown)
            extra += f" longest {r['longest']}" if "longest" in r else ""
            click.echo(
                f"step {r['step']:6d}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
                f"{r['seconds']:.2f}s/step{extra}"
            )

    cfg = TrainConfig(
        out=out, steps=steps, seed=seed, length=length, min_length=min(min_length, length),
        batch=batch, lr=lr, warmup=warmup, turns=turns, init=init, eval_every=eval_every,
        eval_samples=eval_samples,
        kinds=_names(kinds), eval_kinds=_names(eval_kinds), model=_sizes(sizes),
        grow_from=grow_from, grow_at=grow_at, select_weight=select_weight, deepen=deepen,
        deepen_front=deepen_front,
    )  # fmt: skip
    click.echo(f"wrote {run_training(cfg, log=show)}")


def _names(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())
