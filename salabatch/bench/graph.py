"""The engine's graphs as a GPU runs them, counted on any device: kernels per decode step and
per prefill chunk, and compiled traces.

A GPU pays for every kernel launch, and its host for every op it records; a CPU hides both. So
the shape of the GPU path is measured here, with no GPU: `gpu_graph()` forces the engine's GPU
branches (`SALABATCH_GPU_PATH=1`, see `salabatch.engine.kernels.attention.on_gpu`) and stands
each fused op a GPU runs as one kernel (SDPA, rms_norm, layer_norm, rope) in for one node, since
MLX's CPU backend decomposes them into a dozen. Nothing built under it is meant to be evaluated:
its fused ops return their first input unchanged. `nodes()` counts the primitives between the
evaluated arrays (weights, caches) and the outputs, as `mx.export_to_dot` lists them.
"""

from __future__ import annotations

import io
import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

# Primitives that only re-describe memory (a view: no kernel runs on a GPU); what `kernels`
# leaves out. Every other primitive is one kernel launch, as the dense peer is counted too.
VIEW_OPS = frozenset(
    {
        "AsStrided",
        "Broadcast",
        "BroadcastAxes",
        "ExpandDims",
        "Flatten",
        "Reshape",
        "Slice",
        "Squeeze",
        "StopGradient",
        "Transpose",
        "Unflatten",
    }
)
# `mx.fast` ops a GPU runs as one kernel: each argument that is an array is a dependency.
FUSED_OPS = ("scaled_dot_product_attention", "rms_norm", "layer_norm", "rope")

_LABEL = re.compile(r'\{ \d+ \[label ="([^"]+)"')


def _one_node(name: str):
    def stand_in(x: mx.array, *args, **kwargs) -> mx.array:
        deps = [a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)]
        return mx.depends([x], deps)[0] if deps else mx.depends([x], [x])[0]

    stand_in.__name__ = name
    return stand_in


@contextmanager
def gpu_graph() -> Iterator[None]:
    """The GPU branches forced and each fused op one node, restored after the block. For counting
    graphs only: the fused ops' stand-ins do not compute their result."""
    saved = {name: getattr(mx.fast, name) for name in FUSED_OPS}
    env = os.environ.get("SALABATCH_GPU_PATH")
    os.environ["SALABATCH_GPU_PATH"] = "1"
    for name in FUSED_OPS:
        setattr(mx.fast, name, _one_node(name))
    try:
        yield
    finally:
        for name, op in saved.items():
            setattr(mx.fast, name, op)
        if env is None:
            del os.environ["SALABATCH_GPU_PATH"]
        else:
            os.environ["SALABATCH_GPU_PATH"] = env


def nodes(*outputs: mx.array) -> Counter[str]:
    """Primitives of the unevaluated graph behind `outputs`, by name, one per op recorded (a
    compiled graph called twice counts twice); evaluated arrays are its inputs and count
    nothing."""
    text = io.StringIO()
    mx.export_to_dot(text, *outputs)
    return Counter(_LABEL.findall(text.getvalue()))


def kernels(counts: Counter[str]) -> int:
    """Kernel launches of a graph counted by `nodes`: its primitives that are not views."""
    return sum(n for name, n in counts.items() if not is_view(name))


def is_view(name: str) -> bool:
    """A primitive that runs no kernel: a view, or a reinterpretation of the bits of a dtype
    of the same size ("View uint32")."""
    return name in VIEW_OPS or name.startswith("View ")
