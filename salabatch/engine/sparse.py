"""Sparse attention layer (`minicpm4`, InfLLM-v2), SPEC §4.

x → q [H heads], k, v [Hk heads] (NoPE) → append k, v to the cache → attention: dense while the
total length is below `dense_len`, InfLLM-v2 block-sparse from there on → × sigmoid(o_gate(x)) →
o_proj. The mode is decided per call, so a long decode switches at exactly `dense_len` (SPEC P7).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.cache import COMPRESSION, SparseKVCache
from salabatch.engine.config import ModelConfig
from salabatch.engine.kernels.attention import dense_attention
from salabatch.engine.kernels.sparse_attention import block_sparse_attention
from salabatch.engine.kernels.sparse_select import select_blocks


class SparseAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = d = cfg.head_dim
        self.scale = d**-0.5
        self.use_rope = cfg.attn_use_rope
        self.rope_theta = cfg.rope_theta
        self.sparse = cfg.sparse
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, hidden, bias=False)
        if cfg.attn_use_output_gate:
            self.o_gate = nn.Linear(hidden, self.n_heads * d, bias=False)

    def __call__(self, x: mx.array, cache: SparseKVCache, offset: int) -> mx.array:
        """x [B, T, hidden] (already input-normed); offset: tokens already in the cache."""
        B, T, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).reshape(B, T, self.n_heads, d).transpose(0, 2, 1, 3)  # [B, H, T, d]
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, d).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, d).transpose(0, 2, 1, 3)
        if self.use_rope:
            q = mx.fast.rope(
                q, d, traditional=False, base=self.rope_theta, scale=1.0, offset=offset
            )
            k = mx.fast.rope(
                k, d, traditional=False, base=self.rope_theta, scale=1.0, offset=offset
            )
        keys, values = cache.append(k, v)
        if self.is_sparse(cache, offset, T):
            o = self.infllm_v2(q, cache, offset)
        else:
            o = dense_attention(q, keys, values, self.scale)
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)  # [B, T, H*d]
        if "o_gate" in self:
            o = o * mx.sigmoid(self.o_gate(x))
        return self.o_proj(o)

    def is_sparse(self, cache: SparseKVCache, offset: int, T: int) -> bool:
        """HF's rule (SPEC P7): sparse iff the total length is ≥ dense_len — for a planned
        prefill, the whole prompt's length, so chunked prefill decides like one call."""
        dense_len = self.sparse.dense_len
        return offset + T >= dense_len or (
            offset < cache.prefill_len and cache.prefill_len >= dense_len
        )

    def infllm_v2(self, q: mx.array, cache: SparseKVCache, offset: int) -> mx.array:
        """q [B, H, T, d] at positions offset… against everything cached → [B, H, T, d]."""
        B, _, T, _ = q.shape
        sc = self.sparse
        n = cache.length
        pos = mx.broadcast_to(mx.arange(offset, offset + T, dtype=mx.int32), (B, T))
        vis1, vis2 = (visible_chunks(pos, cache.prefill_len, stride) for _, stride in COMPRESSION)
        q_blk = pos // sc.block_size
        n_blocks = -(-n // sc.block_size)
        idx = select_blocks(
            q,
            cache.compressed[0].view(),
            cache.compressed[1].view(),
            vis1,
            vis2,
            q_blk,
            n_blocks=n_blocks,
            k=min(sc.topk_eff, n_blocks),
            scale=self.scale,
            init_blocks=sc.init_blocks,
            local_blocks=sc.local_blocks,
        )
        if cache.trace is not None:
            cache.trace.append(idx)
        padded = n_blocks * sc.block_size  # whole blocks; the spare room is masked causally
        keys, values = cache.keys.view(padded), cache.values.view(padded)
        return block_sparse_attention(q, keys, values, idx, pos, self.scale, sc.block_size)


def visible_chunks(q_pos: mx.array, prefill_len: int, stride: int) -> mx.array:
    """How many compressed chunks (size 2·stride) each query may score: those that end at or
    before it. Inside a planned prefill of L tokens the kernel hides one more when
    L ≡ stride − 1 (mod stride) (SPEC §4.3 length quirk); decode steps never do."""
    size = 2 * stride
    seen = (q_pos + 1) // stride - 1
    quirk = 0
    if prefill_len >= size:
        quirk = (prefill_len - size) // stride + 1 - (prefill_len - stride + 1) // stride
    seen = mx.where(q_pos < prefill_len, seen + quirk, seen)
    return mx.maximum(seen, 0)
