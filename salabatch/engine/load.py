"""Checkpoint directory → Model, and the checks `salabatch validate` runs on one.

A directory holds `config.json` and safetensors with HF names: one `model.safetensors`, or shards
listed in `model.safetensors.index.json`. Loading is strict: every tensor the config implies must be
present with its shape and a dtype of its kind (any float for a float parameter, uint32 for a
packed quantized weight), and nothing else may be. An MLX-quantized checkpoint (`"quantization"` in
the config, `.weight` / `.scales` / `.biases` per quantized linear) first gets its quantized layers
(see quantize.py), so the strict check expects their tensors. Float weights, and the scales and
biases of quantized layers, take `dtype`, which is therefore the activation dtype whatever the
weight format; the lightning state stays float32 whatever it is.

The loaded model holds only evaluated arrays, so it runs on any thread, not just the loading one
(MLX binds an unevaluated op to the stream of the thread that made it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from salabatch.engine.checkpoint import check_weights, read_weights, weight_files
from salabatch.engine.config import ModelConfig
from salabatch.engine.model import Model
from salabatch.engine.quantize import quantize_like
from salabatch.engine.runtime import resolve_dtype
from salabatch.engine.tokenizer import Tokenizer, load_tokenizer
from salabatch.errors import SalabatchError


def load_model(
    path: str | Path, dtype: str | mx.Dtype | None = None, *, tokens: int | None = None
) -> Model:
    """Loads a checkpoint directory; `dtype` None / "auto" = float32 on CPU, bfloat16 on a GPU;
    `tokens`: its tokenizer's size, where the model is used with it (`Model.limit_vocab`)."""
    path = Path(path).expanduser()
    model, weights = _checked(path)
    dt = dtype if isinstance(dtype, mx.Dtype) else resolve_dtype(dtype)
    weights = {
        k: w.astype(dt) if mx.issubdtype(w.dtype, mx.floating) else w for k, w in weights.items()
    }
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    model.fuse()
    model.path = path
    model.dtype = dt
    if tokens is not None:
        model.limit_vocab(tokens)
    return model


def _checked(path: Path) -> tuple[Model, dict[str, mx.array]]:
    """The model structure of `path` and its weights, checked against each other by name and
    shape. The weights are not read yet: `mx.load` reads a safetensors header, the data later."""
    cfg = ModelConfig.of_checkpoint(path)
    model = Model(cfg)  # its random init is lazy, and replaced before anything evaluates it
    weights = model.sanitize(read_weights(path))
    if cfg.quantization is not None:
        quantize_like(model, cfg.quantization, weights, path)
    check_weights(model, weights, path)
    return model, weights


@dataclass
class CheckpointReport:
    """What `check_checkpoint` found: one line per problem, and the parts that loaded."""

    problems: list[str]
    config: ModelConfig | None = None
    tokenizer: Tokenizer | None = None
    weight_files: list[Path] = field(default_factory=list)


def check_checkpoint(path: str | Path) -> CheckpointReport:
    """Checks a checkpoint folder without reading its weight data: config.json parses, the
    tokenizer loads, the weight files hold exactly the tensors the config implies (by name and
    shape, from their headers), and the tokenizer's ids fit the model's vocabulary (which
    `load_tokenizer` checks, for every caller)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return CheckpointReport([f"{path}: not a directory"])
    report = CheckpointReport([])
    try:
        report.config = _checked(path)[0].config
        report.weight_files = weight_files(path)
    except SalabatchError as e:
        report.problems.append(str(e))
    try:
        report.tokenizer = load_tokenizer(path)
    except SalabatchError as e:
        if str(e) not in report.problems:  # config.json's problem, read for its ids too
            report.problems.append(str(e))
    return report
