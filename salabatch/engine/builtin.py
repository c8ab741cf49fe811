"""`builtin:tiny`: a small MiniCPM-SALA made locally, so everything runs with no download.

It is UNTRAINED: its weights are random (deterministic) and the text it generates is
meaningless. It exists so that pipelines, tests, demos and benchmarks run anywhere. Both layer
kinds are present and its sparse layers switch to InfLLM-v2 at 2048 tokens, so a document of a
few thousand tokens exercises the real long-context path.

Built once into `<cache dir>/models/builtin-tiny-v1/` (config.json, model.safetensors,
tokenizer files); the same bytes on every machine.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from salabatch import files
from salabatch.errors import ConfigError

PREFIX = "builtin:"
VERSION = 1  # bump when the recipe changes: old builds stay where they are, unused
WARNING = "builtin:tiny is an untrained demo model: its answers are meaningless text"


def is_builtin(model: str | os.PathLike) -> bool:
    return str(model).startswith(PREFIX)


def resolve(model: str | os.PathLike, cache_dir: str | Path | None = None) -> Path:
    """A checkpoint directory for `model`: a path as given, or `builtin:tiny` built if needed."""
    if not is_builtin(model):
        return Path(model).expanduser()
    name = str(model)[len(PREFIX) :]
    if name != "tiny":
        raise ConfigError(
            "unknown builtin model", field="model", expected="builtin:tiny", got=str(model)
        )
    dest = Path(cache_dir or files.cache_dir()).expanduser() / "models" / f"builtin-tiny-v{VERSION}"
    if not (dest / "model.safetensors").is_file():
        _build(dest)
    return dest


def tiny_config(vocab_size: int, eos: list[int]) -> dict:
    return {
        "architectures": ["MiniCPMSALAForCausalLM"],
        "model_type": "minicpm_sala",
        "salabatch_note": WARNING,
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 640,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "lightning_nh": 8,
        "lightning_nkv": 8,
        "lightning_head_dim": 32,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 16,  # logits ÷ 16, as in the 9B
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": eos,
        "pad_token_id": 2,
        "mixer_types": [
            "minicpm4",
            "lightning-attn",
            "lightning-attn",
            "minicpm4",
            "lightning-attn",
            "minicpm4",
        ],
        "sparse_config": {
            "kernel_size": 32,
            "kernel_stride": 16,
            "block_size": 64,
            "init_blocks": 1,
            "window_size": 256,  # 4 local blocks
            "topk": 8,  # 12 blocks per query in all
            "use_nope": False,
            "dense_len": 2048,
        },
        "torch_dtype": "float32",
    }


def _build(dest: Path) -> None:
    """Writes the model into a private folder, then renames it into place (another process
    building at the same time loses the race harmlessly)."""
    from salabatch.engine.checkpoint import random_weights, write_weights
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.demo_tokenizer import build_byte_tokenizer

    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = build_byte_tokenizer(tmp, vocab_size=1024)
    im_end = vocab - 8  # the demo tokenizer puts <|im_end|> first of its last 8 ids
    raw = tiny_config(vocab, [2, im_end])
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_weights(tmp, random_weights(ModelConfig.from_dict(raw), seed=0))
    try:
        os.rename(tmp, dest)
    except OSError:  # someone else finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "model.safetensors").is_file():
            raise
