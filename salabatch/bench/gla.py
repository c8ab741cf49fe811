"""Lightning (simple-GLA) kernels at the 9B's shape (H = 32, d = 128): chunked prefill of 2048
tokens and one decode step at batch 1 and 8."""

from __future__ import annotations

import mlx.core as mx

from salabatch.bench import time_ms
from salabatch.engine.kernels.gla import decay_slopes, gla_chunked, gla_step

H, D = 32, 128


def run(repeat: int = 5) -> dict:
    g = -mx.array(decay_slopes(H), dtype=mx.float32)
    scale = D**-0.5
    rows = []
    for op, fn, B, T in [
        ("gla_chunked", gla_chunked, 1, 2048),
        ("gla_step", gla_step, 1, 1),
        ("gla_step", gla_step, 8, 1),
    ]:
        mx.random.seed(0)
        q, k, v = (mx.random.normal((B, H, T, D)) for _ in range(3))
        state = mx.random.normal((B, H, D, D))
        mx.eval(q, k, v, state)
        timing = time_ms(lambda fn=fn, q=q, k=k, v=v, s=state: fn(q, k, v, g, scale, s), repeat)
        rows.append({"op": op, "batch": B, "tokens": T, "heads": H, "head_dim": D, **timing})
    return {"results": rows}
