"""Long context, side by side: MiniCPM-SALA against the dense model a user would pick instead,
mlx-lm's llama, both with random weights, on the current device, in one run.

Shapes: on a GPU, the 9B itself against Qwen3-8B's shapes (hidden 4096, 36 layers, 32 query /
8 kv heads of 128, MLP 12288, vocab 151936) in bfloat16; on a CPU, both at 1/16 of the 9B's
width and the same small dims (hidden 256, 8 layers, 8 query / 2 kv heads of 32, MLP 1024, vocab
4096), SALA keeping its 9B sparse settings (dense below 8192 tokens, 2048-token window, top-64
blocks) with 3 of its 8 layers sparse, in float32.

Per context: prefill in chunks the way each engine runs it (SALA's planned chunked prefill;
mlx-lm's model call per chunk with its KV cache) up to the first token's logits; then a
16-token question on top and greedy decode steps, at batch 1 for both and, for SALA, at batch
`batch` with every row forked from the one prefilled document (what `salabatch run` does with
a document's questions). Peak memory is MLX's peak over prefill and batch-1 decode, weights
included. Decode speed is the median step, each built then waited on (the host's part, the
graph's building, reported apart); at batch 1 also the mean step as a generation loop runs
them (`decode_b1_pipelined_tok_s`: each step queued as soon as it is built, the host building
the next while the device runs it, as mlx-lm's generation and `salabatch run` do).
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_map

from salabatch.demo.checkpoint import sala_config
from salabatch.errors import ConfigError

SALA_9B_SPARSE_LAYERS = (0, 9, 16, 17, 22, 29, 30, 31)
# The peer's MLX buffer cache: a quarter of RAM, at most 8 GB (what SALA had too until issue 34)
PEER_CACHE = min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4, 8 << 30)
QUESTION_TOKENS = 16


@dataclass(frozen=True)
class Shapes:
    """One pair of models of the same width: SALA's config.json and mlx-lm llama's args."""

    name: str
    sala: dict
    peer: dict


def _sala(hidden, layers, heads, kv_heads, head_dim, mlp, vocab, sparse_layers, base) -> dict:
    """The 9B's InfLLM-v2 settings at every width."""
    return sala_config(
        vocab=vocab,
        hidden=hidden,
        intermediate=mlp,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        sparse_layers=sparse_layers,
        dim_model_base=base,
    )


def _llama(hidden, layers, heads, kv_heads, head_dim, mlp, vocab, rope_theta) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": mlp,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": rope_theta,
        "tie_word_embeddings": False,
    }


SHAPES = {
    "9b": Shapes(
        "MiniCPM-SALA 9B vs Qwen3-8B shapes",
        _sala(4096, 32, 32, 2, 128, 16384, 73448, SALA_9B_SPARSE_LAYERS, 256),
        _llama(4096, 36, 32, 8, 128, 12288, 151936, 1e6),
    ),
    "small": Shapes(
        "1/16-width SALA vs llama of the same dims",
        _sala(256, 8, 8, 2, 32, 1024, 4096, (0, 4, 7), 16),
        _llama(256, 8, 8, 2, 32, 1024, 4096, 1e4),
    ),
}


def defaults() -> dict:
    """What a run measures when not told: by the device."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return {"shapes": "9b", "contexts": [8192, 32768, 131072], "chunk": 8192}
    return {"shapes": "small", "contexts": [4096, 16384, 32768], "chunk": 2048}


def random_init(model, dtype: mx.Dtype, seed: int):
    """Replaces every parameter, before any is computed: projections N(0, 1/fan_in), norms 1.
    The modules' own initial values stay lazy and are never materialised."""
    leaves = []

    def init(p: mx.array) -> mx.array:
        if p.ndim == 1:
            return mx.ones(p.shape, dtype=dtype)
        leaves.append(p)
        k = mx.random.key(seed * 1_000_003 + len(leaves))
        return (mx.random.normal(p.shape, key=k) * (1 / math.sqrt(p.shape[-1]))).astype(dtype)

    model.update(tree_map(init, model.parameters()))
    mx.eval(model.parameters())
    return model


def build(kind: str, shapes: Shapes, dtype: mx.Dtype):
    if kind == "sala":
        from salabatch.engine.config import ModelConfig
        from salabatch.engine.model import Model

        model = random_init(Model(ModelConfig.from_dict(shapes.sala)), dtype, seed=0)
        model.fuse()  # as `load_model` leaves it: the decode step's projections fused,
        model.dtype = dtype  # its dtype named
        return model
    try:
        from mlx_lm.models import llama
    except ImportError:
        raise ConfigError(
            "the dense peer needs mlx-lm", expected="pip install 'salabatch[bench]'"
        ) from None
    return random_init(llama.Model(llama.ModelArgs(**shapes.peer)), dtype, seed=0)


class _Sala:
    """The engine as the pipeline drives it."""

    def __init__(self, model) -> None:
        self.model = model

    def prefill(self, ids: mx.array, chunk: int):
        from salabatch.engine.generate import prefill

        cache = self.model.make_cache()
        logits = prefill(self.model, ids[0].tolist(), cache, chunk)
        mx.eval(logits)
        return cache

    def rows(self, doc, questions: list[mx.array]):
        from salabatch.engine.cache import ModelCache

        rows = []
        for q in questions:
            row = doc.fork(1)
            mx.eval(self.model(q, row))
            rows.append(row)
        return rows[0] if len(rows) == 1 else ModelCache.concat(rows)

    def step(self, ids: mx.array, cache) -> mx.array:
        from salabatch.engine.decode import decode

        return decode(self.model, ids[:, 0], cache)[:, None]


class _Peer:
    """mlx-lm's llama as mlx-lm drives it: a model call per chunk, then its caches evaluated."""

    def __init__(self, model) -> None:
        self.model = model

    def prefill(self, ids: mx.array, chunk: int):
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        *head, last = range(0, ids.shape[1], chunk)
        for s in head:
            self.model(ids[:, s : s + chunk], cache=cache)
            mx.eval([c.state for c in cache])
        mx.eval(self.model(ids[:, last:], cache=cache)[:, -1])
        return cache

    def rows(self, doc, questions: list[mx.array]):
        (q,) = questions  # the peer runs batch 1 only
        mx.eval(self.model(q, cache=doc))
        return doc

    def step(self, ids: mx.array, cache) -> mx.array:
        return self.model(ids, cache=cache)


def _tokens(n: int, vocab: int, seed: int, rows: int = 1) -> mx.array:
    return mx.random.randint(3, vocab, (rows, n), key=mx.random.key(seed)).astype(mx.int32)


def _greedy(engine, tok: mx.array, cache) -> mx.array:
    """One greedy step of every row: tokens [B, 1] → the next [B, 1] (lazy)."""
    return mx.argmax(engine.step(tok, cache)[:, -1:], axis=-1).astype(mx.int32)


def _decode(engine, cache, rows: int, vocab: int, steps: int) -> tuple[float, float]:
    """Median seconds of one greedy step of `rows` rows, and of the host's part of it: building
    the step's graph, before the device is waited on (unoverlapped here, so the device's part is
    the difference)."""
    tok = _tokens(1, vocab, seed=7, rows=rows).reshape(rows, 1)
    times, builds = [], []
    for i in range(steps + 2):
        start = time.perf_counter()
        tok = _greedy(engine, tok, cache)
        built = time.perf_counter()
        mx.eval(tok)
        if i >= 2:  # warm-up steps: buffers, compiled graphs
            times.append(time.perf_counter() - start)
            builds.append(built - start)
    return sorted(times)[len(times) // 2], sorted(builds)[len(builds) // 2]


def _pipelined(engine, cache, rows: int, vocab: int, steps: int) -> float:
    """Seconds a greedy step of `rows` rows as a generation loop runs them (mlx-lm's and
    `salabatch run`'s): each step queued (`mx.async_eval`) as soon as it is built, the host
    building the next while the device runs it, so the host's part is hidden where the
    device's is longer. Mean over `steps` steps after two that warm up."""
    tok = _tokens(1, vocab, seed=8, rows=rows).reshape(rows, 1)
    for _ in range(2):
        tok = _greedy(engine, tok, cache)
        mx.eval(tok)
    start = time.perf_counter()
    for _ in range(steps):
        tok = _greedy(engine, tok, cache)
        mx.async_eval(tok)
    mx.eval(tok)
    return (time.perf_counter() - start) / steps


def measure(
    kind: str, model, n: int, chunk: int, batch: int, steps: int, vocab: int, bound: bool = True
) -> dict:
    """One context's figures; SALA within its memory plan, as `salabatch run` holds a document
    (`memory.bounded`; with `bound` False, under MLX's own limit), the peer as mlx-lm runs."""
    if kind != "sala" or not bound:
        engine = _Sala(model) if kind == "sala" else _Peer(model)
        return _measure(engine, kind, n, chunk, batch, steps, vocab)
    from salabatch.engine import memory

    rows = [QUESTION_TOKENS + batch + 2 * steps + 4] * batch  # a question, then its steps
    plan = memory.model_plan(model, doc_tokens=n, rows=rows, chunk=chunk, batch_size=batch)
    with memory.bounded(plan):
        return _measure(_Sala(model), kind, n, chunk, batch, steps, vocab)


def _measure(engine, kind: str, n: int, chunk: int, batch: int, steps: int, vocab: int) -> dict:
    ids = _tokens(n, vocab, seed=n)
    mx.eval(ids)
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    doc = engine.prefill(ids, chunk)
    prefill_s = first_s = time.perf_counter() - start
    if mx.default_device().type == mx.DeviceType.gpu:
        # The first prefill in a process compiles its kernels (on CUDA, NVRTC: tens of
        # seconds); every later document runs them compiled. Both are reported, the second
        # is the one compared.
        del doc
        start = time.perf_counter()
        doc = engine.prefill(ids, chunk)
        prefill_s = time.perf_counter() - start
    question = _tokens(QUESTION_TOKENS, vocab, seed=1)
    one = engine.rows(doc, [question])
    b1, b1_host = _decode(engine, one, 1, vocab, steps)
    b1_queued = _pipelined(engine, one, 1, vocab, steps)
    row = {
        "model": kind,
        "context": n,
        "prefill_s": round(prefill_s, 3),
        "prefill_tok_s": round(n / prefill_s, 1),
        "prefill_first_s": round(first_s, 3),
        "decode_b1_tok_s": round(1 / b1, 2),
        "decode_b1_host_ms": round(b1_host * 1e3, 2),
        "decode_b1_pipelined_tok_s": round(1 / b1_queued, 2),
        "peak_gb": round(mx.get_peak_memory() / 2**30, 3),
    }
    if kind == "sala" and batch > 1:
        del one
        questions = [_tokens(QUESTION_TOKENS + i, vocab, seed=10 + i) for i in range(batch)]
        many = engine.rows(doc, questions)
        bn, bn_host = _decode(engine, many, batch, vocab, steps)
        row[f"decode_b{batch}_tok_s"] = round(batch / bn, 2)
        row[f"decode_b{batch}_host_ms"] = round(bn_host * 1e3, 2)
        row[f"peak_gb_b{batch}"] = round(mx.get_peak_memory() / 2**30, 3)
    return row


def run(
    contexts: list[int] | None = None,
    *,
    shapes: str | Shapes | None = None,
    batch: int = 8,
    steps: int = 48,
    chunk: int | None = None,
    dtype: str | None = None,
    peer: bool = True,
    bound: bool = True,
    progress=print,
    on_result=None,
) -> dict:
    """Every context for SALA, then for the peer (one model in memory at a time). `on_result`
    gets the result so far after each measurement (a run cut short keeps what it measured)."""
    from salabatch.engine.config import ModelConfig
    from salabatch.engine.kernels.attention import on_gpu
    from salabatch.engine.memory import cache_limit
    from salabatch.engine.runtime import engine_runtime, memory_cache, resolve_dtype

    auto = defaults()
    pair = shapes if isinstance(shapes, Shapes) else SHAPES.get(shapes or auto["shapes"])
    if pair is None:
        raise ConfigError("unknown shapes", field="shapes", expected=list(SHAPES), got=shapes)
    contexts = contexts or auto["contexts"]
    chunk = chunk or auto["chunk"]
    dt = resolve_dtype(dtype)
    rows = []
    for kind in ("sala", "peer") if peer else ("sala",):
        # SALA under salabatch's runtime (its buffer cache sized to the work); the peer with the
        # generous cache every earlier run gave it (a quarter of RAM, at most 8 GB)
        sala_limit = cache_limit(ModelConfig.from_dict(pair.sala), chunk, on_gpu())
        with engine_runtime(sala_limit) if kind == "sala" else memory_cache(PEER_CACHE):
            model = build(kind, pair, dt)
            vocab = pair.sala["vocab_size"] if kind == "sala" else pair.peer["vocab_size"]
            for n in contexts:
                progress(f"{kind}: {n} tokens …")
                rows.append(measure(kind, model, n, chunk, batch, steps, vocab, bound))
                if on_result is not None:
                    on_result(_result(pair, dt, chunk, batch, steps, rows, bound))
            del model
            gc.collect()
            mx.clear_cache()
    return _result(pair, dt, chunk, batch, steps, rows, bound)


def _result(
    pair: Shapes, dt: mx.Dtype, chunk: int, batch: int, steps: int, rows: list, bound: bool
) -> dict:
    from salabatch.engine.runtime import dtype_name

    return {
        "shapes": pair.name,
        "models": {"sala": pair.sala, "peer": pair.peer},
        "dtype": dtype_name(dt),
        "chunk": chunk,
        "batch": batch,
        "decode_steps": steps,
        "memory_bound": bound,  # SALA within its memory plan (`measure`)
        "results": list(rows),
        "ratios": ratios(rows, batch),
    }


def ratios(rows: list[dict], batch: int) -> list[dict]:
    """Per context: SALA against the peer, and SALA's batch and context scaling."""
    sala = {r["context"]: r for r in rows if r["model"] == "sala"}
    peer = {r["context"]: r for r in rows if r["model"] == "peer"}
    first = sala[min(sala)]["decode_b1_tok_s"] if sala else None
    out = []
    for n, s in sorted(sala.items()):
        r = {"context": n}
        if n in peer:
            p = peer[n]
            r["prefill_speedup"] = round(p["prefill_s"] / s["prefill_s"], 2)
            r["decode_b1_speedup"] = round(s["decode_b1_tok_s"] / p["decode_b1_tok_s"], 2)
            r["decode_b1_pipelined_speedup"] = round(
                s["decode_b1_pipelined_tok_s"] / p["decode_b1_pipelined_tok_s"], 2
            )
            # as every ratio here: > 1 favours SALA (the peer's peak over SALA's)
            r["peak_memory_saving"] = round(p["peak_gb"] / s["peak_gb"], 2)
        if f"decode_b{batch}_tok_s" in s:
            r[f"b{batch}_over_b1"] = round(s[f"decode_b{batch}_tok_s"] / s["decode_b1_tok_s"], 2)
        r["decode_vs_shortest"] = round(s["decode_b1_tok_s"] / first, 2)
        out.append(r)
    return out


def table(result: dict) -> str:
    """The terminal table: one line per context."""
    batch = result["batch"]
    rows = {(r["model"], r["context"]): r for r in result["results"]}
    lines = [
        f"{'context':>8} | {'prefill s SALA':>14} {'peer':>8} {'x':>6} | "
        f"{'decode b1 SALA':>14} {'peer':>7} {'x':>6} | {f'b{batch} SALA':>8} {'x b1':>5} | "
        f"{'peak GiB SALA':>13} {'peer':>6}"
    ]

    def cell(row, key, width, fmt="{:.1f}"):
        return f"{fmt.format(row[key]) if row and key in row else '–':>{width}}"

    for r in result["ratios"]:
        n = r["context"]
        s, p = rows.get(("sala", n)), rows.get(("peer", n))
        lines.append(
            f"{n:>8} | {cell(s, 'prefill_s', 14)} {cell(p, 'prefill_s', 8)} "
            f"{cell(r, 'prefill_speedup', 6, '{:.2f}')} | {cell(s, 'decode_b1_tok_s', 14)} "
            f"{cell(p, 'decode_b1_tok_s', 7)} {cell(r, 'decode_b1_speedup', 6, '{:.2f}')} | "
            f"{cell(s, f'decode_b{batch}_tok_s', 8)} {cell(r, f'b{batch}_over_b1', 5, '{:.2f}')} | "
            f"{cell(s, 'peak_gb', 13, '{:.2f}')} {cell(p, 'peak_gb', 6, '{:.2f}')}"
        )
    return "\n".join(lines)


def chart(result: dict, path: str, title: str) -> None:
    """Prefill time, decode speed and peak memory against context, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = result["batch"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    sala, sala_b, peer = (
        ("sala", "SALA", "C0"),
        ("sala_b", f"SALA b{batch}", "C2"),
        ("peer", "dense peer", "C1"),
    )
    series = [
        ("prefill_s", "prefill (s, lower is better)", [sala, peer]),
        ("decode", f"decode, batch 1 and {batch} (tok/s, higher is better)", [sala, sala_b, peer]),
        ("peak_gb", "peak memory (GiB, lower is better)", [sala, peer]),
    ]
    for ax, (key, label, lines) in zip(axes, series, strict=True):
        for who, name, color in lines:
            model = "sala" if who.startswith("sala") else "peer"
            field = key
            if key == "decode":
                field = f"decode_b{batch}_tok_s" if who == "sala_b" else "decode_b1_tok_s"
            pts = [
                (r["context"], r[field])
                for r in result["results"]
                if r["model"] == model and field in r
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
