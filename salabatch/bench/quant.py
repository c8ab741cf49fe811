"""Decode speed and memory of one random model in four weight formats: float32, bfloat16, and
MLX affine 8-bit and 4-bit (group 64, made by `convert` with bf16 scales, as users make them).

The model is big enough that reading the weights dominates a decode step (hidden 1024, 8 layers
of the 9B's 1:3 sparse:lightning mix, MLP 4x, vocab 16384: 173M parameters, 0.69 GB in float32)
and small enough for a CPU. Quantized formats run with activations in `act_dtype` (auto: float32
on CPU, bfloat16 on a GPU). On CPU, bf16 matmuls and quantized matmuls with bf16 activations do
not use the BLAS and are slower than float32: that is expected, and measured here.
"""

from __future__ import annotations

import gc
import re
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from salabatch.bench import time_ms
from salabatch.demo.checkpoint import sala_config

FORMATS = ("float32", "bfloat16", "8bit", "4bit")


FORMAT = re.compile(r"(\d)bit(?:-g(\d+))?(?:-h(\d))?")  # 4bit, 4bit-g32, 4bit-h8, 4bit-g32-h8


def parse_format(fmt: str) -> tuple[int, int, int]:
    """A quantized format's bits, group size and lm_head bits: "8bit" -> (8, 64, 8) (`convert`'s
    default group); "4bit-g32" -> (4, 32, 4); "4bit-h8" -> (4, 64, 8), the head at 8 bits."""
    from salabatch.engine.quantize import check_bits
    from salabatch.errors import ConfigError

    match = FORMAT.fullmatch(fmt)
    if not match:
        raise ConfigError(
            "unknown format",
            field="formats",
            expected="{bits}bit[-g{group}][-h{head bits}]",
            got=fmt,
        )
    bits, group, head = int(match[1]), int(match[2] or 64), int(match[3] or match[1])
    check_bits(bits, group)
    check_bits(head, group)
    return bits, group, head


def bench_config(hidden: int = 1024, layers: int = 8) -> dict:
    """Head widths of the 9B (128), sparse layers where the 9B has one in four."""
    heads = hidden // 128
    return sala_config(
        vocab=16384,
        hidden=hidden,
        intermediate=4 * hidden,
        layers=layers,
        heads=heads,
        kv_heads=max(1, heads // 4),
        head_dim=128,
        sparse_layers=range(0, layers, 4),
        dim_model_base=256,
    )


def decode_row(model, prefill: int, steps: int) -> dict:
    """Prefill `prefill` tokens, then time `steps` greedy decode steps at batch 1."""
    mx.random.seed(0)
    ids = mx.random.randint(3, model.config.vocab_size, (1, prefill))
    cache = model.make_cache()
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    logits = model(ids, cache)
    tok = [mx.argmax(logits[:, -1:], axis=-1)]
    mx.eval(tok[0])
    prefill_s = time.perf_counter() - start

    def step():
        tok[0] = mx.argmax(model(tok[0], cache)[:, -1:], axis=-1)
        return tok[0]

    timing = time_ms(step, repeat=steps)
    return {
        "prefill_tok_s": round(prefill / prefill_s, 1),
        "decode_tok_s": round(1e3 / timing["median_ms"], 2),
        "decode_step_ms": timing,
        "peak_memory_mb": round(mx.get_peak_memory() / 2**20, 1),
    }


def run(
    hidden: int = 1024,
    layers: int = 8,
    prefill: int = 32,
    steps: int = 16,
    formats: tuple[str, ...] = FORMATS,
    act_dtype: str | None = None,
) -> dict:
    """One row per format: weight memory (parameter bytes), checkpoint size on disk (none for
    bfloat16: it is cast from the float32 file at load), peak memory over prefill + decode
    (weights included), prefill and decode tok/s."""
    from salabatch.demo.checkpoint import write_random_checkpoint
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.kernels.attention import on_gpu
    from salabatch.engine.load import load_model
    from salabatch.engine.memory import cache_limit
    from salabatch.engine.quantize import convert
    from salabatch.engine.runtime import dtype_name, engine_runtime, resolve_dtype
    from salabatch.errors import ConfigError

    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ConfigError("unknown format", field="formats", expected=FORMATS, got=unknown)
    raw = bench_config(hidden, layers)
    act = resolve_dtype(act_dtype)
    rows = []
    limit = cache_limit(ModelConfig.from_dict(raw), 2048, on_gpu())
    with tempfile.TemporaryDirectory() as tmp, engine_runtime(limit):
        src = write_random_checkpoint(Path(tmp) / "float32", raw)
        for fmt in formats:
            if fmt.endswith("bit"):
                path, dtype = Path(tmp) / fmt, act
                bits, group_size, _ = parse_format(fmt)
                convert(
                    src, path, bits=bits, group_size=group_size, dtype="bfloat16", progress=False
                )
            else:
                path, dtype = src, resolve_dtype(fmt)
            model = load_model(path, dtype=dtype)
            params = tree_flatten(model.parameters())
            disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            row = {
                "format": fmt,
                "activations": dtype_name(dtype),
                "weight_memory_mb": round(sum(p.nbytes for _, p in params) / 2**20, 1),
                "disk_mb": None if fmt == "bfloat16" else round(disk / 2**20, 1),
                **decode_row(model, prefill, steps),
            }
            rows.append(row)
            del model, params  # before the next format loads, for its peak
    return {"model": raw, "prefill_tokens": prefill, "decode_steps": steps, "results": rows}
