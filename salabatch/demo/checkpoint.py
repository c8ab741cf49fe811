"""Small model configs and random-weight checkpoints: `builtin:random`, the tests' tiny models,
the benchmarks' models and the shapes `salabatch train` starts from.

UNTRAINED: the weights are deterministic noise (numpy's generator, so the same bytes on every
platform), good for running and timing the engine, never for its answers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from salabatch.engine.checkpoint import write_weights
from salabatch.engine.config import ModelConfig, SparseConfig
from salabatch.engine.model import Model

if TYPE_CHECKING:
    import mlx.core as mx


def sala_config(
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    sparse_layers: Iterable[int],
    dim_model_base: int = 16,
    sparse: dict | None = None,
    eos: Sequence[int] = (2,),
    note: str | None = None,
) -> dict:
    """config.json of a MiniCPM-SALA of these sizes, with the released model's conventions for
    the rest: lightning layers with the sparse layers' head count and width (HF sizes both from
    the same fields), scale_emb 12 and scale_depth 1.4, bos 1 and pad 2, float32, and the 9B's
    InfLLM-v2 settings (SparseConfig's defaults) updated by `sparse`."""
    sparse_layers = set(sparse_layers)
    return {
        "architectures": ["MiniCPMSALAForCausalLM"],
        "model_type": "minicpm_sala",
        **({"salabatch_note": note} if note else {}),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "lightning_nh": heads,
        "lightning_nkv": heads,
        "lightning_head_dim": head_dim,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": dim_model_base,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": list(eos),
        "pad_token_id": 2,
        "mixer_types": [
            "minicpm4" if i in sparse_layers else "lightning-attn" for i in range(layers)
        ],
        "sparse_config": asdict(SparseConfig()) | (sparse or {}),
        "torch_dtype": "float32",
    }


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
