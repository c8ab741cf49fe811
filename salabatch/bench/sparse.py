"""InfLLM-v2 cost on a tiny random model: decode time of one sparse layer against context length
(next to dense attention over the same keys), and peak memory of a long chunked prefill.

The model keeps the 9B's sparse settings (dense_len 8192, window 2048, top-k 64: 96 blocks per
query) with small widths so that a CPU can run it: hidden 256, 8 query / 2 kv heads of 32.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx

from salabatch.bench import time_ms
from salabatch.engine.config import SparseConfig
from salabatch.engine.kernels.attention import attention
from salabatch.engine.sparse_cache import SparseKVCache


def bench_config() -> dict:
    return {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 16,
        "mixer_types": ["lightning-attn", "minicpm4"],
        "sparse_config": asdict(SparseConfig()),  # the 9B's InfLLM-v2 settings
    }


def load_bench_model():
    from salabatch.demo.checkpoint import write_random_checkpoint
    from salabatch.engine.load import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp), bench_config())
        return load_model(path, dtype="float32")


def filled_cache(n: int, sparse: SparseConfig, kv_heads: int, head_dim: int) -> SparseKVCache:
    """A sparse-layer cache holding n random keys/values (compressed keys included)."""
    cache = SparseKVCache(sparse)
    for start in range(0, n, 8192):
        size = min(8192, n - start)
        k, v = (mx.random.normal((1, kv_heads, size, head_dim)) for _ in range(2))
        cache.append(k, v)
        mx.eval(cache.keys.data, cache.values.data, *(c.data for c in cache.compressed))
    return cache


def decode_rows(model, contexts: list[int], steps: int) -> list[dict]:
    cfg = model.config
    attn = model.layers[1].self_attn
    rows = []
    for n in contexts:
        mx.random.seed(n)
        cache = filled_cache(n, cfg.sparse, cfg.num_key_value_heads, cfg.head_dim)
        x = mx.random.normal((1, 1, cfg.hidden_size))
        offset = [n]

        def sparse_step(cache=cache, x=x, offset=offset):
            out = attn(x, cache, offset[0])
            offset[0] += 1
            return out

        sparse = time_ms(sparse_step, repeat=steps)
        q = mx.random.normal((1, cfg.num_attention_heads, 1, cfg.head_dim))
        keys, values = cache.kv_view().parts()
        dense = time_ms(lambda q=q, k=keys, v=values: attention(q, k, v, attn.scale), steps)
        rows.append(
            {
                "context": n,
                "sparse_layer_decode_ms": sparse["median_ms"],
                "dense_attention_only_ms": dense["median_ms"],
                "blocks_attended": min(cfg.sparse.topk_eff, -(-n // 64)),
                "cache_mb": round(cache.nbytes / 2**20, 1),
            }
        )
    return rows


def prefill_row(model, tokens: int, chunk: int) -> dict:
    ids = mx.random.randint(3, model.config.vocab_size, (1, tokens))
    cache = model.make_cache()
    cache.plan_prefill(tokens)
    mx.eval(ids)
    mx.reset_peak_memory()
    start = time.perf_counter()
    for s in range(0, tokens, chunk):
        h = model.hidden(ids[:, s : s + chunk], cache)
        mx.eval(
            model.logits(h[:, -1:]),
            *(c.state if hasattr(c, "state") else c.keys.data for c in cache),
        )
    seconds = time.perf_counter() - start
    heads = model.config.num_attention_heads
    return {
        "prefill_tokens": tokens,
        "chunk": chunk,
        "seconds": round(seconds, 1),
        "tok_s": round(tokens / seconds, 1),
        "peak_memory_gb": round(mx.get_peak_memory() / 2**30, 3),
        "cache_gb": round(cache.nbytes / 2**30, 3),
        "one_TxT_fp32_score_matrix_gb": round(heads * tokens * tokens * 4 / 2**30, 1),
    }


def run(contexts: list[int], prefill_tokens: int, chunk: int, steps: int = 8) -> dict:
    from salabatch.engine.kernels.attention import on_gpu
    from salabatch.engine.memory import cache_limit
    from salabatch.engine.runtime import engine_runtime

    model = load_bench_model()
    with engine_runtime(cache_limit(model.config, chunk, on_gpu())):
        result = {"model": bench_config(), "decode": decode_rows(model, contexts, steps)}
        if prefill_tokens:
            result["prefill"] = prefill_row(model, prefill_tokens, chunk)
    return result
