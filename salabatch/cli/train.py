"""`salabatch train`: a small MiniCPM-SALA trained on synthetic document questions (how the
builtin:tiny demo model was made). Like every command group, nothing heavy is imported until a
command runs."""

from __future__ import annotations

import click

from salabatch.cli.main import Finite


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
@click.option("--lr", default=1e-3, show_default=True, type=Finite(min=0, min_open=True))
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
@click.option("--grow-at", default=0.8, show_default=True, type=Finite(0, 1))
@click.option("--select-weight", default=0.0, show_default=True, type=Finite(min=0),
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
