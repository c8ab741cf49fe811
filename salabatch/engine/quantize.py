"""MLX affine quantization of the linear layers: converting a checkpoint, and loading one.

Converting quantizes every `nn.Linear` whose input dim is a multiple of the group size, `lm_head`
included; embeddings and norms stay in full precision (SPEC §7.3). `head_bits` gives `lm_head`
its own width (a mixed checkpoint, as mlx-lm's recipes make them): on the trained tiny model most
of 4-bit's logit error is the head's (benchmarks/HISTORY.md, "Stage 5").

A quantized linear `p` is stored as `p.weight` (uint32, [out, in * bits / 32]), `p.scales` and
`p.biases` ([out, in / group_size]), under the HF names, with `"quantization": {"group_size",
"bits"}` in `config.json`; this is also the layout of the published MLX 8-bit checkpoint.

Loading decides per module from the checkpoint itself: a module is quantized iff it has `.scales`
(or a packed uint32 `.weight`), with group size and bits from its own entry in `quantization` when
the config lists one (`"model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 4}`, or `false`
for a module left in full precision), else from the global pair.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.checkpoint import (
    INDEX,
    check_weights,
    read_weights,
    weight_files,
    write_weights,
)
from salabatch.engine.config import ModelConfig, QuantConfig
from salabatch.engine.model import Model
from salabatch.engine.runtime import dtype_name, resolve_dtype
from salabatch.engine.tokenizer_files import TOKENIZER_FILES
from salabatch.errors import CheckpointError, ConfigError, OutputError

BITS = (2, 3, 4, 5, 6, 8)  # what MLX's affine mode packs
GROUP_SIZES = (32, 64, 128)
MAX_SHARD_BYTES = 5 << 30  # shards of at most 5 GiB, as HF and mlx-lm write them
HEAD = "lm_head"


def quantizable(module: nn.Module, group_size: int) -> bool:
    """The conversion predicate: linear layers (lm_head included) whose input splits into whole
    groups. Embeddings and norms are not `nn.Linear`, so they stay in full precision."""
    return isinstance(module, nn.Linear) and module.weight.shape[-1] % group_size == 0


def quantize_model(
    model: nn.Module, *, bits: int, group_size: int = 64, dtype: mx.Dtype | None = None
) -> int:
    """Quantizes `model` in place with the conversion predicate; returns how many layers.

    Scales and biases take `dtype` (default: the weights' own dtype), and their dtype is the
    output dtype of `QuantizedLinear`, so it should be the activation dtype. A Model whose
    projections were fused (`Model.fuse`, as loaded) is fused again over its new layers: its
    decode step kept the float buffers before.
    """
    check_bits(bits, group_size)
    fused = isinstance(model, Model) and model.is_fused
    paths = [p for p, m in model.named_modules() if quantizable(m, group_size)]
    nn.quantize(model, group_size, bits, class_predicate=lambda _, m: quantizable(m, group_size))
    if dtype is not None:
        for _, m in model.named_modules():
            if isinstance(m, nn.QuantizedLinear):
                m.scales, m.biases = m.scales.astype(dtype), m.biases.astype(dtype)
    if fused:
        model.fuse()
    return len(paths)


def quantize_like(
    model: nn.Module, quant: QuantConfig, weights: dict[str, mx.array], path: Path
) -> None:
    """Gives `model` the quantized structure of the checkpoint `weights` (see the module doc).

    Only the structure: the strict key check and `load_weights` come after, so a missing
    `.scales` or a wrongly shaped tensor is reported by name there. A config that says
    quantized over weights that are all full precision is refused: rows and `validate` would
    report bits that are not there, and `convert` would refuse the checkpoint as quantized.
    """
    config = path / "config.json"
    quantized = 0

    def predicate(name: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        packed = weights.get(f"{name}.weight")
        if f"{name}.scales" not in weights and (packed is None or packed.dtype != mx.uint32):
            return False
        entry = quant.overrides.get(name, True)
        if entry is False:
            raise CheckpointError(
                f"{name} is quantized in the weights, but config.json lists it as full precision "
                f"(quantization.{name} = false)",
                path=path,
            )
        nonlocal quantized
        quantized += 1
        return module_params(quant, name, entry, config)

    nn.quantize(model, class_predicate=predicate)
    if not quantized:
        raise CheckpointError(
            f"config.json says {quant.bits}-bit quantized, but no weight is (no .scales): for "
            "full-precision weights, remove `quantization` from config.json",
            path=path,
        )


def module_params(quant: QuantConfig, name: str, entry: Any, config: Path) -> dict:
    """`to_quantized` arguments of module `name`: its own config entry over the global pair."""
    if entry is True:
        entry = {}
    if not isinstance(entry, dict):
        raise ConfigError(
            "a per-module quantization entry must be an object or false",
            path=config,
            field=f"quantization.{name}",
            got=entry,
        )
    group_size = entry.get("group_size", quant.group_size)
    bits = entry.get("bits", quant.bits)
    mode = entry.get("mode", "affine")
    if mode != "affine" or bits not in BITS or group_size not in GROUP_SIZES:
        raise ConfigError(
            "unsupported quantization",
            path=config,
            field=f"quantization.{name}",
            expected=f"affine mode, bits in {BITS}, group_size in {GROUP_SIZES}",
            got=entry,
        )
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def check_bits(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise ConfigError("unsupported bit width", field="bits", expected=BITS, got=bits)
    if group_size not in GROUP_SIZES:
        raise ConfigError(
            "unsupported group size", field="group_size", expected=GROUP_SIZES, got=group_size
        )


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    bits: int,
    group_size: int = 64,
    dtype: str = "bfloat16",
    force: bool = False,
    max_shard_bytes: int | None = MAX_SHARD_BYTES,
    progress: bool = True,
    head_bits: int | None = None,
) -> dict:
    """Quantizes the full-precision checkpoint `src` into the new checkpoint `dst`.

    Linear weights get `bits` bits in groups of `group_size` (`lm_head` gets `head_bits` when
    given, listed per module in `quantization`), with scales and biases in `dtype`; every other
    tensor is stored in `dtype`. Tokenizer and generation config files are copied (with `force`,
    those and the weights and config of a checkpoint already in `dst` are removed first, so `dst`
    holds exactly what this conversion writes, beside any other files it had), and
    `config.json` (written last, so an interrupted run does not leave a loadable directory) gains
    `"quantization"`. Returns a summary: tensors quantized / kept, bytes on disk before and after.
    Peak memory is about the output plus one source tensor: sources are read lazily, one at a time.
    """
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    check_bits(bits, group_size)
    if head_bits is not None:
        check_bits(head_bits, group_size)
    dt = resolve_dtype(dtype)
    cfg = ModelConfig.of_checkpoint(src)
    if cfg.quantization is not None:
        raise CheckpointError("already quantized; convert from the full-precision model", path=src)
    check_destination(src, dst, force)

    model = Model(cfg)  # structure only: its random init is lazy and never evaluated
    weights = model.sanitize(read_weights(src))
    check_weights(model, weights, src)
    linears = {name: bits for name, m in model.named_modules() if quantizable(m, group_size)}
    quantization: dict[str, Any] = {"group_size": group_size, "bits": bits}
    if head_bits is not None:
        if HEAD not in linears:
            raise ConfigError(
                "the model has no lm_head of its own to quantize apart (tied embeddings)",
                field="head_bits",
                got=head_bits,
            )
        linears[HEAD] = head_bits
        quantization[HEAD] = {"group_size": group_size, "bits": head_bits}
    float32_bytes = sum(w.size * 4 for w in weights.values())
    count = len(weights)
    out, quantized = _quantize_weights(weights, linears, group_size, dt, progress)

    files, copied = _write_converted(src, dst, out, quantization, dt, max_shard_bytes)
    before = sum(f.stat().st_size for f in weight_files(src))
    after = sum(f.stat().st_size for f in files)
    return {
        "src": str(src),
        "dst": str(dst),
        "bits": bits,
        "head_bits": head_bits if head_bits is not None else bits,
        "group_size": group_size,
        "dtype": dtype_name(dt),
        "quantized": quantized,
        "kept": count - quantized,
        "files": [f.name for f in files],
        "copied": copied,
        "bytes_before": before,
        "bytes_after": after,
        "ratio": round(after / before, 4),
        "ratio_vs_float32": round(after / float32_bytes, 4),
    }


def _quantize_weights(
    weights: dict[str, mx.array],
    linears: dict[str, int],
    group_size: int,
    dtype: mx.Dtype,
    progress: bool,
) -> tuple[dict[str, mx.array], int]:
    """(the converted tensors, how many weights were quantized): the weights of `linears` (module
    → bits) become `.weight` / `.scales` / `.biases`, every other float tensor is cast to `dtype`.

    Empties `weights` as it goes, so only one source tensor is in memory at a time.
    """
    from tqdm import tqdm

    out: dict[str, mx.array] = {}
    quantized = 0
    bits = "/".join(str(b) for b in sorted(set(linears.values()))) or "no"
    for name in tqdm(sorted(weights), desc=f"{bits}-bit", unit="tensor", disable=not progress):
        w = weights.pop(name)  # dropping the reference frees the source tensor once evaluated
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module in linears:
            # Quantizing in the storage dtype lets MLX fit the rounding to bf16 scales/biases.
            q, scales, biases = mx.quantize(w.astype(dtype), group_size, linears[module])
            new = {name: q, f"{module}.scales": scales, f"{module}.biases": biases}
            quantized += 1
        else:
            new = {name: w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w}
        mx.eval(list(new.values()))
        out.update(new)
        del w
    return out, quantized


def _write_converted(
    src: Path,
    dst: Path,
    weights: dict[str, mx.array],
    quantization: dict,
    dtype: mx.Dtype,
    max_shard_bytes: int | None,
) -> tuple[list[Path], list[str]]:
    """(weight files, copied file names): clears the checkpoint files of `dst`, writes `weights`,
    copies the tokenizer files of `src`, and writes its config.json with `quantization` last.
    A write that fails (a full disk) removes what it wrote: a CheckpointError naming `dst`."""
    clear_destination(dst)
    try:
        files = write_weights(dst, weights, max_shard_bytes)
        copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
        for name in copied:
            shutil.copy2(src / name, dst / name)
        raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
        raw["quantization"] = quantization
        for key in ("torch_dtype", "dtype"):
            if key in raw:
                raw[key] = dtype_name(dtype)
        (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
        return files, copied
    except (OSError, RuntimeError) as e:  # MLX's writer raises RuntimeError ("[write] Unable...")
        clear_destination(dst)
        # MLX's says no more; an OSError says what it was
        full = not isinstance(e, OSError) or e.errno == errno.ENOSPC
        raise CheckpointError(
            f"cannot write the converted checkpoint ({e}){'; is the disk full?' if full else ''}"
            "; nothing of it is left there",
            path=dst,
        ) from None


def check_destination(src: Path, dst: Path, force: bool) -> None:
    """Refuses (OutputError, a usage error) the source itself, a file or a path under one,
    and a non-empty directory unless `force`."""
    if dst.resolve() == src.resolve():
        raise OutputError("the destination is the source checkpoint", path=dst)
    if dst.exists() and not dst.is_dir():
        raise OutputError("the destination exists and is not a directory", path=dst)
    above = next((p for p in dst.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise OutputError(f"the destination cannot be made: {above} is a file", path=dst)
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise OutputError("the destination is not empty (--force overwrites it)", path=dst)


def clear_destination(dst: Path) -> None:
    """Removes from `dst` every file a checkpoint is read from (config.json first, then the
    weights, the shard index and the tokenizer files): a stale shard would be read as part of the
    new weights, a stale generation_config.json or chat template as part of its tokenizer. Other
    files (notes, a README) are not the checkpoint's, and stay."""
    if not dst.is_dir():
        return
    weights = sorted(f.name for f in dst.glob("*.safetensors"))
    owned = ["config.json", *weights, INDEX, *TOKENIZER_FILES]
    for file in (dst / name for name in owned):
        if file.is_file() or file.is_symlink():
            file.unlink()
