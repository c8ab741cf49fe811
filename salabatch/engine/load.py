"""Checkpoint directory → Model.

A directory holds `config.json` and safetensors with HF names: one `model.safetensors`, or shards
listed in `model.safetensors.index.json`. Loading is strict: every tensor the config implies must be
present with its shape, and nothing else may be. An MLX-quantized checkpoint (`"quantization"` in
the config, `.weight` / `.scales` / `.biases` per quantized linear) first gets its quantized layers
(see quantize.py), so the strict check expects their tensors. Float weights, and the scales and
biases of quantized layers, take `dtype`, which is therefore the activation dtype whatever the
weight format; the lightning state stays float32 whatever it is.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from salabatch.engine.checkpoint import check_weights, read_weights
from salabatch.engine.config import ModelConfig
from salabatch.engine.model import Model
from salabatch.engine.quantize import quantize_like
from salabatch.engine.runtime import resolve_dtype
from salabatch.errors import CheckpointError


def load_model(path: str | Path, dtype: str | mx.Dtype | None = None) -> Model:
    """Loads a checkpoint directory; `dtype` None / "auto" = float32 on CPU, bfloat16 on a GPU."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError("not a checkpoint directory", path=path)
    cfg = ModelConfig.from_file(path / "config.json")
    model = Model(cfg)
    weights = model.sanitize(read_weights(path))
    if cfg.quantization is not None:
        quantize_like(model, cfg.quantization, weights, path)
    check_weights(model, weights, path)
    dt = dtype if isinstance(dtype, mx.Dtype) else resolve_dtype(dtype)
    weights = {
        k: w.astype(dt) if mx.issubdtype(w.dtype, mx.floating) else w for k, w in weights.items()
    }
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    model.path = path
    model.dtype = dt
    return model
