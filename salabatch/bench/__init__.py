"""`salabatch bench NAME`: measurements, never tests. Each benchmark returns a JSON-able dict;
`run` adds where it ran (device, MLX, BLAS) so numbers are comparable only like for like."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx


def environment() -> dict:
    """Where a benchmark ran: versions, the device, the BLAS, and the custom CUDA kernels that
    were on (none off CUDA)."""
    from salabatch._version import __version__
    from salabatch.engine.blas import active
    from salabatch.engine.kernels.attention import CUDA_KERNELS, cuda_kernel
    from salabatch.engine.runtime import device_name

    return {
        "salabatch": __version__,
        "mlx": mx.__version__,
        "device": device_name(),
        "blas": active().kind,
        "cuda_kernels": [name for name in CUDA_KERNELS if cuda_kernel(name)],
    }


def time_ms(fn: Callable[[], object], repeat: int, warmup: int = 1) -> dict:
    """Median and best wall time of `fn` (its result evaluated), in milliseconds."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {"median_ms": round(times[len(times) // 2], 3), "best_ms": round(times[0], 3)}
