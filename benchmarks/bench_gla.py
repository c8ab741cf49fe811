"""Time the lightning kernels at the 9B's shape (H = 32, d = 128); prints one JSON line per op.

.venv/bin/python benchmarks/bench_gla.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from salabatch.engine.kernels.gla import decay_slopes, gla_chunked, gla_step

H, D = 32, 128


def _time_ms(fn, repeat: int) -> float:
    mx.eval(fn())  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _inputs(B: int, T: int):
    mx.random.seed(0)
    q, k, v = (mx.random.normal((B, H, T, D)).astype(mx.bfloat16) for _ in range(3))
    state = mx.random.normal((B, H, D, D))
    return q, k, v, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    g = -mx.array(decay_slopes(H), dtype=mx.float32)
    scale = D**-0.5
    cases = [("gla_chunked", gla_chunked, 1, 2048), ("gla_step", gla_step, 1, 1)]
    cases.append(("gla_step", gla_step, 8, 1))
    for op, fn, B, T in cases:
        q, k, v, state = _inputs(B, T)
        mx.eval(q, k, v, state)
        ms = _time_ms(lambda fn=fn, q=q, k=k, v=v, s=state: fn(q, k, v, g, scale, s), args.repeat)
        row = {"op": op, "B": B, "T": T, "H": H, "d": D, "ms": round(ms, 3)}
        print(json.dumps({**row, "device": str(mx.default_device())}))


if __name__ == "__main__":
    main()
