"""MiniCPM-SALA model config: a frozen view of `config.json` (SPEC §1), built once.

Field names follow the HF `config.json`. Values the model derives (residual scale, logit divisor,
effective top-k, layer kinds) are computed here, so layers read them rather than recompute them.
Keys we do not use are kept in `extra`, never dropped: top-level ones by their name, those inside
`sparse_config` as `extra["sparse_config"]` (a dict of just those keys).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from salabatch.errors import ConfigError

SPARSE, LIGHTNING = "sparse", "lightning"
# HF spells the layer kinds several ways; all map to our two kinds.
MIXER_KINDS = {
    "minicpm4": SPARSE,
    "lightning": LIGHTNING,
    "lightning_attn": LIGHTNING,
    "lightning-attn": LIGHTNING,
}


# What the InfLLM-v2 kernels are written for (SPEC §4.3, P14). The CUDA kernels hard-code these
# values, and ours rely on the geometry they imply: a compressed chunk spans two strides, a block
# four level-1 strides, and the level-2 stride is the block. Other values are not the algorithm.
KERNEL_VALUES = {"kernel_size": 32, "kernel_stride": 16, "block_size": 64}


# MiniCPM-SALA's context, 1M tokens (a job's engine.max_context defaults to it): its
# config.json's max_position_embeddings, 524,288, only sizes HF's RoPE table (SPEC §1.1).
CONTEXT_TOKENS = 1 << 20


@dataclass(frozen=True)
class SparseConfig:
    """InfLLM-v2 parameters (`sparse_config`). Defaults are the released 9B's.

    The one source of the block size and the compression levels: the cache, the sparse layer
    and (through their arguments) the kernels read them from here.
    """

    kernel_size: int = 32  # level-1 compression: mean of 32 keys every 16
    kernel_stride: int = 16
    block_size: int = 64  # selection granularity of stage 2
    init_blocks: int = 1  # always-selected leading blocks
    window_size: int = 2048  # local window, always selected (in tokens)
    topk: int = 64  # retrieved blocks, on top of the local window
    dense_len: int = 8192  # dense attention while total length < dense_len
    use_nope: bool = False

    @property
    def compression(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(size, stride) of the two key-compression levels: level 1 as configured (32, 16), and
        level 2 four times both (128, 64), which HF derives the same way (SPEC §4.3)."""
        size, stride = self.kernel_size, self.kernel_stride
        return (size, stride), (4 * size, 4 * stride)

    @property
    def local_blocks(self) -> int:
        return self.window_size // self.block_size

    @property
    def topk_eff(self) -> int:
        """Blocks selected per query (SPEC P5): topk plus the local window."""
        return self.topk + self.local_blocks


@dataclass(frozen=True)
class QuantConfig:
    """MLX affine quantization of the checkpoint (`quantization` in config.json)."""

    group_size: int
    bits: int
    overrides: dict[str, Any] = field(
        default_factory=dict
    )  # per-module {group_size, bits} or False


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_kinds: tuple[str, ...]  # SPARSE or LIGHTNING per layer, from `mixer_types`
    sparse: SparseConfig
    lightning_heads: int
    lightning_kv_heads: int
    lightning_head_dim: int
    lightning_scale: str = "1/sqrt(d)"
    lightning_use_rope: bool = True
    attn_use_rope: bool = False
    attn_use_output_gate: bool = True
    use_output_gate: bool = True
    use_output_norm: bool = True
    qk_norm: bool = True
    attention_bias: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 524288
    scale_emb: float = 1.0
    scale_depth: float = 1.0
    dim_model_base: int = 1
    mup_denominator: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    quantization: QuantConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # -- derived -------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        """The longest sequence (prompt and answer) the engine runs: CONTEXT_TOKENS, or
        max_position_embeddings where that is larger."""
        return max(self.max_position_embeddings, CONTEXT_TOKENS)

    @property
    def residual_scale(self) -> float:
        """Each mixer and MLP output is scaled by this before the residual add."""
        return self.scale_depth / math.sqrt(self.num_hidden_layers)

    @property
    def logit_divisor(self) -> float:
        """muP: the final hidden state is divided by this before lm_head."""
        return self.hidden_size / self.dim_model_base

    @property
    def lightning_scale_value(self) -> float:
        d = self.lightning_head_dim
        return {"1/sqrt(d)": 1.0 / math.sqrt(d), "1/d": 1.0 / d}.get(self.lightning_scale, 1.0)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == SPARSE)

    def splits_modes(self, prefix: int, whole: int) -> bool:
        """Whether a prefix of `prefix` tokens prefilled alone holds other values than one call
        over a prompt of `whole` tokens computes for it (SPEC P7): alone it is below dense_len
        (dense), the prompt reaches it (InfLLM-v2 over all of it), and some of its positions
        have more blocks than a query selects (below that the two modes agree)."""
        sc = self.sparse
        if not self.sparse_layers or prefix <= sc.topk_eff * sc.block_size:
            return False
        return prefix < sc.dense_len <= whole

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str | Path = "config.json") -> ModelConfig:
        return _Reader(raw, path).build()

    @classmethod
    def of_checkpoint(cls, folder: str | Path) -> ModelConfig:
        """The config of a checkpoint folder; a path that is no folder is a ConfigError (exit
        code 2: bad input), as a folder without config.json is."""
        folder = Path(folder)
        if not folder.is_dir():
            what = "not a folder" if os.path.lexists(folder) else "no such folder"
            raise ConfigError(f"{what} (expected a checkpoint folder)", path=folder)
        return cls.from_file(folder / "config.json")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError("model config not found", path=path)
        return cls.from_dict(read_config_json(path), path)


def read_config_json(path: Path) -> dict[str, Any]:
    """A checkpoint's config.json as its JSON object (the model's config, and the tokenizer's
    ids where it holds them): one reader, one error (a ConfigError) for both."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"not valid JSON: {e}", path=path) from None
    except OSError as e:
        raise ConfigError(f"cannot read it ({e.strerror})", path=path) from None
    if not isinstance(raw, dict):
        raise ConfigError("top level must be an object", path=path, got=type(raw).__name__)
    return raw


class _Reader:
    """Pulls typed fields out of the raw dict, naming the file and field on every error."""

    def __init__(self, raw: dict[str, Any], path: str | Path) -> None:
        self.raw, self.path, self.used = raw, path, set()
        self.nested_extra: dict[str, dict[str, Any]] = {}  # unused keys of the objects we read

    def get(self, key: str, kind: type, default: Any = ..., *, positive: bool = False) -> Any:
        self.used.add(key)
        if key not in self.raw or (self.raw[key] is None and default is not ...):
            if default is ...:
                raise ConfigError("required field is missing", path=self.path, field=key)
            return default
        return _typed(self.raw[key], kind, self.path, key, positive)

    def build(self) -> ModelConfig:
        g = self.get
        hidden = g("hidden_size", int, positive=True)
        layers = g("num_hidden_layers", int, positive=True)
        heads, kv_heads, head_dim, l_heads, l_kv, l_dim = self._heads(hidden)
        kinds = self._layer_kinds(layers)
        dtype = self.get("torch_dtype", str, None)
        dtype = self.get("dtype", str, dtype)  # transformers >= 4.56 writes `dtype`
        cfg = ModelConfig(
            vocab_size=g("vocab_size", int, positive=True),
            hidden_size=hidden,
            intermediate_size=g("intermediate_size", int, positive=True),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            layer_kinds=kinds,
            sparse=self._sparse(),
            lightning_heads=l_heads,
            lightning_kv_heads=l_kv,
            lightning_head_dim=l_dim,
            lightning_scale=g("lightning_scale", str, "1/sqrt(d)"),
            lightning_use_rope=g("lightning_use_rope", bool, True),
            attn_use_rope=g("attn_use_rope", bool, False),
            attn_use_output_gate=g("attn_use_output_gate", bool, True),
            use_output_gate=g("use_output_gate", bool, True),
            use_output_norm=g("use_output_norm", bool, True),
            qk_norm=g("qk_norm", bool, True),
            attention_bias=g("attention_bias", bool, False),
            hidden_act=g("hidden_act", str, "silu"),
            rms_norm_eps=g("rms_norm_eps", float, 1e-6, positive=True),
            rope_theta=g("rope_theta", float, 10000.0, positive=True),
            max_position_embeddings=g("max_position_embeddings", int, 524288, positive=True),
            # muP multipliers: 0 erases the embeddings or every layer, < 0 flips their sign.
            # Required: HF's config class and a plain LLaMA would default them differently
            # (12, 1.4, 256 against 1, 1, hidden), and either guess changes every logit silently.
            scale_emb=g("scale_emb", float, positive=True),
            scale_depth=g("scale_depth", float, positive=True),
            dim_model_base=g("dim_model_base", int, positive=True),
            mup_denominator=g("mup_denominator", int, None),
            tie_word_embeddings=g("tie_word_embeddings", bool, False),
            bos_token_id=g("bos_token_id", int, None),
            pad_token_id=g("pad_token_id", int, None),
            eos_token_ids=self._eos(),
            torch_dtype=dtype,
            quantization=self._quantization(),
            extra={},
        )
        self._check_supported(cfg)
        extra = {k: v for k, v in self.raw.items() if k not in self.used}
        extra.update(self.nested_extra)
        object.__setattr__(cfg, "extra", extra)
        return cfg

    def _heads(self, hidden: int) -> tuple[int, int, int, int, int, int]:
        """Sparse-layer heads, kv heads, head dim; then the lightning layer's three."""
        g = self.get
        heads = g("num_attention_heads", int, positive=True)
        kv_heads = g("num_key_value_heads", int, heads, positive=True)
        head_dim = g("head_dim", int, hidden // heads, positive=True)
        if heads % kv_heads:
            raise ConfigError(
                "num_attention_heads must be a multiple of num_key_value_heads",
                path=self.path,
                field="num_key_value_heads",
                got=kv_heads,
            )
        # HF builds the lightning layer from num_attention_heads / lightning_nkv / head_dim; the
        # lightning_* copies must agree with them when present.
        l_heads = self._agree("lightning_nh", heads, "num_attention_heads")
        l_dim = self._agree("lightning_head_dim", head_dim, "head_dim")
        l_kv = g("lightning_nkv", int, l_heads, positive=True)
        if l_heads % l_kv:
            raise ConfigError(
                "must divide the lightning head count",
                path=self.path,
                field="lightning_nkv",
                expected=f"a divisor of {l_heads}",
                got=l_kv,
            )
        return heads, kv_heads, head_dim, l_heads, l_kv, l_dim

    def _agree(self, key: str, value: int, other: str) -> int:
        got = self.get(key, int, value, positive=True)
        if got != value:
            raise ConfigError(
                f"must equal {other} (HF sizes the lightning layer from {other})",
                path=self.path,
                field=key,
                expected=value,
                got=got,
            )
        return got

    def _layer_kinds(self, layers: int) -> tuple[str, ...]:
        mixers = self.get("mixer_types", list)
        if len(mixers) != layers:
            raise ConfigError(
                "needs one entry per layer",
                path=self.path,
                field="mixer_types",
                expected=f"{layers} entries (num_hidden_layers)",
                got=len(mixers),
            )
        kinds = []
        for i, m in enumerate(mixers):
            if not isinstance(m, str) or m not in MIXER_KINDS:
                raise ConfigError(
                    "unknown mixer type",
                    path=self.path,
                    field=f"mixer_types[{i}]",
                    expected=" | ".join(MIXER_KINDS),
                    got=m,
                )
            kinds.append(MIXER_KINDS[m])
        return tuple(kinds)

    def _sparse(self) -> SparseConfig:
        raw = self.get("sparse_config", dict, {})
        defaults = SparseConfig()
        values = {}
        for name in SparseConfig.__dataclass_fields__:
            kind = bool if name == "use_nope" else int
            key = f"sparse_config.{name}"
            value = raw.get(name, getattr(defaults, name))
            values[name] = _typed(value, kind, self.path, key, positive=kind is int)
        if unused := {k: v for k, v in raw.items() if k not in SparseConfig.__dataclass_fields__}:
            self.nested_extra["sparse_config"] = unused
        sc = SparseConfig(**values)
        for name, want in KERNEL_VALUES.items():
            if getattr(sc, name) != want:
                raise ConfigError(
                    "InfLLM-v2 fixes this value (its kernels support no other)",
                    path=self.path,
                    field=f"sparse_config.{name}",
                    expected=want,
                    got=getattr(sc, name),
                )
        if sc.window_size % sc.block_size:
            raise ConfigError(
                "must be a multiple of block_size",
                path=self.path,
                field="sparse_config.window_size",
                got=sc.window_size,
            )
        return sc

    def _eos(self) -> tuple[int, ...]:
        self.used.add("eos_token_id")
        raw = self.raw.get("eos_token_id")
        if raw is None:
            return ()
        items = raw if isinstance(raw, list) else [raw]
        return tuple(_typed(v, int, self.path, "eos_token_id", False) for v in items)

    def _quantization(self) -> QuantConfig | None:
        """MLX's `quantization`; else an MLX-shaped `quantization_config` (mlx-lm writes both,
        alike). A `quantization_config` with a `quant_method` (GPTQ, AWQ, bitsandbytes, FP8)
        packs its weights otherwise: refused here by name, not later as a list of tensors."""
        raw = self.get("quantization", dict, None)
        other = self.get("quantization_config", dict, None)
        if raw is None and other is not None:
            if "quant_method" in other:
                raise ConfigError(
                    "unsupported quantization: salabatch reads MLX's affine quantization "
                    "(`salabatch convert` makes it from the bf16 checkpoint)",
                    path=self.path,
                    field="quantization_config.quant_method",
                    got=other["quant_method"],
                )
            raw = other
        if raw is None:
            return None
        group = _typed(raw.get("group_size"), int, self.path, "quantization.group_size", True)
        bits = _typed(raw.get("bits"), int, self.path, "quantization.bits", True)
        if bits not in (2, 3, 4, 5, 6, 8):
            raise ConfigError(
                "unsupported bit width",
                path=self.path,
                field="quantization.bits",
                expected="2, 3, 4, 5, 6 or 8",
                got=bits,
            )
        mode = raw.get("mode", "affine")
        if mode != "affine":  # mxfp4 / nvfp4 pack differently and have no biases
            raise ConfigError(
                "unsupported quantization mode",
                path=self.path,
                field="quantization.mode",
                expected="affine",
                got=mode,
            )
        overrides = {k: v for k, v in raw.items() if k not in ("group_size", "bits", "mode")}
        return QuantConfig(group_size=group, bits=bits, overrides=overrides)

    def _check_supported(self, cfg: ModelConfig) -> None:
        if cfg.hidden_act != "silu":
            raise ConfigError(
                "only SwiGLU MLPs are supported",
                path=self.path,
                field="hidden_act",
                expected="silu",
                got=cfg.hidden_act,
            )
        if cfg.attention_bias:
            raise ConfigError(
                "the released model has no biases; biased projections are not supported",
                path=self.path,
                field="attention_bias",
                expected=False,
                got=True,
            )
        rope_scaling = self.raw.get("rope_scaling")
        self.used.add("rope_scaling")
        if rope_scaling is not None:
            raise ConfigError(
                "RoPE scaling is not supported (MiniCPM-SALA uses plain RoPE)",
                path=self.path,
                field="rope_scaling",
                expected=None,
                got=rope_scaling,
            )


def _typed(value: Any, kind: type, path: str | Path, key: str, positive: bool) -> Any:
    """Checks a JSON value against `kind` (ints are accepted as floats; bools are not ints; floats
    must be finite), and that it is > 0 when `positive`."""
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError("wrong type", path=path, field=key, expected=kind.__name__, got=value)
    # Python's JSON reads NaN, Infinity and 1e999 as floats; any of them makes every logit NaN.
    if kind is float and not math.isfinite(value):
        raise ConfigError(
            "must be finite", path=path, field=key, expected="a finite number", got=value
        )
    if positive and value <= 0:
        raise ConfigError("must be positive", path=path, field=key, expected="> 0", got=value)
    return value
