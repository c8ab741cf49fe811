"""Training through the project's own Model: the loss falls, the folder loads, gradients flow
through the sparse (InfLLM-v2) path."""

import json
import math
import shutil
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from salabatch.engine.config import ModelConfig
from salabatch.engine.kernels.gla import decay_slopes
from salabatch.engine.load import load_model
from salabatch.engine.model import Model
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.errors import ConfigError, OutputError
from salabatch.models import resolve_model
from salabatch.train.data import EVAL, TaskGenerator
from salabatch.train.scoring import answer_logits, evaluate, loss_fn, make_batch
from salabatch.train.train import TrainConfig, model_config, train

# 4 layers (3 lightning, 1 sparse), sparse mode from 256 tokens
TINY = dict(
    hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16,
    dense_len=256, window=128, topk=2,
)  # fmt: skip


def test_model_config_keeps_the_9b_layout():
    raw = model_config(1024, [2, 1016], layers=8)
    assert raw["mixer_types"].count("minicpm4") == 2 and raw["mixer_types"][3] == "minicpm4"
    cfg = ModelConfig.from_dict(raw)
    assert not cfg.attn_use_rope and cfg.lightning_use_rope
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    with pytest.raises(ConfigError, match="multiple of 4"):
        model_config(1024, [2], layers=6)


def test_model_config_has_a_fast_lightning_head():
    # the copy needs a head that forgets fast: the decays follow the head count (SPEC 5)
    cfg = ModelConfig.from_dict(model_config(1024, [2]))
    assert math.exp(-max(decay_slopes(cfg.lightning_heads))) < 0.5
    assert cfg.lightning_heads * cfg.lightning_head_dim == cfg.hidden_size  # as in the 9B


def test_loss_masks_everything_but_the_answer(tokenizer):
    gen = TaskGenerator(tokenizer, seed=0)
    encoded = [gen.encode(gen.sample(i, 200 + 50 * i)) for i in range(2)]
    batch = make_batch(encoded, pad_id=2)
    for b, e in enumerate(encoded):
        n = len(e.ids) - e.answer_start
        assert batch.mask[b].sum().item() == n
        # the input at each target position is the token before that target
        at = batch.at[b, :n].tolist()
        assert [batch.inputs[b, p + 1].item() for p in at[:-1]] == e.ids[e.answer_start : -1]
        assert batch.targets[b, :n].tolist() == e.ids[e.answer_start :]


def test_short_run_overfits_and_writes_a_loadable_model(tmp_path, models_dir):
    cfg = TrainConfig(
        out=str(tmp_path / "run"), steps=60, seed=0, length=160, batch=2, lr=3e-3, warmup=5,
        samples=2, eval_samples=1, eval_every=60, model=TINY, kinds=("needle",),
    )  # fmt: skip
    early = []  # training.json while the run goes on: its config, no summary yet

    def log(record: dict) -> None:
        early.append(json.loads((tmp_path / "run" / "training.json").read_text()))

    out = train(cfg, cache_dir=models_dir, log=log)
    assert early[0]["config"]["steps"] == 60 and early[0]["summary"] is None
    lines = [json.loads(x) for x in (out / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 61)) and "eval_exact" in lines[-1]
    first, last = lines[0]["loss"], sum(r["loss"] for r in lines[-5:]) / 5
    assert last < 0.3 * first, (first, last)
    assert json.loads((out / "training.json").read_text())["config"]["steps"] == 60

    model, tok = load_model(out), load_tokenizer(out)
    gen = TaskGenerator(tok, seed=0, kinds=("needle",))
    e = gen.encode(gen.sample(1, 160))
    prompt, target = e.ids[: e.answer_start], e.ids[e.answer_start :]
    cache = model.make_cache()  # greedy decoding through the cache, as `run` does
    logits = model(mx.array([prompt]), cache)
    answer = []
    for _ in range(len(target)):
        answer.append(logits[0, -1].argmax().item())
        if answer[-1] in tok.eos_ids:
            break
        logits = model(mx.array([answer[-1:]]), cache)
    assert answer == target


def test_induction_stage_learns_its_samples(tmp_path, models_dir):
    cfg = TrainConfig(
        out=str(tmp_path / "ind"), steps=40, seed=0, length=48, batch=2, lr=3e-3, warmup=5,
        samples=2, eval_samples=2, eval_every=40, model=TINY, kinds=("induction",),
    )  # fmt: skip
    lines = [json.loads(x) for x in (train(cfg, cache_dir=models_dir) / "loss.jsonl").open()]
    first, last = lines[0]["loss"], sum(r["loss"] for r in lines[-5:]) / 5
    assert last < 0.3 * first and 0 <= lines[-1]["eval_token_acc"] <= 1, (first, last)


def test_a_length_curriculum_doubles_the_longest_sample_once_it_is_solved(tmp_path, models_dir):
    def longest(grow_at: float) -> list[int]:
        cfg = TrainConfig(
            out=str(tmp_path / str(grow_at)), steps=8, length=128, min_length=32, grow_from=32,
            grow_at=grow_at, batch=1, warmup=0, eval_samples=1, eval_every=2, model=TINY,
            kinds=("induction",),
        )  # fmt: skip
        lines = [json.loads(x) for x in (train(cfg, cache_dir=models_dir) / "loss.jsonl").open()]
        return [r["longest"] for r in lines if "longest" in r]

    assert longest(0.0) == [32, 64, 128, 128]  # every evaluation passes: 32 -> 64 -> 128, no more
    # best/ is the lowest held-out loss at the longest length evaluated
    lines = [json.loads(x) for x in (tmp_path / "0.0" / "loss.jsonl").open()]
    at_128 = [r for r in lines if r.get("longest") == 128]
    kept = min(at_128, key=lambda r: r["eval_loss"])
    assert [r["step"] for r in lines if r.get("best")][-1] == kept["step"]
    summary = json.loads((tmp_path / "0.0" / "training.json").read_text())["summary"]
    assert summary["best_step"] == kept["step"]
    best = load_model(tmp_path / "0.0" / "best")
    gen = TaskGenerator(load_tokenizer(tmp_path / "0.0"), split=EVAL, kinds=("induction",))
    again = evaluate(best, {"induction": [make_batch([gen.encoded(0, 128)], pad_id=2)]})
    assert again["eval_loss"] == pytest.approx(kept["eval_loss"], rel=1e-5)
    assert longest(1.0) == [32, 32, 32, 32]  # an untrained model never reaches every token
    with pytest.raises(ConfigError, match="grow_from"):
        TrainConfig(out="x", length=128, min_length=64, grow_from=32)
    with pytest.raises(ConfigError, match="needs evaluations"):
        TrainConfig(out="x", length=128, grow_from=32, eval_samples=0)


def test_gradients_flow_through_the_sparse_path(models_dir):
    tok = load_tokenizer(resolve_model("builtin:random", models_dir))
    model = Model(ModelConfig.from_dict(model_config(tok.vocab_size, [2], **TINY)))
    gen = TaskGenerator(tok, seed=0)
    batch = make_batch([gen.encode(gen.sample(0, 420))], pad_id=2)
    assert batch.inputs.shape[1] > TINY["dense_len"]  # InfLLM-v2 block-sparse, not dense
    loss, grads = nn.value_and_grad(model, loss_fn)(model, batch)
    flat = dict(tree_flatten(grads))
    mx.eval(loss, flat)
    assert all(mx.isfinite(g).all().item() for g in flat.values())
    sparse = [n for n in flat if ".self_attn.k_proj" in n and "layers.3." in n]
    assert sparse and mx.abs(flat[sparse[0]]).max().item() > 0


def test_follow_up_turns_are_all_targets(tokenizer):
    gen = TaskGenerator(tokenizer, seed=0, turns=3, kinds=("needle",))
    e = gen.encode(gen.sample(0, 300))
    batch = make_batch([e, TaskGenerator(tokenizer, seed=0).encode(gen.sample(1, 200))], 2)
    positions = [p for start, stop in e.targets for p in range(start, stop)]
    assert len(e.targets) == 3 and batch.mask[0].sum().item() == len(positions)
    assert batch.targets[0, : len(positions)].tolist() == [e.ids[p] for p in positions]
    assert batch.at[0, : len(positions)].tolist() == [p - 1 for p in positions]


def test_a_stage_goes_on_from_a_checkpoint_with_new_sparse_settings(tmp_path, models_dir):
    first = TrainConfig(
        out=str(tmp_path / "a"), steps=2, length=160, batch=1, warmup=0, eval_samples=0,
        model=TINY, kinds=("needle",),
    )  # fmt: skip
    a = train(first, cache_dir=models_dir)
    second = TrainConfig(
        out=str(tmp_path / "b"), steps=1, length=160, batch=1, warmup=0, eval_samples=0,
        init=str(a), model={"dense_len": 128}, kinds=("needle",),
    )  # fmt: skip
    (tmp_path / "b" / "best").mkdir(parents=True)  # an earlier run's, of another model
    b = train(second, cache_dir=models_dir)
    assert not (b / "best").exists()  # this run evaluated nothing: it has no best
    raw = json.loads((b / "config.json").read_text())
    assert raw["sparse_config"]["dense_len"] == 128 and raw["hidden_size"] == TINY["hidden"]
    with pytest.raises(ConfigError, match="keeps its shape"):
        train(TrainConfig(out=str(tmp_path / "c"), steps=1, init=str(a), model={"hidden": 32}))
    with pytest.raises(ConfigError, match="unknown model sizes"):
        TrainConfig(out=str(tmp_path / "d"), model={"width": 3})
    quantized = tmp_path / "q"
    shutil.copytree(a, quantized)
    raw = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(raw | {"quantization": {"bits": 4}}))
    with pytest.raises(ConfigError, match="a quantized checkpoint cannot be trained on"):
        train(TrainConfig(out=str(tmp_path / "e"), steps=1, init=str(quantized)))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match="cannot make the folder"):
        train(TrainConfig(out=str(tmp_path / "afile" / "run"), steps=1))


def test_cli_reads_model_sizes_and_refuses_bad_ones(tmp_path):
    from click.testing import CliRunner

    from salabatch.cli import main

    bad = CliRunner().invoke(main, ["train", "--out", str(tmp_path), "--model", "hidden=wide"])
    assert bad.exit_code == 2 and "hidden=wide" in bad.output
    unknown = CliRunner().invoke(main, ["train", "--out", str(tmp_path), "--model", "width=3"])
    assert unknown.exit_code != 0 and "unknown model sizes" in unknown.output


def test_cli_trains_a_warm_up_stage_evaluated_on_another_kind(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from salabatch.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # builtin:random's tokenizer
    sizes = ",".join(f"{k}={v}" for k, v in TINY.items())
    args = ["--kinds", "induction", "--eval-kinds", "needle", "--length", "40", "--steps", "2"]
    args += ["--eval-samples", "3"]
    out = CliRunner().invoke(
        main, ["train", "--out", str(tmp_path / "i"), "--model", sizes, "--warmup", "0", *args]
    )
    assert out.exit_code == 0, out.output
    config = json.loads((tmp_path / "i" / "training.json").read_text())["config"]
    assert config["kinds"] == ["induction"] and config["eval_kinds"] == ["needle"]
    assert config["eval_samples"] == 3
    assert "eval_answers " in out.output  # the share of answers right, in the log


def test_a_recall_stage_evaluates_the_needle_kind_it_names(tmp_path, models_dir):
    cfg = TrainConfig(
        out=str(tmp_path / "r"), steps=2, length=200, batch=2, warmup=0, eval_samples=2,
        eval_every=2, model=TINY, kinds=("recall",), eval_kinds=("needle",),
    )  # fmt: skip
    out = train(cfg, cache_dir=models_dir)
    summary = json.loads((out / "training.json").read_text())["summary"]
    assert {"eval_loss", "eval_exact", "eval_token_acc", "tokens_per_second", "blas"} <= set(
        summary
    )
    assert 0 <= summary["eval_token_acc"] <= 1 and summary["tokens_per_second"] > 0


def test_evaluate_counts_a_row_right_only_when_every_answer_token_is(models_dir):
    from salabatch.train.scoring import evaluate

    tok = load_tokenizer(resolve_model("builtin:random", models_dir))
    model = Model(ModelConfig.from_dict(model_config(tok.vocab_size, [2], **TINY)))
    gen = TaskGenerator(tok, seed=0, kinds=("recall",))
    batch = make_batch([gen.encode(gen.sample(0, 400))], pad_id=2)
    best = answer_logits(model, batch).argmax(-1)  # what the model predicts: all "right"
    mx.eval(best)
    right = replace(batch, targets=best)
    assert evaluate(model, [right])["eval_exact"] == 1.0
    n = int(batch.mask.sum().item())
    wrong = mx.where(mx.arange(best.shape[1]) == n - 1, (best + 1) % tok.vocab_size, best)
    result = evaluate(model, [replace(batch, targets=wrong)])
    assert result["eval_exact"] == 0.0 and result["eval_token_acc"] == (n - 1) / n
    answers = len(gen.encode(gen.sample(0, 400)).targets)  # recall asks every fact: several
    assert answers > 1 and result["eval_answers"] == (answers - 1) / answers
    # by kind: each kind scored on its own, and all of them together as one set
    by_kind = evaluate(model, {"a": [right], "b": [replace(batch, targets=wrong)]})
    assert by_kind["eval_exact_a"] == 1.0 and by_kind["eval_exact_b"] == 0.0
    assert by_kind["eval_exact"] == 0.5 and by_kind["eval_token_acc"] == (2 * n - 1) / (2 * n)
    assert by_kind["eval_loss"] == pytest.approx(
        (by_kind["eval_loss_a"] + by_kind["eval_loss_b"]) / 2
    )
