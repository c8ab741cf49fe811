"""Where a SALA prefill chunk's time goes on a GPU: one 8K chunk through each part of a layer at
the 9B's shapes (hidden 4096, 32 heads, 2 kv heads, head dim 128, bf16, random weights; the
sparse layer's cache holds random keys, so its selection varies query by query), each part
timed alone: the median of 3 runs after one that compiles its kernels. Stage 1 is also timed
without its sort (scores and pooling only), and stage 2 in both its GPU forms whatever the
context (`sparse_attention.MASKED_KEYS` picks one in the engine): dense SDPA with the selection
as an additive mask, and the gathers of each query's blocks, checked against each other.
The sparse layer at each context comes first (a call cut short keeps what it measured), then
the lightning layer, decode's products (MLX's matmul and the rows kernel) and output
projections with their residual add (`addmm`, or a product and an add), and decode's compiled
step (batch 1, a 32K context of zeros) of
models at the 9B's width with 8 lightning layers, 8 sparse layers, and 1 lightning layer (the
embedding, the head and one layer), from which a layer of each kind costs what it adds, and a
sparse layer's decode attention split into stage 1 (with its top-k) and stage 2
(`profile_decode_attention`). The lightning layer is also cut short stage by stage
(`profile_lightning`), and its recurrence timed alone at 64-, 128- and 256-token chunks (the
GPU path's `gla_parallel` uses 64).

    python3 benchmarks/device-profile.py [CONTEXT ...]     (default: 32768 65536 131072)

Run on the device after `.device/p2/install.sh` (see benchmarks/device-gpu.sh); prints one line
per part as it goes, so a call cut short keeps what it measured. On the CPU it runs the GPU path
(`SALABATCH_GPU_PATH=1`) at a small width, to check the script, not to time it.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from contextlib import contextmanager

import mlx.core as mx

from salabatch.bench.graph import SALA_9B_HEADS, filled_sparse_cache
from salabatch.bench.long import random_init
from salabatch.demo.checkpoint import sala_config
from salabatch.engine.cache import LightningCache
from salabatch.engine.config import ModelConfig
from salabatch.engine.kernels import (
    decode_cuda,
    gla_cuda,
    norm_cuda,
    rows_cuda,
    scores_cuda,
    sparse_attention,
    stage1_cuda,
    stage2_cuda,
)
from salabatch.engine.kernels.attention import on_gpu
from salabatch.engine.kernels.gla import gla, gla_parallel
from salabatch.engine.kernels.sparse_attention import MASKED_KEYS, block_sparse_attention
from salabatch.engine.kernels.sparse_select import _k_smallest, _pooled, select_blocks
from salabatch.engine.lightning import LightningAttention
from salabatch.engine.sparse import SparseAttention

CHUNK = 8192
REGISTERS = {True: "registers", False: "shared memory"}  # where stage 2's kernel keeps q


def timed(name: str, fn, flops: float | None = None, nbytes: float | None = None) -> None:
    """Print the median seconds of `fn` (evaluated) over 3 runs after a first that compiles,
    with the rate of `flops` or of `nbytes` read where given."""
    start = time.perf_counter()
    mx.eval(fn())
    first = time.perf_counter() - start
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(fn())
        runs.append(time.perf_counter() - start)
    s = sorted(runs)[1]
    rate = f"  {flops / s / 1e12:6.1f} TFLOP/s" if flops else ""
    rate += f"  {nbytes / s / 1e9:6.0f} GB/s" if nbytes else ""
    print(f"{name:<44} {s * 1e3:9.3f} ms  (first {first:6.2f} s){rate}", flush=True)


@contextmanager
def kernel_off(module):
    """Within the block, the custom kernel of `module` (`kernels/*_cuda.py`) is off."""
    kernel = module.available
    module.available = lambda: False
    try:
        yield
    finally:
        module.available = kernel


def main(
    contexts: list[int], hidden: int | None = None, chunk: int | None = None, dt=None,
    decode_context: int = 32768,
) -> None:
    """The sizes default to the 9B's on a GPU, small ones on the CPU (where a test runs every
    part, kernels included, with stand-ins: `tests/bench/test_device_profile.py`)."""
    gpu = mx.default_device().type == mx.DeviceType.gpu
    hidden = hidden or (4096 if gpu else 256)
    chunk = chunk or (CHUNK if gpu else 1024)
    dt = dt or (mx.bfloat16 if gpu else mx.float32)  # the CPU's gather_mm is float32 only
    raw = sala_config(
        vocab=256, hidden=hidden, intermediate=hidden, layers=2, sparse_layers=(0,),
        **SALA_9B_HEADS,
    )  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    sparse = random_init(SparseAttention(cfg), dt, seed=0)
    lightning = random_init(LightningAttention(cfg), dt, seed=1)
    device = mx.default_device()
    print(f"device {device}, GPU path {on_gpu()}, hidden {hidden}, chunk {chunk}", flush=True)

    x = (mx.random.normal((1, chunk, hidden), key=mx.random.key(0)) * 0.5).astype(dt)
    w = (mx.random.normal((hidden, 3 * hidden), key=mx.random.key(1)) * 0.02).astype(dt)
    mx.eval(x, w)
    # The sparse layer's parts first: where the prefill's time goes at each context, and each
    # stage's CUDA kernel beside its MLX-op form (a call cut short keeps what it measured; on
    # the H100 of 2026-11-27 a 100 s profile ended in the lightning layer, before these)
    for n in contexts:
        profile_context(sparse, cfg, x, n, chunk, dt)
    timed(f"matmul [{chunk}, {hidden}] x [{hidden}, {3 * hidden}]", lambda: x @ w,
          2 * chunk * hidden * 3 * hidden)  # fmt: skip

    # then the lightning layer (its recurrence's kernel beside the MLX ops), decode's products
    state = mx.zeros((1, 32, 128, 128), mx.float32)
    mx.eval(state)
    whole = "lightning layer, whole (8K chunk)"
    kernel = gla_cuda.available()  # its parity passed: the layer through it, then without it
    if kernel:
        timed(f"{whole}, recurrence CUDA kernel", lambda: lightning(x, LightningCache(state), 0))
    with kernel_off(gla_cuda):
        timed(whole, lambda: lightning(x, LightningCache(state), 0))
        profile_lightning(lightning, x, state, kernel)

    # the lightning recurrence alone (float32, as the layer runs it), by chunk length
    shape = (1, 32, chunk, 128)
    qkv = [mx.random.normal(shape, key=mx.random.key(20 + i)) for i in range(3)]
    g = lightning._log_decay
    mx.eval(qkv, g)
    for c in (64, 128, 256):
        timed(f"lightning recurrence alone, {c}-token chunks",
              lambda c=c: gla_parallel(*qkv, g, 0.1, state, chunk=c))  # fmt: skip

    profile_rows_products(hidden, dt)
    profile_residual_products(hidden, dt)
    profile_decode(hidden, dt, decode_context)


def profile_lightning(layer, x, state, kernel: bool) -> None:
    """The lightning layer's chunk cut short at each stage, each line including the ones
    before: its q, k and v projections; then their norms and ropes (`core` with the recurrence
    replaced by a cast of q); then the recurrence (`core`: o rounded to the layer's dtype);
    the whole layer adds o_norm, the gate and o_proj. Also the recurrence alone on the q, k, v
    the layer feeds it (bf16 strided views: what its casts read), against the float32
    contiguous ones of the line after."""
    from salabatch.engine import lightning as module

    timed("lightning: q, k, v projections", lambda: [p(x) for p in (layer.q_proj, layer.k_proj,
                                                                    layer.v_proj)])  # fmt: skip
    fed = []

    def no_recurrence(q, k, v, g, scale, S, out_dtype):
        fed[:] = [q, k, v, g, scale, S, out_dtype]
        return q.astype(out_dtype), S

    module.gla = no_recurrence
    try:
        timed("lightning: + norms and ropes", lambda: layer.core(x, LightningCache(state), 0))
    finally:
        module.gla = gla
    timed("lightning: + the recurrence (core)", lambda: layer.core(x, LightningCache(state), 0))
    mx.eval(fed[:3])
    q, k, v, g, scale, S, out_dtype = fed
    timed("lightning recurrence alone, the layer's q, k, v",
          lambda: gla_parallel(q, k, v, g, scale, S, out_dtype=out_dtype))  # fmt: skip
    if kernel and gla_cuda.supports(q, k, v):
        timed("lightning recurrence alone, CUDA kernel",
              lambda: gla_cuda.gla(q, k, v, g, scale, S, out_dtype))  # fmt: skip
        o, _ = gla_cuda.gla(q, k, v, g, scale, S, out_dtype)
        want, _ = gla_parallel(q, k, v, g, scale, S, out_dtype=out_dtype)
        diff = (o.astype(mx.float32) - want.astype(mx.float32)).abs().max().item()
        print(f"lightning recurrence, CUDA kernel: {diff:.3g} at most from the MLX ops",
              flush=True)  # fmt: skip


def profile_decode(hidden: int, dt, context: int = 32768) -> None:
    """Medians of 32 compiled decode steps at batch 1 (a row forked from a `context`-token
    document of zeros) of models of the 9B's width and head with 8 lightning, 8 sparse and 1
    lightning layer(s)."""
    from salabatch.bench.graph import filled_model_cache
    from salabatch.bench.long import SHAPES
    from salabatch.engine.decode import DecodeStep
    from salabatch.engine.model import Model

    nine = SHAPES["9b"].sala
    vocab, mlp = (nine["vocab_size"], nine["intermediate_size"]) if hidden == 4096 else (4096, 1024)
    # the kernels each step is also timed without (what they replace, as the log names it)
    without = {
        "8 lightning": ((gla_cuda, "recurrence"), (norm_cuda, "residual adds and norms"),
                        (rows_cuda, "products")),
        "8 sparse": ((decode_cuda, "selection"),),
    }  # fmt: skip
    steps = {}
    for name, layers, sparse_layers in (
        ("8 lightning", 8, ()),
        ("8 sparse", 8, range(8)),
        ("1 lightning", 1, ()),
    ):
        raw = sala_config(
            vocab=vocab, hidden=hidden, intermediate=mlp, layers=layers,
            sparse_layers=sparse_layers, **SALA_9B_HEADS,
        )  # fmt: skip
        model = random_init(Model(ModelConfig.from_dict(raw)), dt, seed=2)
        model.fuse()  # as load_model does
        # a row forked from the document, as `bench long` and `salabatch run` decode: the
        # document's keys shared, the row's own few (an unforked row re-sums all its keys' chunks)
        cache = filled_model_cache(model, context).fork(1)
        cache.reserve(256)  # the row's own keys (< 128) and the 35 steps: one buffer shape
        ids = mx.zeros((1,), dtype=mx.int32)

        steps[name] = median_step(model, ids, cache)
        print(f"decode step, {name} layer(s), {context} context: {steps[name] * 1e3:8.2f} ms",
              flush=True)  # fmt: skip
        if name == "8 sparse":
            profile_decode_attention(model, cache)
        for module, part in without.get(name, ()):
            if module.available():  # its parity passed: the same step with its MLX ops
                with kernel_off(module):
                    model.decoder = DecodeStep(model)  # traced again, without the kernel
                    s = median_step(model, ids, cache)
                print(f"decode step, {name} layer(s), {part} as MLX ops: {s * 1e3:8.2f} ms",
                      flush=True)  # fmt: skip
                model.decoder = DecodeStep(model)
        del model, cache
    light = (steps["8 lightning"] - steps["1 lightning"]) / 7
    sparse = light + (steps["8 sparse"] - steps["8 lightning"]) / 8
    head = steps["1 lightning"] - light
    print(f"decode, per layer: lightning {light * 1e3:.3f} ms, sparse {sparse * 1e3:.3f} ms; "
          f"embedding + head {head * 1e3:.3f} ms; the 9B (24 + 8 layers) "
          f"{(24 * light + 8 * sparse + head) * 1e3:.2f} ms", flush=True)  # fmt: skip


def median_step(model, ids, cache) -> float:
    """The median of 32 decode steps of `cache`'s rows (seconds), after 3 that trace and settle
    the buffers."""
    from salabatch.engine.decode import decode

    for _ in range(3):
        mx.eval(decode(model, ids, cache), cache.arrays())
    times = []
    for _ in range(32):
        start = time.perf_counter()
        mx.eval(decode(model, ids, cache), cache.arrays())
        times.append(time.perf_counter() - start)
    return sorted(times)[16]


def profile_decode_attention(model, cache) -> None:
    """A sparse layer's decode attention (`sparse_decode.decode_attention`, batch 1, the row
    forked from the document) and its two parts, stage 1 with its top-k and stage 2, each as one
    compiled graph over the 8 layers' caches (the device runs them back to back, as in a step),
    per layer; stage 2 also with the G query heads as heads (q [n, G, 1, d]: one query a head,
    which MLX's CUDA SDPA runs unfused where a mask is given) instead of as one head's rows."""
    from salabatch.engine.kernels import sparse_decode as sd
    from salabatch.engine.kernels.attention import attention

    sc, cfg = model.config.sparse, model.config
    info, tables, layers, _ = model.decoder.inputs(cache)
    layers = [arrays for arrays, _ in layers if isinstance(arrays, tuple)]  # the sparse ones
    H, d = cfg.num_attention_heads, cfg.head_dim
    dt = layers[0][0][0].dtype
    qs = [mx.random.normal((1, H, 1, d), key=mx.random.key(30 + i)).astype(dt)
          for i in range(len(layers))]  # fmt: skip
    rows, shared = layers[0]
    n_blocks = (rows[0].shape[2] + (shared[0].shape[2] if shared else 0)) // sc.block_size
    k = min(sc.topk_eff, n_blocks)
    common = dict(scale=model.layers[0].self_attn.scale, block=sc.block_size)

    def whole(qs):
        return [sd.decode_attention(q, rows, sh, info, tables, mode=sd.SPARSE, k=sc.topk_eff,
                                    dense_len=sc.dense_len, init_blocks=sc.init_blocks,
                                    local_blocks=sc.local_blocks, compression=sc.compression,
                                    **common)[0]
                for q, (rows, sh) in zip(qs, layers, strict=True)]  # fmt: skip

    def stage1(qs):
        return [sd._select_step(q, rows[0], sh[2:], info, tables, n_blocks, k, common["scale"],
                                sc.init_blocks, sc.local_blocks, sc.block_size, sc.compression)
                for q, (rows, sh) in zip(qs, layers, strict=True)]  # fmt: skip

    idx = stage1(qs)
    mx.eval(idx)

    def stage2(qs):
        return [sd._attend_step(q, i, info, rows, sh[:2], tables["first"], common["scale"],
                                common["block"], padded=False)
                for q, i, (rows, sh) in zip(qs, idx, layers, strict=True)]  # fmt: skip

    def heads_as_heads(q, keys, values, scale, mask):  # q [n, 1, G, d] → [n, G, 1, d] and back
        n, _, G, _ = q.shape
        return attention(q.reshape(n, G, 1, d), keys, values, scale, mask).reshape(q.shape)

    def stage2_heads(qs):  # `_attend_step` as it is, its SDPA given the heads as heads
        sd.attention = heads_as_heads
        try:
            return stage2(qs)
        finally:
            sd.attention = attention

    def mlx_ops(fn):  # a part as MLX ops where the decode step's CUDA kernels are on
        def run(qs):
            with kernel_off(decode_cuda):
                return fn(qs)

        return run

    n = len(layers)
    forms = [("whole", whole), ("stage 1 + top-k", stage1), ("stage 2", stage2),
             ("stage 2, G heads as heads", mlx_ops(stage2_heads))]  # fmt: skip
    if decode_cuda.available():  # the above through the CUDA kernels, these without
        forms += [("whole, MLX ops", mlx_ops(whole)), ("stage 1 + top-k, MLX ops",
                  mlx_ops(stage1)), ("stage 2, MLX ops", mlx_ops(stage2))]  # fmt: skip
    for name, fn in forms:
        graph = mx.compile(fn)
        start = time.perf_counter()
        mx.eval(graph(qs))
        first = time.perf_counter() - start
        runs = []
        for _ in range(9):
            start = time.perf_counter()
            mx.eval(graph(qs))
            runs.append(time.perf_counter() - start)
        s = sorted(runs)[4] / n
        print(f"decode attention, {name}, per layer {s * 1e3:9.3f} ms  (first {first:6.2f} s)",
              flush=True)  # fmt: skip


def profile_residual_products(hidden: int, dt) -> None:
    """A decode step's output projections with their residual add (1 and 8 rows, the
    attention's [hidden, hidden] and the MLP's [hidden, 4 hidden] weights): MLX's `addmm`
    (what `add_product` runs) against a plain product and a compiled multiply-add (what the
    step runs for the MLP's), as the weight's bytes a second."""
    split = mx.compile(lambda h, y, w: h + 1.4 * (y @ w.T))
    for name, inner in (("attention out", hidden), ("MLP down", 4 * hidden)):
        w = (mx.random.normal((hidden, inner), key=mx.random.key(3)) * 0.02).astype(dt)
        mx.eval(w)
        for rows in (1, 8):
            h = mx.random.normal((rows, hidden), key=mx.random.key(4)).astype(dt)
            y = mx.random.normal((rows, inner), key=mx.random.key(5)).astype(dt)
            mx.eval(h, y)
            forms = (
                ("addmm", lambda h=h, y=y, w=w: mx.addmm(h, y, w.T, alpha=1.4)),
                ("product, then add", lambda h=h, y=y, w=w: split(h, y, w)),
            )
            for form, fn in forms:
                timed(f"{rows} row(s), {name}: {form}", fn, nbytes=w.nbytes)


def profile_rows_products(hidden: int, dt, repeats: int = 8) -> None:
    """A decode step's products of 1 and 8 rows at the 9B's shapes, MLX's matmul (its
    matrix-vector kernel for one row, cuBLAS for more) against the rows kernel where its parity
    passed: `repeats` products a timing, so a call's launch and wait (~70 µs on an H100) spread
    over them, as the weight's bytes a second."""
    shapes = (("attention out", hidden, hidden), ("MLP down", hidden, 4 * hidden),
              ("MLP gate+up", 8 * hidden, hidden), ("head", 73448, hidden))  # fmt: skip
    for name, N, K in shapes:
        w = (mx.random.normal((N, K), key=mx.random.key(N)) * 0.02).astype(dt)
        mx.eval(w)
        for rows in (1, 8):
            x = mx.random.normal((rows, 1, K), key=mx.random.key(rows)).astype(dt)
            mx.eval(x)
            forms = [("MLX matmul", lambda x=x, w=w: [x @ w.T for _ in range(repeats)])]
            if rows_cuda.available() and rows_cuda.supports(x, w):
                for u in (2, 4, 8):
                    fn = functools.partial(rows_products, x, w, repeats, u)
                    forms.append((f"rows kernel, {u} loads in flight", fn))
                diff = (rows_cuda.product(x, w).astype(mx.float32) - (x @ w.T)).abs().max()
                print(f"{rows} row(s), {name}: the kernel {diff.item():.3g} at most from MLX's",
                      flush=True)  # fmt: skip
            for form, fn in forms:
                timed(f"{rows} row(s), {name} x{repeats}: {form}", fn, nbytes=repeats * w.nbytes)


def rows_products(x: mx.array, w: mx.array, repeats: int, in_flight: int) -> list[mx.array]:
    return [rows_cuda.product(x, w, in_flight) for _ in range(repeats)]


def profile_context(sparse, cfg, x, n: int, chunk: int, dt) -> None:
    """One sparse layer's parts at context n (tokens once the chunk is in)."""
    cache = filled_sparse_cache(sparse, n - chunk, n, dt)
    # random keys: each query's top-k differs, as a real document's does
    for i, buf in enumerate((cache.keys, cache.values, *cache.compressed)):
        a = buf.data
        buf.data = mx.random.normal(a.shape, key=mx.random.key(10 + i)).astype(a.dtype)
    mx.eval(cache.arrays())
    q, k, v = sparse.qkv(x, n - chunk)
    cache.append(k, v)
    mx.eval(q, cache.arrays())
    timed(f"{n}: sparse qkv projections", lambda: sparse.qkv(x, n - chunk))
    timed(f"{n}: sparse attend (stage 1 + 2)", lambda: sparse.attend(q, cache))
    sc = sparse.sparse
    kv = cache.kv_view()
    n_blocks = -(-n // sc.block_size)
    parts = [cache.chunk_parts(level) for level in range(len(sc.compression))]
    starts = [n - chunk]
    settings = dict(
        prefill_len=cache.prefill_len, n_blocks=n_blocks, k=min(sc.topk_eff, n_blocks),
        scale=sparse.scale, init_blocks=sc.init_blocks, local_blocks=sc.local_blocks,
        block=sc.block_size, compression=sc.compression,
    )  # fmt: skip
    if scores_cuda.available():  # its parity passed: stage 1 through it, then without it
        timed(f"{n}: stage 1 (select_blocks), block scores CUDA kernel",
              lambda: select_blocks(q, parts[0], parts[1], starts, **settings))  # fmt: skip
        fused = select_blocks(q, parts[0], parts[1], starts, **settings)
    with kernel_off(scores_cuda):
        timed(f"{n}: stage 1 (select_blocks)",
              lambda: select_blocks(q, parts[0], parts[1], starts, **settings))  # fmt: skip
        idx = select_blocks(q, parts[0], parts[1], starts, **settings)
    mx.eval(idx)
    if scores_cuda.available():
        same = mx.mean(mx.sort(fused, axis=-1) == mx.sort(idx, axis=-1)).item()
        print(f"{n}: stage 1, block scores kernel: {same:.4f} of the blocks the same", flush=True)
    # stage 2's useful work: K·block keys for each query and head, QK and PV
    useful = 2 * 2 * chunk * cfg.num_attention_heads * settings["k"] * sc.block_size * 128
    outs = {}
    with kernel_off(stage2_cuda):  # the MLX-op forms first
        for form, limit in (("masked", 1 << 62), ("gathered", 0)):
            sparse_attention.MASKED_KEYS = limit

            def stage2():
                return block_sparse_attention(q, kv, idx, starts, sparse.scale, sc.block_size)

            outs[form] = stage2()
            timed(f"{n}: stage 2, {form} form", stage2, useful)
    sparse_attention.MASKED_KEYS = MASKED_KEYS
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    # where its parity passed on this GPU
    if stage2_cuda.available() and stage2_cuda.supports(q, G, sc.block_size):
        for tile, qreg in itertools.product((2, 4, 8), (True, False)):

            def tiled(tile=tile, qreg=qreg):
                o = stage2_cuda.attend(
                    q.transpose(0, 2, 1, 3), kv.rows_k, kv.rows_v, idx,
                    mx.array(starts, dtype=mx.int32), sparse.scale, sc.block_size, tile, qreg,
                )  # fmt: skip
                return o.transpose(0, 2, 1, 3)

            form = f"kernel, {tile} queries a thread block, query in {REGISTERS[qreg]}"
            outs[form] = tiled()
            timed(f"{n}: stage 2, CUDA {form}", tiled, useful)
    a = outs["masked"].astype(mx.float32)
    for form, o in outs.items():
        diff = (o.astype(mx.float32) - a).abs().max().item()
        print(f"{n}: stage 2, {form}: {diff:.3g} at most from the masked form", flush=True)
    # stage 1 without its top-k: raw scores, softmax, head sum and pooling (the engine's
    # `_pooled`, every chunk seen)
    c1 = parts[0][0].astype(q.dtype)
    c2 = parts[1][0].astype(q.dtype)
    qg = q.reshape(1, 2, -1, chunk, 128)
    seen = [mx.full((1, chunk), c.shape[2], dtype=mx.int32) for c in (c1, c2)]

    def scores_only():
        s1, s2 = (qg @ c[:, :, None].swapaxes(-1, -2) for c in (c1, c2))
        return _pooled(s1, s2, *seen, sparse.scale, n_blocks, sc.block_size // sc.compression[0][1])

    def score_matmuls():
        return [qg @ c[:, :, None].swapaxes(-1, -2) for c in (c1, c2)]

    def folded_matmuls():  # the G heads as rows of one product per kv head: no broadcast batch
        rows = qg.reshape(1, 2, -1, 128)
        return [(rows @ c.swapaxes(-1, -2)).reshape(*qg.shape[:-1], -1) for c in (c1, c2)]

    timed(f"{n}: stage 1's two score matmuls alone", score_matmuls)
    timed(f"{n}: stage 1's two score matmuls, heads folded into rows", folded_matmuls)
    for a, b in zip(score_matmuls(), folded_matmuls(), strict=True):
        diff = (a.astype(mx.float32) - b.astype(mx.float32)).abs().max().item()
        print(f"{n}: stage 1, folded matmuls: {diff:.3g} at most from the batched", flush=True)
    s1, s2 = score_matmuls()
    mx.eval(s1, s2)
    r = sc.block_size // sc.compression[0][1]
    kernels = stage1_cuda.available
    if kernels():
        timed(f"{n}: stage 1 scores and pooling, no top-k (CUDA kernels)", scores_only)
        timed(f"{n}: stage 1 pooling alone, of the scores (CUDA kernels)",
              lambda: _pooled(s1, s2, *seen, sparse.scale, n_blocks, r))  # fmt: skip
    stage1_cuda.available = lambda: False
    timed(f"{n}: stage 1 scores and pooling, no top-k (MLX ops)", scores_only)
    stage1_cuda.available = kernels
    pooled = scores_only()
    mx.eval(pooled)
    top = min(96, pooled.shape[-1])  # the 9B's K, or every block of a small context
    timed(f"{n}: stage 1 sort alone (argsort of the blocks)",
          lambda: mx.argsort(pooled.astype(q.dtype), axis=-1)[..., :top])  # fmt: skip
    timed(f"{n}: stage 1 top-k alone (partition of unique keys, the engine's)",
          lambda: _k_smallest(-pooled.astype(q.dtype), top))  # fmt: skip
    timed(f"{n}: stage 1 top-k alone (mx.topk of the blocks)",
          lambda: mx.topk(pooled.astype(q.dtype), top, axis=-1))  # fmt: skip
    keys, values = kv.parts(n)
    dense = 2 * 2 * chunk * cfg.num_attention_heads * (n - chunk / 2) * 128
    timed(f"{n}: dense causal SDPA, for scale",
          lambda: mx.fast.scaled_dot_product_attention(
              q, keys[0] if len(keys) == 1 else mx.concatenate(keys, axis=2),
              values[0] if len(values) == 1 else mx.concatenate(values, axis=2),
              scale=sparse.scale, mask="causal"),
          dense)  # fmt: skip


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [32768, 65536, 131072])
