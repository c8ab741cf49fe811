"""Tiny random MiniCPM-SALA configs and checkpoints for tests (CPU, float32)."""

from __future__ import annotations

from pathlib import Path

from salabatch.demo.checkpoint import write_random_checkpoint
from tests import SHARED

GOLDEN = SHARED / "golden"

S, L = "minicpm4", "lightning-attn"


def tiny_config_dict(mixers=(S, L, L, S), **overrides) -> dict:
    """A small config with both layer kinds; sparse mode from `dense_len` (1024) tokens."""
    raw = {
        "architectures": ["MiniCPMSALAForCausalLM"],
        "model_type": "minicpm_sala",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": len(mixers),
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "lightning_nh": 8,
        "lightning_nkv": 8,
        "lightning_head_dim": 8,
        "lightning_scale": "1/sqrt(d)",
        "qk_norm": True,
        "use_output_norm": True,
        "use_output_gate": True,
        "attn_use_output_gate": True,
        "attn_use_rope": False,
        "lightning_use_rope": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 16,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": [2],
        "mixer_types": list(mixers),
        "sparse_config": {
            "kernel_size": 32,
            "kernel_stride": 16,
            "block_size": 64,
            "init_blocks": 1,
            "window_size": 128,
            "topk": 4,
            "use_nope": False,
            "dense_len": 1024,
        },
    }
    raw.update(overrides)
    return raw


# A config whose sparse layers switch to InfLLM-v2 at 256 tokens, 4 blocks per query.
SPARSE_AT_256 = {
    "sparse_config": {
        "kernel_size": 32,
        "kernel_stride": 16,
        "block_size": 64,
        "init_blocks": 1,
        "window_size": 128,  # 2 local blocks
        "topk": 2,  # 2 + 2 = 4 blocks selected per query
        "use_nope": False,
        "dense_len": 256,
    }
}

# The same 4-block selection, sparse from 512 tokens. In SPARSE_AT_256 a query below dense_len
# sees at most 4 blocks, so sparse attention there equals dense and no test can tell whether a
# chunk below dense_len ran the right mode; here a query at 256-511 sees 5-8 blocks and attends
# 4, as the 9B's (96 of up to 128 below its dense_len 8192).
SPARSE_AT_512 = {"sparse_config": {**SPARSE_AT_256["sparse_config"], "dense_len": 512}}


def write_tiny_checkpoint(
    path: Path, raw: dict | None = None, seed: int = 0, max_shard_bytes: int | None = None
) -> Path:
    return write_random_checkpoint(path, raw or tiny_config_dict(), seed, max_shard_bytes)
