"""Random-weight checkpoints: `builtin:random`, the tests' tiny models and the benchmarks' models.

UNTRAINED: the weights are deterministic noise (numpy's generator, so the same bytes on every
platform), good for running and timing the engine, never for its answers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from salabatch.engine.checkpoint import write_weights
from salabatch.engine.config import ModelConfig
from salabatch.engine.model import Model

if TYPE_CHECKING:
    import mlx.core as mx


def write_random_checkpoint(
    path: Path, raw: dict, seed: int = 0, max_shard_bytes: int | None = None
) -> Path:
    """A checkpoint directory: `raw` as config.json and `random_weights` of it; returns `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_weights(path, random_weights(ModelConfig.from_dict(raw), seed), max_shard_bytes)
    return path


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, mx.array]:
    """Deterministic float32 weights with HF names: N(0, 1/fan_in) projections, norms ≈ 1."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    shapes = {n: tuple(p.shape) for n, p in tree_flatten(Model(cfg).parameters())}
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:  # RMSNorm weights
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:  # [out, in] projections and the [vocab, hidden] embedding
            w = rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = mx.array(w.astype(np.float32))
    return out
