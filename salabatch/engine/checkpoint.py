"""Safetensors checkpoint directories: read (one file or HF shards + index), check against a
model, and write.

Writing is used by `convert`, by the random-weight checkpoints of `salabatch.demo` and by tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from salabatch.engine.runtime import dtype_name
from salabatch.errors import CheckpointError

INDEX = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from the shard index when there is one."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"unreadable shard index ({e})", path=index) from None
        if bad := [n for n in names if not isinstance(n, str) or not n or "/" in n]:
            message = f"the index's weight_map names a shard that is no file name: {bad[0]!r}"
            raise CheckpointError(message, path=index)
        files = sorted(path / name for name in names)
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"shards listed in the index are missing: {absent}", path=index)
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError("no *.safetensors files", path=path)
    return files


def read_weights(path: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for file in weight_files(path):
        try:
            shard = mx.load(str(file))
        except Exception as e:  # MLX raises plain RuntimeError/ValueError on bad files
            raise CheckpointError(f"cannot read safetensors ({e})", path=file) from None
        twice = sorted(weights.keys() & shard.keys())
        if twice:
            raise CheckpointError(f"tensors appear in more than one shard: {twice[:5]}", path=file)
        weights.update(shard)
    return weights


def check_weights(model: nn.Module, weights: dict[str, mx.array], path: Path) -> None:
    """Raises CheckpointError naming every missing, unexpected and mis-shaped tensor, then
    every tensor of the wrong dtype (see `_dtype_fits`)."""
    params = dict(tree_flatten(model.parameters()))
    expected = {name: tuple(p.shape) for name, p in params.items()}
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    mismatched = sorted(
        f"{name} {tuple(weights[name].shape)} != {shape}"
        for name, shape in expected.items()
        if name in weights and tuple(weights[name].shape) != shape
    )
    if missing or unexpected or mismatched:
        raise CheckpointError(
            "checkpoint does not match config.json",
            path=path,
            missing=missing,
            unexpected=unexpected,
            mismatched=mismatched,
        )
    wrong = {n: w.dtype for n, w in weights.items() if not _dtype_fits(params[n].dtype, w.dtype)}
    if wrong:
        _raise_wrong_dtypes(wrong, params, path)


def _dtype_fits(want: mx.Dtype, got: mx.Dtype) -> bool:
    """A float parameter takes any float dtype (loading casts it to the activation dtype); any
    other, such as a quantized layer's packed uint32 `.weight`, takes exactly its own."""
    if mx.issubdtype(want, mx.floating):
        return mx.issubdtype(got, mx.floating)
    return got == want


def _raise_wrong_dtypes(wrong: dict[str, mx.Dtype], params: dict, path: Path) -> None:
    """A CheckpointError naming each wrongly typed tensor, the dtype it needs and the file that
    holds it (an int32 norm would otherwise load as int32 and run silently)."""
    # mx.load is lazy: this reads the headers only, and only on the way to an error.
    held = {n: f for f in weight_files(path) for n in mx.load(str(f)) if n in wrong}
    files = set(held.values())
    items = []
    for name in sorted(wrong):
        want = params[name].dtype
        kind = "a floating dtype" if mx.issubdtype(want, mx.floating) else dtype_name(want)
        where = f" in {held[name].name}" if len(files) > 1 else ""
        items.append(f"{name}{where} is {dtype_name(wrong[name])} (expected {kind})")
    shown = next(iter(files)) if len(files) == 1 else path
    raise CheckpointError("tensors of the wrong dtype: " + "; ".join(items), path=shown)


def write_weights(
    path: Path, weights: dict[str, mx.array], max_shard_bytes: int | None = None
) -> list[Path]:
    """Writes `model.safetensors`, or HF-style shards + index when over `max_shard_bytes`."""
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(weights)
    total = sum(weights[n].nbytes for n in names)
    if max_shard_bytes is None or total <= max_shard_bytes:
        mx.save_safetensors(str(path / "model.safetensors"), {n: weights[n] for n in names})
        return [path / "model.safetensors"]
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        if shards[-1] and size + weights[n].nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += weights[n].nbytes
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = path / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(file), {n: weights[n] for n in shard})
        weight_map.update({n: file.name for n in shard})
        files.append(file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return files
