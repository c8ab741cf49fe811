"""A deeper model that starts as the trained one: fresh layers added, each an identity at first.

A small model's copy slips (a name cut after its first word, a month from another date) did not
yield to more steps at its depth (benchmarks/HISTORY.md, "Stage 5"). Training a deeper model from
the start costs the whole chain again, so `deepen` adds layers in groups of four (three
lightning, one sparse: the 9B's 1:3 mix and order) behind the trained ones, or in front of them
(`front`): a softmax layer before the trained retrieval layer can let a fact's later words read
its value, which a causal model's value tokens cannot (benchmarks/HISTORY.md, "Stage 7"):

- the new layers' residual branches end in zero (`o_proj` and `down_proj`), so each new layer
  adds nothing until training moves it; the rest of them is `random_weights`' init;
- every residual branch is scaled by `scale_depth / √L` (SPEC §2), so the trained layers' output
  projections are multiplied by √(L_new / L_old) to keep what each adds to the residual stream.

The deepened model's logits equal the trained model's up to rounding (a test checks it).
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx.utils import tree_flatten

from salabatch.demo.checkpoint import random_weights
from salabatch.engine.config import ModelConfig
from salabatch.engine.model import Model
from salabatch.errors import ConfigError

GROUP = ("lightning-attn", "lightning-attn", "lightning-attn", "minicpm4")
BRANCH_ENDS = ("o_proj.weight", "down_proj.weight")  # what a residual branch adds passes these


def deepen(
    raw: dict, model: Model, layers: int, seed: int, *, front: bool = False
) -> tuple[dict, Model]:
    """(config.json, model) with `layers` more layers behind `model`'s (in front of them with
    `front`; a multiple of 4), that computes what `model` computes; new weights are drawn from
    `seed`."""
    if layers <= 0 or layers % len(GROUP):
        raise ConfigError("layers are added in groups of 4", field="deepen", got=layers)
    old = raw["num_hidden_layers"]
    added = list(GROUP) * (layers // len(GROUP))
    mixers = list(raw["mixer_types"])
    new_raw = raw | {
        "num_hidden_layers": old + layers,
        "mixer_types": added + mixers if front else mixers + added,
    }
    cfg = ModelConfig.from_dict(new_raw)
    weights = random_weights(cfg, seed)
    shift = layers if front else 0  # where the trained layers go
    fresh = range(layers) if front else range(old, old + layers)
    scale = math.sqrt((old + layers) / old)
    for name, w in tree_flatten(model.parameters()):
        weights[_moved(name, shift)] = w * scale if name.endswith(BRANCH_ENDS) else w
    for name, w in weights.items():
        if _layer(name) in fresh and name.endswith(BRANCH_ENDS):
            weights[name] = mx.zeros_like(w)
    deeper = Model(cfg)
    deeper.load_weights(list(weights.items()))
    return new_raw, deeper


def _moved(name: str, shift: int) -> str:
    """A parameter name with its layer index moved by `shift` (a name outside the layers as is)."""
    index = _layer(name)
    if index < 0:
        return name
    return name.replace(f".layers.{index}.", f".layers.{index + shift}.", 1)


def _layer(name: str) -> int:
    """The layer index in a parameter name, -1 outside the layers."""
    head, sep, rest = name.partition(".layers.")
    return int(rest.split(".", 1)[0]) if sep else -1
