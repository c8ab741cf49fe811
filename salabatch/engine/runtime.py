"""Process-level MLX settings the engine needs: buffer cache, device name, dtype, throughput.

Everything that changes a process setting restores it (`engine_runtime` and `memory_cache` are
context managers).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from salabatch.errors import ConfigError

DTYPES = {
    "float32": mx.float32,
    "fp32": mx.float32,
    "bfloat16": mx.bfloat16,
    "bf16": mx.bfloat16,
    "float16": mx.float16,
    "fp16": mx.float16,
}


@contextmanager
def engine_runtime(limit_bytes: int) -> Iterator[int]:
    """What the engine runs under: MLX's buffer cache at `limit_bytes` (`memory_cache`; what the
    work reuses: `memory.cache_limit`) and, on the CPU,
    BLAS at one thread per core and lane: the kernels run their independent tiles on their own
    lanes (`kernels.attention.lanes`), and a BLAS that spreads each small matmul over every core
    as well only makes the lanes wait on each other. Both restored after the block."""
    from salabatch.engine import blas
    from salabatch.engine.kernels.attention import lanes

    per_lane = max(1, blas.physical_cores() // len(lanes()))
    with memory_cache(limit_bytes) as limit, blas.threads(per_lane):
        yield limit


@contextmanager
def memory_cache(limit_bytes: int) -> Iterator[int]:
    """MLX's free-buffer cache limit for the block, restored after it; yields the limit set.

    MLX's CPU default (32 MB) is smaller than one layer's activations at long context, so large
    buffers would be released and page-faulted again every step; a share of RAM keeps freed
    buffers of every size a long prefill made (`memory.cache_limit` says what the work reuses).
    """
    limit = limit_bytes
    previous = mx.set_cache_limit(limit)
    try:
        yield limit
    finally:
        mx.set_cache_limit(previous)


def device_name() -> str:
    """ "cpu", "gpu (Metal: Apple M2 Max)" or "gpu (CUDA: NVIDIA H100 ...)"."""
    device = mx.default_device()
    if device.type != mx.gpu:
        return "cpu"
    backend = "Metal" if mx.metal.is_available() else "CUDA"
    name = mx.device_info(device).get("device_name")
    return f"gpu ({backend}: {name})" if name else f"gpu ({backend})"


def resolve_dtype(name: str | None) -> mx.Dtype:
    """None / "auto" → float32 on CPU (no fast bf16 GEMM there), bfloat16 on GPU."""
    if name is None or name == "auto":
        return mx.float32 if mx.default_device().type == mx.cpu else mx.bfloat16
    if isinstance(name, str) and name.lower() in DTYPES:
        return DTYPES[name.lower()]
    raise ConfigError(
        "unknown dtype", field="dtype", expected="auto, float32, bfloat16 or float16", got=name
    )


def dtype_name(dtype: mx.Dtype) -> str:
    """The plain name of an MLX dtype ("bfloat16"), as config.json files and reports write it."""
    return str(dtype).removeprefix("mlx.core.")


def matmul_throughput(seconds: float = 1.0) -> dict[str, float]:
    """Measured fp32 speed of the default device: GEMM 1024² (GFLOP/s) and a decode-shaped
    x[1, 4096] @ W[4096, 4096]^T (GB/s of weights read, the bound for token-by-token decode)."""

    def rate(fn, work: float, budget: float) -> float:
        mx.eval(fn())  # warm-up: first call allocates and, for BLAS, starts its threads
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < budget or reps < 2:
            mx.eval(fn())
            reps += 1
        return work * reps / elapsed / 1e9

    n, d = 1024, 4096
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    w, x = mx.random.normal((d, d)), mx.random.normal((1, d))
    mx.eval(a, b, w, x)
    return {
        "gemm_gflops": rate(lambda: a @ b, 2 * n**3, seconds / 2),
        "decode_gbps": rate(lambda: x @ w.T, d * d * 4, seconds / 2),
    }


def doctor_report(seconds: float = 1.0) -> dict:
    """What `salabatch doctor` prints: versions, device, the active BLAS and measured speed."""
    import platform
    import sys
    from dataclasses import asdict

    from salabatch._version import __version__
    from salabatch.engine import blas

    return {
        "salabatch": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "device": device_name(),
        "blas": asdict(blas.active()),
        **matmul_throughput(seconds),
    }
