"""`deepen`: layers added behind (or in front of) a trained model start as identities, so the
deeper model computes what the trained one does, and training moves the new layers from there."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from salabatch.demo.checkpoint import random_weights
from salabatch.engine.config import ModelConfig
from salabatch.engine.load import load_model
from salabatch.engine.model import Model
from salabatch.errors import ConfigError
from salabatch.train.deepen import deepen
from salabatch.train.train import TrainConfig, model_config, train
from tests.train.test_train import TINY

IDS = mx.array([[(7 * i + 5) % 1000 for i in range(300)]])  # past dense_len 256: sparse runs


@pytest.fixture(scope="module")
def trained():
    raw = model_config(1024, [2], **TINY)
    model = Model(ModelConfig.from_dict(raw))
    model.load_weights(list(random_weights(model.config, 3).items()))
    return raw, model


def test_the_deeper_model_computes_what_the_trained_one_does(trained):
    raw, model = trained
    new_raw, deeper = deepen(raw, model, 8, seed=1)
    assert new_raw["num_hidden_layers"] == 12 and raw["num_hidden_layers"] == 4
    assert new_raw["mixer_types"] == raw["mixer_types"] * 3  # the 1:3 mix, sparse last
    a, b = model(IDS), deeper(IDS)
    err = (mx.abs(a - b).max() / mx.abs(a).max()).item()
    print(f"deepened logits: max error {err:.2e} of the largest")
    assert err < 1e-5
    weights = dict(tree_flatten(deeper.parameters()))
    new = [n for n in weights if ".layers.4." in n or ".layers.11." in n]
    assert new and all(
        (mx.abs(weights[n]).max().item() == 0) == n.endswith(("o_proj.weight", "down_proj.weight"))
        for n in new
    )


def test_layers_added_in_front_leave_the_logits_and_move_the_trained_layers(trained):
    raw, model = trained
    new_raw, deeper = deepen(raw, model, 4, seed=1, front=True)
    a, b = model(IDS), deeper(IDS)
    err = (mx.abs(a - b).max() / mx.abs(a).max()).item()
    print(f"deepened in front: max error {err:.2e} of the largest")
    assert err < 1e-5
    old, new = dict(tree_flatten(model.parameters())), dict(tree_flatten(deeper.parameters()))
    q = "model.layers.{}.self_attn.q_proj.weight"
    assert mx.array_equal(new[q.format(7)], old[q.format(3)])  # the trained sparse layer, moved
    assert mx.abs(new["model.layers.3.self_attn.o_proj.weight"]).max().item() == 0  # fresh


def test_bad_layer_counts_are_refused(trained, tmp_path):
    raw, model = trained
    for layers in (0, 2, 6):
        with pytest.raises(ConfigError, match="groups of 4"):
            deepen(raw, model, layers, seed=0)
    with pytest.raises(ConfigError, match="needs a checkpoint"):
        TrainConfig(out=str(tmp_path), deepen=4)
    with pytest.raises(ConfigError, match="in front"):
        TrainConfig(out=str(tmp_path), init=str(tmp_path), deepen_front=True)


def test_a_stage_deepens_its_init_and_trains_the_new_layers(tmp_path, models_dir):
    common = dict(length=160, batch=1, warmup=0, eval_samples=0, kinds=("needle",))
    first = TrainConfig(out=str(tmp_path / "a"), steps=1, model=TINY, **common)
    a = train(first, cache_dir=models_dir)
    second = TrainConfig(out=str(tmp_path / "b"), steps=2, init=str(a), deepen=4, **common)
    b = train(second, cache_dir=models_dir)
    assert json.loads((b / "config.json").read_text())["num_hidden_layers"] == 8
    assert json.loads((b / "training.json").read_text())["config"]["deepen"] == 4
    weights = dict(tree_flatten(load_model(b).parameters()))
    assert mx.abs(weights["model.layers.7.mlp.down_proj.weight"]).max().item() > 0  # trained
