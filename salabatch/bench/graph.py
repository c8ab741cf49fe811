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
import time
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

# An H100's memory (bytes): what the counts below size the GPU path's tiles for, whatever memory
# this machine has, so they read the same everywhere (`attention.device_memory`).
H100_MEMORY = 80 * 10**9
# The 9B's attention: 32 query heads, 2 kv heads, head dim 128 (its InfLLM-v2 settings are
# SparseConfig's defaults). The width of the residual stream only sizes the projections.
SALA_9B_HEADS = dict(heads=32, kv_heads=2, head_dim=128)


def _one_node(name: str):
    def stand_in(x: mx.array, *args, **kwargs) -> mx.array:
        deps = [a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)]
        return mx.depends([x], deps)[0] if deps else mx.depends([x], [x])[0]

    stand_in.__name__ = name
    return stand_in


@contextmanager
def gpu_graph(device_memory: int | None = None) -> Iterator[None]:
    """The GPU branches forced and each fused op one node, restored after the block; with
    `device_memory` (bytes), the GPU path sizes its tiles for a device of that much memory. For
    counting graphs only: the fused ops' stand-ins do not compute their result."""
    from salabatch.engine.kernels import attention

    saved = {name: getattr(mx.fast, name) for name in FUSED_OPS}
    memory = attention.device_memory
    env = os.environ.get("SALABATCH_GPU_PATH")
    os.environ["SALABATCH_GPU_PATH"] = "1"
    for name in FUSED_OPS:
        setattr(mx.fast, name, _one_node(name))
    if device_memory is not None:
        attention.device_memory = lambda: device_memory
    try:
        yield
    finally:
        attention.device_memory = memory
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


def sala_layers(dtype: mx.Dtype = mx.bfloat16, hidden: int = 256):
    """A sparse and a lightning layer of the 9B's attention shapes (`SALA_9B_HEADS`, its sparse
    settings) with random weights, evaluated: what `prefill_chunk` counts."""
    from salabatch.bench.long import random_init
    from salabatch.demo.checkpoint import sala_config
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.lightning import LightningAttention
    from salabatch.engine.sparse import SparseAttention

    raw = sala_config(
        vocab=256, hidden=hidden, intermediate=hidden, layers=2, sparse_layers=(0,), **SALA_9B_HEADS
    )
    cfg = ModelConfig.from_dict(raw)
    return tuple(random_init(m(cfg), dtype, seed=0) for m in (SparseAttention, LightningAttention))


def filled_sparse_cache(layer, tokens: int, prefill_len: int, dtype: mx.Dtype = mx.bfloat16):
    """The cache of `layer` (a SparseAttention) holding `tokens` zero keys and their compressed
    keys, evaluated (no prefill runs), in a prefill planned at `prefill_len` tokens; its buffers
    have room for the whole prefill, as a live cache has for most chunks."""
    from salabatch.engine.sparse_cache import RowBuffer, SparseKVCache, capacity

    d, Hk = layer.head_dim, layer.n_kv_heads
    room = capacity(prefill_len)
    cache = SparseKVCache(layer.sparse)
    cache.keys, cache.values = (
        RowBuffer(mx.zeros((1, Hk, room, d), dtype), [tokens]) for _ in "kv"
    )
    cache.compressed = tuple(
        RowBuffer(
            mx.zeros((1, Hk, room // stride + 1, d), mx.float32),
            [max(0, (tokens - size) // stride + 1)],
            stride,
        )
        for size, stride in layer.sparse.compression
    )
    cache.prefill_len = prefill_len
    mx.eval(cache.arrays())
    return cache


def prefill_chunk(layer, cache, chunk: int, device_memory: int | None = H100_MEMORY):
    """One prefill chunk of `chunk` tokens through `layer` onto `cache` (a SparseKVCache, or a
    LightningCache) as the GPU runs it: (its kernels by name, the host seconds building the graph
    took, compiled traces included)."""
    x = mx.random.normal((1, chunk, layer.q_proj.weight.shape[1]), key=mx.random.key(0))
    x = x.astype(layer.q_proj.weight.dtype)
    offset = cache.length if hasattr(cache, "length") else 0
    mx.eval(x)
    with gpu_graph(device_memory):
        start = time.perf_counter()
        y = layer(x, cache, offset)
        seconds = time.perf_counter() - start
        return nodes(y), seconds
