"""config.json → ModelConfig: every SPEC §1 field, derived values, errors that name the field."""

from __future__ import annotations

import json
import math

import pytest

from salabatch.engine.config import LIGHTNING, SPARSE, ModelConfig
from salabatch.errors import ConfigError
from tests.tiny import tiny_config_dict

SPARSE_9B = {0, 9, 16, 17, 22, 29, 30, 31}


def config_9b() -> dict:
    """The released 9B config.json (SPEC §1.1), as transformers 4.57 saves it."""
    return {
        "architectures": ["MiniCPMSALAForCausalLM"],
        "model_type": "minicpm_sala",
        "vocab_size": 73448,
        "hidden_size": 4096,
        "intermediate_size": 16384,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "lightning_nh": 32,
        "lightning_nkv": 32,
        "lightning_head_dim": 128,
        "lightning_scale": "1/sqrt(d)",
        "lightning_use_rope": True,
        "attn_use_rope": False,
        "attn_use_output_gate": True,
        "use_output_gate": True,
        "use_output_norm": True,
        "qk_norm": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 524288,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 256,
        "mup_denominator": 32,
        "initializer_range": 0.1,
        "pretraining_tp": 1,
        "shift_labels": True,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "pad_token_id": 2,
        "eos_token_id": [2, 73440],
        "dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "mixer_types": ["minicpm4" if i in SPARSE_9B else "lightning-attn" for i in range(32)],
        "sparse_config": {
            "block_size": 64,
            "dense_len": 8192,
            "init_blocks": 1,
            "kernel_size": 32,
            "kernel_stride": 16,
            "topk": 64,
            "use_nope": False,
            "window_size": 2048,
        },
    }


def test_9b_config_fields_and_derived_values():
    cfg = ModelConfig.from_dict(config_9b())
    assert cfg.sparse_layers == tuple(sorted(SPARSE_9B))
    assert cfg.layer_kinds.count(LIGHTNING) == 24
    assert math.isclose(cfg.residual_scale, 1.4 / math.sqrt(32))
    assert cfg.logit_divisor == 16
    assert math.isclose(cfg.lightning_scale_value, 1 / math.sqrt(128))
    assert cfg.sparse.topk_eff == 96 and cfg.sparse.local_blocks == 32
    assert cfg.sparse.dense_len == 8192
    # level 1 as configured, level 2 derived: 4× both (SPEC §4.3)
    assert cfg.sparse.compression == ((32, 16), (128, 64)) and cfg.sparse.block_size == 64
    assert cfg.eos_token_ids == (2, 73440)
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.scale_emb == 12.0 and cfg.mup_denominator == 32
    assert cfg.context_length == 1 << 20  # 1M tokens, not the RoPE table's 524,288
    # keys the model does not use are kept, not dropped
    assert cfg.extra["initializer_range"] == 0.1
    assert cfg.extra["transformers_version"] == "4.57.1"
    assert "sparse_config" not in cfg.extra  # every key of the released one is used


def test_unused_sparse_config_keys_are_kept_nested():
    """An unknown key inside sparse_config is kept under extra["sparse_config"], as top-level
    ones are kept under their name (convert keeps both on disk)."""
    raw = config_9b()
    raw["sparse_config"] |= {"foo": 1, "nested": {"a": [2]}}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.extra["sparse_config"] == {"foo": 1, "nested": {"a": [2]}}
    assert cfg.sparse.topk == 64


@pytest.mark.parametrize("spelling", ["lightning", "lightning_attn", "lightning-attn"])
def test_mixer_spellings(spelling):
    cfg = ModelConfig.from_dict(tiny_config_dict(mixers=("minicpm4", spelling)))
    assert cfg.layer_kinds == (SPARSE, LIGHTNING)


def test_golden_config_loads(golden_dir):
    cfg = ModelConfig.from_file(golden_dir)
    assert cfg.layer_kinds == (SPARSE, LIGHTNING, LIGHTNING, SPARSE, LIGHTNING, SPARSE)
    assert cfg.sparse.topk_eff == 12 and cfg.eos_token_ids == (2,)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.update(num_hidden_layers="32"), "num_hidden_layers"),
        (lambda c: c.update(qk_norm=1), "qk_norm"),
        (lambda c: c.update(vocab_size=True), "vocab_size"),
        (lambda c: c["mixer_types"].__setitem__(3, "mamba"), "mixer_types[3]"),
        (lambda c: c["mixer_types"].__setitem__(3, ["minicpm4"]), "mixer_types[3]"),
        (lambda c: c["mixer_types"].pop(), "mixer_types"),
        (lambda c: c["sparse_config"].update(topk=-1), "sparse_config.topk"),
        (lambda c: c["sparse_config"].update(block_size=128), "sparse_config.block_size"),
        (lambda c: c["sparse_config"].update(kernel_size=64), "sparse_config.kernel_size"),
        (lambda c: c["sparse_config"].update(kernel_stride=32), "sparse_config.kernel_stride"),
        (lambda c: c.update(lightning_nh=16), "lightning_nh"),
        (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        # muP multipliers have no safe default: a guess would change every logit silently
        (lambda c: c.pop("scale_emb"), "scale_emb"),
        (lambda c: c.pop("scale_depth"), "scale_depth"),
        (lambda c: c.pop("dim_model_base"), "dim_model_base"),
        # another scheme's packing: refused by name, not as a list of unexpected tensors
        (
            lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
            "quantization_config.quant_method",
        ),
    ],
)
def test_errors_name_file_and_field(tmp_path, change, field):
    raw = config_9b()
    change(raw)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_file(tmp_path)
    assert e.value.field == field
    assert str(path) in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps", "scale_emb", "scale_depth"])
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("NaN", "a finite number"),
        ("Infinity", "a finite number"),
        ("-Infinity", "a finite number"),
        ("1e999", "a finite number"),
        ("0", "> 0"),
        ("-2.5", "> 0"),
    ],
)
def test_float_fields_are_finite_and_positive(tmp_path, field, value, expected):
    """Python's JSON reads NaN, Infinity and 1e999; a non-finite rope_theta made every logit NaN
    and generate printed nothing. Each float field is refused by name, as is a zero or negative
    one (no epsilon, RoPE base or muP multiplier is <= 0)."""
    raw = config_9b()
    raw[field] = "@"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw).replace('"@"', value))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_file(tmp_path)
    assert (e.value.field, e.value.expected) == (field, expected)
    assert str(e.value).startswith(f"{path}: {field}: must be")


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)


def test_an_mlx_quantization_config_alone_is_read_as_quantization(tmp_path):
    # mlx-lm writes both `quantization` and `quantization_config`; one with the latter alone
    # was taken for full precision and then failed on its .scales and .biases
    raw = config_9b()
    raw["quantization_config"] = {"group_size": 64, "bits": 8}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    cfg = ModelConfig.from_file(path)
    assert (cfg.quantization.group_size, cfg.quantization.bits) == (64, 8)
