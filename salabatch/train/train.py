"""Train a small MiniCPM-SALA on the synthetic tasks of `data.py`, with the project's own `Model`.

The architecture is the 9B's in small (`model_config`): one sparse (InfLLM-v2, NoPE) layer per
three lightning (simple-GLA, RoPE) layers, GQA in the sparse layers, the same muP scalings, and
`dense_len` / window / top-k scaled down so documents of a few thousand tokens run the sparse
path. Training is a plain forward without a cache (`model.hidden(ids)`): the same code that
prefills a document, so the trained weights see at training time exactly what inference does.

Gradients: InfLLM-v2's block selection (top-k over compressed-key scores) is discrete; gradients
flow through the keys and values of the selected blocks, not into the choice. The sparse layer
wraps the selection in `mx.stop_gradient` for this (MLX cannot differentiate a gather with
respect to its indices), so the compressed keys learn only through the attention they feed,
unless `select_weight` adds the selection loss of `selection.py`: the compressed-key scores
taught to point where the dense attention goes.

Loss: cross-entropy on the answer tokens and the end-of-turn token only (the prompt is given),
of every turn when samples carry follow-up questions (`turns`). A run may start from an earlier
checkpoint (`init`: a curriculum's next stage, e.g. longer documents with sparse mode earlier).
A curriculum starts with the warm-up kinds of `data.py` (`induction`, `lookup`, `recall`);
`eval_kinds` names what every evaluation measures (always the held-out split), e.g. `needle`.
AdamW, linear warmup then cosine decay to a tenth, global-norm clipping. Deterministic: the
initial weights come from numpy's generator (`random_weights`), the samples from (seed, index),
the batch lengths from the seed.

Output folder: a checkpoint `load_model` / `salabatch.load` reads (config.json, model.safetensors,
the builtin model's tokenizer files), plus `training.json` (the TrainConfig from the start, a
summary at the end) and `loss.jsonl` (one line per step: step, loss, lr, grad norm, tokens,
seconds; eval lines too).
On a Linux CPU call `salabatch.engine.activate_blas()` before mlx is imported (`salabatch train`
does): MLX's own reference BLAS trains ~15x slower; `train` warns, and training.json says which.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from salabatch.demo.checkpoint import random_weights, sala_config
from salabatch.engine import blas
from salabatch.engine.checkpoint import write_weights
from salabatch.engine.config import ModelConfig
from salabatch.engine.model import Model
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.errors import ConfigError, OutputError
from salabatch.models import resolve_model
from salabatch.train.data import END_OF_TURN, EVAL, KINDS, TRAIN, TaskGenerator
from salabatch.train.deepen import deepen
from salabatch.train.scoring import Batch, evaluate, loss_fn, make_batch
from salabatch.train.selection import loss_with_selection

NOTE = "trained by `salabatch train` on synthetic document questions (see training.json)"


def model_config(
    vocab_size: int,
    eos: Sequence[int],
    *,
    hidden: int = 256,
    intermediate: int = 640,
    layers: int = 8,
    heads: int = 16,
    kv_heads: int = 2,
    head_dim: int = 16,
    dense_len: int = 2048,
    window: int = 256,
    topk: int = 8,
) -> dict:
    """config.json of a small MiniCPM-SALA: layers 3, 7, 11, … sparse (1 in 4, as the 9B's 8 of
    32), the rest lightning; the block geometry is InfLLM-v2's fixed one (SPEC P14).

    The lightning layers have `heads` heads, and their decays follow the head count (SPEC,
    lightning 5): with 4 heads the fastest keeps 0.78 of its state per token, with 16 heads
    0.49. The copy the tasks need wants that fast head, to tell the last token from the ones
    before it (benchmarks/HISTORY.md, "Stage 2"), so the default is 16 heads."""
    if layers < 4 or layers % 4:
        raise ConfigError("layers must be a multiple of 4", field="layers", got=layers)
    # the sparse layer last in each group of 4: it reads keys the lightning layers before it
    # have mixed with their neighbours (what a retrieval head needs)
    return sala_config(
        vocab=vocab_size,
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        sparse_layers=range(3, layers, 4),
        sparse={"window_size": window, "topk": topk, "dense_len": dense_len},
        eos=eos,
        note=NOTE,
    )


@dataclass(frozen=True)
class TrainConfig:
    """What a run trains; saved in training.json. Batch lengths are drawn per step in
    [min_length, length] tokens (min_length 0: always `length`); `samples` > 0 cycles over
    that many fixed samples (overfitting checks) instead of a fresh sample every time.

    A length curriculum: with `grow_from` > 0 the longest sample starts there and doubles (up to
    `length`) after each evaluation whose held-out token accuracy, measured at the current
    longest, reaches `grow_at`. A circuit learned on short samples does not carry to longer
    ones by itself (benchmarks/HISTORY.md, "Stage 1"), so each length is reached only once the
    one before it is solved."""

    out: str
    steps: int = 2000
    seed: int = 0
    length: int = 3072
    min_length: int = 0
    batch: int = 1
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    kinds: tuple[str, ...] = KINDS
    turns: int = 1
    init: str | None = None  # a checkpoint folder to start from instead of random weights
    samples: int = 0
    eval_every: int = 200
    eval_samples: int = 64  # per eval kind; 16 moved a kind's score by ±7 points
    eval_kinds: tuple[str, ...] = ()  # the kinds evaluated (EVAL split); empty: `kinds`
    model: dict = field(default_factory=dict)  # model_config's size arguments
    grow_from: int = 0  # the first longest sample of a length curriculum (0: none)
    grow_at: float = 0.8  # the held-out token accuracy that doubles it
    select_weight: float = 0.0  # weight of the selection loss (selection.py); 0: none
    deepen: int = 0  # with `init`: this many layers added, identities at first (deepen.py)
    deepen_front: bool = False  # add them in front of the trained layers, not behind

    def __post_init__(self) -> None:
        if not 0 <= self.min_length <= self.length:
            raise ConfigError("need 0 <= min_length <= length", got=(self.min_length, self.length))
        if self.deepen and not self.init:
            raise ConfigError("deepening needs a checkpoint to start from", field="init", got=None)
        if self.deepen_front and not self.deepen:
            raise ConfigError("nothing to add in front", field="deepen", got=0)
        if self.grow_from and not self.eval_samples:
            raise ConfigError("a length curriculum needs evaluations", field="eval_samples", got=0)
        if self.grow_from and not max(self.min_length, 1) <= self.grow_from <= self.length:
            raise ConfigError(
                "need min_length <= grow_from <= length",
                field="grow_from",
                got=(self.min_length, self.grow_from, self.length),
            )
        unknown = sorted(set(self.model) - set(inspect.signature(model_config).parameters))
        if unknown or "vocab_size" in self.model or "eos" in self.model:
            raise ConfigError("unknown model sizes", field="model", got=unknown or self.model)
        for name in ("steps", "batch"):
            if getattr(self, name) < 1:
                raise ConfigError("must be at least 1", field=name, got=getattr(self, name))


def schedule(cfg: TrainConfig) -> Callable[[mx.array], mx.array]:
    """Linear warmup to `lr`, then cosine decay to lr / 10 at the last step."""
    warmup = min(cfg.warmup, cfg.steps - 1)
    cosine = optim.cosine_decay(cfg.lr, max(cfg.steps - warmup, 1), end=cfg.lr / 10)
    if warmup == 0:
        return cosine
    return optim.join_schedules(
        [optim.linear_schedule(cfg.lr / warmup, cfg.lr, warmup), cosine], [warmup]
    )


def train(
    cfg: TrainConfig,
    log: Callable[[dict], None] = lambda record: None,
    cache_dir: str | Path | None = None,
) -> Path:
    """Trains, writes the checkpoint folder `cfg.out` and returns it; `log` gets every record
    written to loss.jsonl as it happens. `cfg.out`/best holds the checkpoint with the lowest
    held-out loss (at the longest eval length reached), marked `"best": true` in loss.jsonl.
    `cache_dir`: where builtin:random (the tokenizer's source) is built, default the user's cache
    dir."""
    out = Path(cfg.out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot make the folder ({e.strerror or e})", path=out) from None
    # a run into the same folder starts over: an earlier run's best is no checkpoint of this one
    shutil.rmtree(out / "best", ignore_errors=True)
    _write_record(out, cfg, None)  # a run stopped early still says how it was made
    if blas.active().kind == "reference" and mx.default_device() == mx.cpu:
        # measured 15x slower fwd+bwd at hidden 128 than with OpenBLAS on the 2-core dev box
        warnings.warn(
            "MLX runs on its reference BLAS: call salabatch.engine.activate_blas() before "
            "importing mlx.core (`salabatch train` does)",
            blas.BlasWarning,
            stacklevel=2,
        )
    source = resolve_model("builtin:random", cache_dir)  # its tokenizer files are copied
    tok = load_tokenizer(source)
    eos = [2, tok.token_id(END_OF_TURN)]
    if cfg.init:  # go on from a checkpoint this function wrote (a curriculum's next stage)
        init = Path(cfg.init).expanduser()
        raw = json.loads((init / "config.json").read_text())
        if raw.get("quantization") or raw.get("quantization_config"):
            raise ConfigError(
                "a quantized checkpoint cannot be trained on: give the float one it was "
                "converted from",
                path=init,
                field="init",
            )
        raw = _restage(raw, cfg.model)
        model = Model(ModelConfig.from_dict(raw))
        model.load_weights(str(init / "model.safetensors"))
        if cfg.deepen:
            raw, model = deepen(raw, model, cfg.deepen, cfg.seed, front=cfg.deepen_front)
    else:
        raw = model_config(tok.vocab_size, eos, **cfg.model)
        model = Model(ModelConfig.from_dict(raw))
        model.load_weights(list(random_weights(model.config, cfg.seed).items()))
    mx.random.seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)

    train_gen = TaskGenerator(tok, split=TRAIN, seed=cfg.seed, kinds=cfg.kinds, turns=cfg.turns)
    longest = cfg.grow_from or cfg.length
    eval_sets = _eval_sets(tok, cfg, longest)
    optimizer = optim.AdamW(learning_rate=schedule(cfg), weight_decay=cfg.weight_decay)
    objective = loss_fn
    if cfg.select_weight:
        objective = partial(loss_with_selection, weight=cfg.select_weight)
    step_fn = nn.value_and_grad(model, objective)

    records = []
    best = (0, -math.inf)  # (eval length, -held-out loss) of out/best: the larger is kept
    with (out / "loss.jsonl").open("w") as sink:

        def emit(record: dict) -> None:
            records.append(record)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            log(record)

        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            if cfg.samples or not cfg.min_length:
                length = longest
            else:
                length = int(rng.integers(cfg.min_length, longest + 1))
            if cfg.samples:
                indices = [(step * cfg.batch + j) % cfg.samples for j in range(cfg.batch)]
            else:
                indices = [step * cfg.batch + j for j in range(cfg.batch)]
            batch = make_batch([train_gen.encoded(i, length) for i in indices], pad_id=2)
            lr = float(optimizer.learning_rate)
            loss, grads = step_fn(model, batch)
            grads, norm = optim.clip_grad_norm(grads, cfg.clip)
            optimizer.update(model, grads)
            mx.eval(loss, norm, model.parameters(), optimizer.state)
            record = {
                "step": step,
                "loss": float(loss),
                "lr": lr,
                "grad_norm": float(norm),
                "tokens": batch.tokens,
                "seconds": round(time.perf_counter() - t0, 4),
            }
            if not math.isfinite(record["loss"]):
                raise ConfigError(f"loss is {record['loss']} at step {step}", path=out)
            if cfg.eval_samples and (step % cfg.eval_every == 0 or step == cfg.steps):
                record |= evaluate(model, eval_sets) | {"longest": longest}
                # held-out loss rises once a stage learns its training split by heart, so the
                # lowest one is kept apart; a longer eval length starts a new comparison
                if (longest, -record["eval_loss"]) > best:
                    best = (longest, -record["eval_loss"])
                    record["best"] = True
                    _save(out / "best", model, raw, source)
                if (
                    longest < cfg.length
                    and cfg.grow_from
                    and record["eval_token_acc"] >= cfg.grow_at
                ):
                    longest = min(2 * longest, cfg.length)
                    eval_sets = _eval_sets(tok, cfg, longest)
            emit(record)
            if step % cfg.eval_every == 0 and step < cfg.steps:  # a checkpoint to look at
                _save(out, model, raw, source)

    _save(out, model, raw, source)
    seconds = sum(r["seconds"] for r in records)
    summary = {
        "final_loss": records[-1]["loss"],
        "seconds": seconds,
        "tokens_per_second": sum(r["tokens"] for r in records) / max(seconds, 1e-9),
        "blas": blas.active().kind,
    }
    summary |= {k: v for k, v in records[-1].items() if k.startswith("eval_")}
    summary["best_step"] = next((r["step"] for r in reversed(records) if r.get("best")), None)
    _write_record(out, cfg, summary)
    return out


def _write_record(out: Path, cfg: TrainConfig, summary: dict | None) -> None:
    """training.json: the config, and the summary once the run has finished (else null)."""
    record = {"config": asdict(cfg), "summary": summary}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def _eval_sets(tok, cfg: TrainConfig, length: int) -> dict[str, list[Batch]]:
    """The held-out samples every evaluation measures: `eval_samples` of each eval kind (one
    batch each, at the longest training length so far, with as many turns as training asks),
    by kind."""
    sets = {}
    for kind in cfg.eval_kinds or cfg.kinds:
        gen = TaskGenerator(tok, split=EVAL, seed=cfg.seed, kinds=(kind,), turns=cfg.turns)
        sets[kind] = [
            make_batch([gen.encoded(i, length)], pad_id=2) for i in range(cfg.eval_samples)
        ]
    return sets


def _restage(raw: dict, sizes: dict) -> dict:
    """A checkpoint's config.json with the sparse settings of `model_config` arguments that a
    later stage may change (the weights do not depend on them); any other size is an error."""
    names = {"dense_len": "dense_len", "window": "window_size", "topk": "topk"}
    if set(sizes) - set(names):
        raise ConfigError(
            "a stage that starts from a checkpoint keeps its shape; only dense_len, window "
            "and topk may change",
            field="model",
            got=sorted(sizes),
        )
    sparse = raw["sparse_config"] | {names[k]: v for k, v in sizes.items()}
    return raw | {"sparse_config": sparse}


def _save(out: Path, model: Model, raw: dict, source: Path) -> None:
    """config.json, model.safetensors and the tokenizer files of `source`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_weights(out, dict(tree_flatten(model.parameters())))
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != "config.json" and f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
