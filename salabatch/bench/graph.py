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
# `bench long --graph`'s contexts: the issue's 32K, 128K and 256K
CONTEXTS = (32 * 1024, 128 * 1024, 256 * 1024)
# The 9B's attention: 32 query heads, 2 kv heads, head dim 128 (its InfLLM-v2 settings are
# SparseConfig's defaults). The width of the residual stream only sizes the projections.
SALA_9B_HEADS = dict(heads=32, kv_heads=2, head_dim=128)


def _one_node(name: str):
    def stand_in(x: mx.array, *args, **kwargs) -> mx.array:
        deps = [a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)]
        return mx.depends([x], deps)[0] if deps else mx.depends([x], [x])[0]

    stand_in.__name__ = name
    return stand_in


def _stand_in_kernel(*_, **__):
    """What a custom CUDA kernel's `_kernel(...)` returns under `gpu_graph(cuda=True)`: a
    callable taking the kernel's launch arguments and giving its outputs as one node (a
    launch) that depends on every input (their values: zeros)."""

    def launch(*, inputs, output_shapes, output_dtypes, **_):
        deps = [a for a in inputs if isinstance(a, mx.array)]
        zeros = [
            mx.broadcast_to(mx.array(0, dtype=dtype), shape)
            for shape, dtype in zip(output_shapes, output_dtypes, strict=True)
        ]
        return mx.depends(zeros, deps)

    return launch


def custom_kernel_modules() -> tuple:
    """The engine's custom CUDA kernels' modules (`kernels/*_cuda.py`), each with its switch
    `available()` and its kernel factory `_kernel`."""
    from salabatch.engine.kernels import (
        decode_cuda,
        gla_cuda,
        norm_cuda,
        rows_cuda,
        scores_cuda,
        stage1_cuda,
        stage2_cuda,
    )

    return decode_cuda, gla_cuda, norm_cuda, rows_cuda, scores_cuda, stage1_cuda, stage2_cuda


@contextmanager
def gpu_graph(
    device_memory: int | None = None, cuda: bool = False, custom_kernels: bool | None = None
) -> Iterator[None]:
    """The GPU branches forced and each fused op one node, restored after the block; with
    `device_memory` (bytes), the GPU path sizes its tiles for a device of that much memory;
    with `cuda`, MLX's ops chosen as on CUDA (`attention.on_cuda`), else as on Metal;
    `custom_kernels` (default: `cuda`), every custom CUDA kernel switched on
    (`kernels/*_cuda.py`), each launch one node. The stand-ins' nodes are MLX's `Depends`,
    which runs no kernel: the engine's orderings made of it too (`attention.in_turn`,
    `model.with_writes`) are left out of the graphs. For counting graphs only: the stand-ins do
    not compute their result."""
    from salabatch.engine import model as sala
    from salabatch.engine.kernels import attention, sparse_attention, sparse_select

    saved = {name: getattr(mx.fast, name) for name in FUSED_OPS}
    memory, rotates, cuda_device = (
        attention.device_memory,
        attention.rotates_in_float32,
        attention.on_cuda,
    )
    custom = cuda if custom_kernels is None else custom_kernels
    saved_kernels = [(m, m.available, m._kernel) for m in custom_kernel_modules()]
    ordered = (attention, sparse_attention, sparse_select)  # the modules taking tiles in turn
    in_turn = attention.in_turn
    env = os.environ.get("SALABATCH_GPU_PATH")
    os.environ["SALABATCH_GPU_PATH"] = "1"
    for name in FUSED_OPS:
        setattr(mx.fast, name, _one_node(name))
    attention.rotates_in_float32 = lambda: True  # as a GPU's rope kernel does
    attention.on_cuda = lambda: cuda
    if device_memory is not None:
        attention.device_memory = lambda: device_memory
    for module, _, _ in saved_kernels:
        module.available = (lambda: True) if custom else (lambda: False)
        module._kernel = _stand_in_kernel
    for module in ordered:
        module.in_turn = lambda tile, _earlier: tile
    with_writes, sala.with_writes = sala.with_writes, lambda h, _cache: h
    try:
        yield
    finally:
        attention.device_memory, attention.rotates_in_float32 = memory, rotates
        attention.on_cuda = cuda_device
        for name, op in saved.items():
            setattr(mx.fast, name, op)
        for module, available, kernel in saved_kernels:
            module.available, module._kernel = available, kernel
        for module in ordered:
            module.in_turn = in_turn
        sala.with_writes = with_writes
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


def prefill_chunk(
    layer, cache, chunk: int, device_memory: int | None = H100_MEMORY, cuda: bool = False
):
    """One prefill chunk of `chunk` tokens through `layer` onto `cache` (a SparseKVCache, or a
    LightningCache) as the GPU runs it (`cuda`: with the custom CUDA kernels): (its kernels by
    name, the host seconds building the graph took, compiled traces included)."""
    x = mx.random.normal((1, chunk, layer.q_proj.weight.shape[1]), key=mx.random.key(0))
    x = x.astype(layer.q_proj.weight.dtype)
    offset = cache.length if hasattr(cache, "length") else 0
    mx.eval(x)
    with gpu_graph(device_memory, cuda):
        start = time.perf_counter()
        y = layer(x, cache, offset)
        seconds = time.perf_counter() - start
        return nodes(y), seconds


# -- the whole model's decode step (salabatch.engine.decode) and `bench long --graph` ----------


def sala_model(dtype: mx.Dtype = mx.bfloat16, hidden: int = 256, heads: dict = SALA_9B_HEADS):
    """The 9B's 32 layers (sparse at 0, 9, 16, 17, 22, 29, 30, 31), attention shapes (or
    `heads`: heads, kv_heads, head_dim) and InfLLM-v2 settings at a small width, random
    weights, projections fused as `load_model` fuses them. Count on a model of its own: its
    decode step, traced under `gpu_graph`, keeps the stand-in ops."""
    from salabatch.bench.long import SALA_9B_SPARSE_LAYERS, random_init
    from salabatch.demo.checkpoint import sala_config
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.model import Model

    raw = sala_config(
        vocab=4096, hidden=hidden, intermediate=4 * hidden, layers=32,
        sparse_layers=SALA_9B_SPARSE_LAYERS, **heads,
    )  # fmt: skip
    model = random_init(Model(ModelConfig.from_dict(raw)), dtype, seed=0)
    model.fuse()
    return model


def filled_model_cache(model, tokens: int):
    """A one-row cache of `tokens` positions of zeros, evaluated: the shapes of a prefilled
    document (capacities included), with no prefill run."""
    import json

    from salabatch.engine.cache import FORMAT_VERSION, ModelCache

    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    d, Hk, H = cfg.head_dim, cfg.num_key_value_heads, cfg.lightning_heads
    arrays = {}
    for i, kind in enumerate(cfg.layer_kinds):
        if kind == "sparse":
            arrays[f"layers.{i}.keys"] = arrays[f"layers.{i}.values"] = mx.zeros(
                (1, Hk, tokens, d), dtype
            )
            for level, (size, stride) in enumerate(cfg.sparse.compression):
                n = max(0, (tokens - size) // stride + 1)
                arrays[f"layers.{i}.chunks{level}"] = mx.zeros((1, Hk, n, d))
        else:
            dl = cfg.lightning_head_dim
            arrays[f"layers.{i}.state"] = mx.zeros((1, H, dl, dl))
    meta = {
        "format_version": str(FORMAT_VERSION),
        "layer_kinds": json.dumps(list(cfg.layer_kinds)),
        "position": str(tokens),
        "prefill_len": str(tokens),
    }
    cache = ModelCache.from_state(arrays, meta, cfg)
    mx.eval(cache.arrays())
    return cache


def decode_step(
    model,
    cache,
    device_memory: int | None = H100_MEMORY,
    cuda: bool = False,
    custom_kernels: bool | None = None,
):
    """One decode step of every row of `cache` as the GPU runs it (`cuda`, `custom_kernels`: as
    `gpu_graph` takes them): (its kernels by name, the host seconds building it). The step is
    traced first, then counted and timed as replayed; `cache` is left evaluated, two steps on
    (the values are the stand-ins', so only the shapes mean anything), for the next count."""
    from salabatch.engine.decode import DecodeStep, decode

    ids = mx.zeros((cache.rows,), dtype=mx.int32)
    model.decoder = DecodeStep(model)  # traced afresh: the kernels taken depend on `cuda`
    with gpu_graph(device_memory, cuda, custom_kernels):
        mx.eval(decode(model, ids, cache), cache.arrays())
        start = time.perf_counter()
        logits = decode(model, ids, cache)
        seconds = time.perf_counter() - start
        counts = nodes(logits, *cache.arrays())
        mx.eval(logits, cache.arrays())  # else the next count would take this step in
        return counts, seconds


def verify_pass(model, cache, tokens: int = 5, device_memory: int | None = H100_MEMORY):
    """A speculative verify pass over `tokens` positions of every row of `cache` (its newest
    token and `tokens` - 1 drafts) as the GPU runs it today: (its kernels by name, the host
    seconds building it). Built on a fork of the rows; `cache` is left as it was."""
    rows = cache.select(range(cache.rows))
    rows.checkpoint()
    ids = mx.zeros((cache.rows, tokens), dtype=mx.int32)
    with gpu_graph(device_memory):
        start = time.perf_counter()
        logits = model(ids, rows)
        seconds = time.perf_counter() - start
        return nodes(logits, *rows.arrays()), seconds


def peer_decode_step(tokens: int, dtype: mx.Dtype = mx.bfloat16, hidden: int = 256):
    """The dense peer's decode step (mlx-lm's llama at Qwen3-8B's 36 layers and attention,
    small width) after `tokens` of context, as the GPU runs it; None without mlx-lm."""
    try:
        from mlx_lm.models import llama
        from mlx_lm.models.cache import make_prompt_cache
    except ImportError:
        return None
    from salabatch.bench.long import random_init

    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=36,
        intermediate_size=4 * hidden, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, vocab_size=4096, rope_theta=1e6,
        tie_word_embeddings=False,
    )  # fmt: skip
    peer = random_init(llama.Model(args), dtype, seed=0)
    cache = make_prompt_cache(peer)
    for c in cache:  # the context, as zeros, without a prefill; room to grow, as mid-answer
        c.keys = mx.zeros((1, 8, tokens + c.step, 128), dtype)
        c.values = mx.zeros((1, 8, tokens + c.step, 128), dtype)
        c.offset = tokens
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    with gpu_graph():
        logits = peer(mx.zeros((1, 1), dtype=mx.int32), cache=cache)[:, -1]
        return nodes(logits, *[a for c in cache for a in (c.keys, c.values)])


def report(contexts: list[int], chunk: int = 8192, batch: int = 8) -> dict:
    """`bench long --graph`: per context, kernels of SALA's decode step (batch 1 and `batch`,
    MLX's ops as Metal runs them; batch 1 also on CUDA, with its MLX ops and with every custom
    kernel) and of a speculative verify pass of 5 positions (batch 1), the peer's decode step
    (counted at 4K: the same at every context), of an 8K prefill chunk in a
    sparse and in a lightning layer, the host seconds building them, and the estimated FLOPs
    and bytes of each part of a prefill chunk and a decode step, SALA (9B) and the peer
    (Qwen3-8B shapes), bf16 (`bench.costs`)."""
    from salabatch.bench import costs
    from salabatch.bench.long import SHAPES
    from salabatch.engine.cache import LightningCache
    from salabatch.engine.config import ModelConfig

    model = sala_model()
    sparse, lightning = sala_layers()
    cfg9, peer_args = ModelConfig.from_dict(SHAPES["9b"].sala), SHAPES["9b"].peer
    peer = peer_decode_step(4096)  # its graph is the same at every context (and its KV cache
    peer = None if peer is None else kernels(peer)  # at 256K would be ~38 GB of zeros)
    rows = []
    for n in contexts:
        row: dict = {"context": n}
        for b in (1, batch):
            cache = filled_model_cache(model, n).fork(b)
            cache.reserve(2 * 64 + 16 + 256)  # a fork's tail, a question, 256 answer tokens
            counts, seconds = decode_step(model, cache)
            row[f"decode_b{b}_kernels"] = kernels(counts)
            row[f"decode_b{b}_host_s"] = round(seconds, 4)
            if b == 1:  # a speculative pass of 5 positions (4 drafts), as a GPU runs it now
                counts, seconds = verify_pass(model, cache)
                row["verify5_b1_kernels"] = kernels(counts)
                row["verify5_b1_host_s"] = round(seconds, 4)
                # on CUDA with every custom kernel on (some are off by default: kernels/*_cuda.py)
                for key, custom in (("cuda_ops", False), ("cuda", True)):
                    counts = decode_step(model, cache, cuda=True, custom_kernels=custom)[0]
                    row[f"decode_b1_kernels_{key}"] = kernels(counts)
        row["peer_decode_b1_kernels"] = peer
        row["prefill_chunk"] = tail = min(chunk, n)  # the prompt's last chunk: at most all of it
        counts, seconds = prefill_chunk(sparse, filled_sparse_cache(sparse, n - tail, n), tail)
        row["prefill_sparse_layer_kernels"] = kernels(counts)
        row["prefill_sparse_layer_host_s"] = round(seconds, 3)
        cache = filled_sparse_cache(sparse, n - tail, n)
        row["prefill_sparse_layer_kernels_cuda"] = kernels(
            prefill_chunk(sparse, cache, tail, cuda=True)[0]
        )
        for key, cuda in (("", False), ("_cuda", True)):
            state = LightningCache(mx.zeros((1, 32, 128, 128), dtype=mx.float32))
            mx.eval(state.state)  # a cache's state is evaluated: not a kernel of the chunk
            counts = prefill_chunk(lightning, state, tail, cuda=cuda)[0]
            row[f"prefill_lightning_layer_kernels{key}"] = kernels(counts)
        for name, step, q in (("prefill", False, tail), ("decode_b1", True, 1)):
            s = costs.sala(cfg9, n, queries=q, decode=step, itemsize=2)
            p = costs.peer(peer_args, n, queries=q, decode=step, itemsize=2)
            row[f"{name}_costs"] = {
                "sala": {k: [c.flops, c.bytes] for k, c in s.items()},
                "peer": {k: [c.flops, c.bytes] for k, c in p.items()},
                "sala_total": [costs.total(s).flops, costs.total(s).bytes],
                "peer_total": [costs.total(p).flops, costs.total(p).bytes],
            }
        rows.append(row)
    return {"chunk": chunk, "batch": batch, "rows": rows}


def report_table(result: dict) -> str:
    """The terminal table of `report`: kernels, then estimated TFLOPs and GB per context."""
    batch = result["batch"]
    lines = [
        f"{'context':>8} | decode kernels: SALA b1 Metal (CUDA: ops, kernels) {f'b{batch}':>5} "
        "peer verify5 "
        f"| prefill chunk (≤ {result['chunk']} tokens) kernels: sparse layer (CUDA kernels), "
        "lightning layer (CUDA kernels) | "
        "est. prefill chunk "
        "TFLOP SALA/peer, GB SALA/peer | est. decode step GFLOP SALA/peer, GB SALA/peer"
    ]
    for r in result["rows"]:
        pre, dec = r["prefill_costs"], r["decode_b1_costs"]
        lines.append(
            f"{r['context']:>8} | {r['decode_b1_kernels']:>33} "
            f"({r.get('decode_b1_kernels_cuda_ops', '–')}, {r['decode_b1_kernels_cuda']}) "
            f"{r[f'decode_b{batch}_kernels']:>5} "
            f"{r['peer_decode_b1_kernels'] or '–':>4} {r['verify5_b1_kernels']:>7} | "
            f"{r['prefill_sparse_layer_kernels']:>37} ({r['prefill_sparse_layer_kernels_cuda']}),"
            f" {r['prefill_lightning_layer_kernels']:>14} "
            f"({r.get('prefill_lightning_layer_kernels_cuda', '–')}) | "
            f"{pre['sala_total'][0] / 1e12:>7.1f} / {pre['peer_total'][0] / 1e12:.1f}, "
            f"{pre['sala_total'][1] / 1e9:.1f} / {pre['peer_total'][1] / 1e9:.1f} | "
            f"{dec['sala_total'][0] / 1e9:>6.1f} / {dec['peer_total'][0] / 1e9:.1f}, "
            f"{dec['sala_total'][1] / 1e9:.2f} / {dec['peer_total'][1] / 1e9:.2f}"
        )
    return "\n".join(lines)
