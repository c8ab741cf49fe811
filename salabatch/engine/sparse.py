"""Sparse attention layer (`minicpm4`, InfLLM-v2), SPEC §4.

x → q [H heads], k, v [Hk heads] (NoPE) → append k, v to the cache → attention: dense while the
total length is below `dense_len`, InfLLM-v2 block-sparse from there on → × sigmoid(o_gate(x)) →
o_proj. The mode is decided per call and per row, so a long decode switches at exactly
`dense_len` (SPEC P7), and rows of one batch at different lengths may run different modes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.config import ModelConfig
from salabatch.engine.kernels.attention import GRID_ROWS, attention
from salabatch.engine.kernels.gates import sigmoid_mul
from salabatch.engine.kernels.sparse_attention import KVView, block_sparse_attention
from salabatch.engine.kernels.sparse_decode import (
    decode_attention,
    dense_step,
    infllm_v2_step,
    runs_native,
)
from salabatch.engine.kernels.sparse_select import select_blocks
from salabatch.engine.linear import Linear, fuse
from salabatch.engine.sparse_cache import SparseKVCache, write_step


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
        self.q_proj = Linear(hidden, self.n_heads * d, bias=False)
        self.k_proj = Linear(hidden, self.n_kv_heads * d, bias=False)
        self.v_proj = Linear(hidden, self.n_kv_heads * d, bias=False)
        self.o_proj = Linear(self.n_heads * d, hidden, bias=False)
        if cfg.attn_use_output_gate:
            self.o_gate = Linear(hidden, self.n_heads * d, bias=False)
        self.fused = None  # q, k, v, o_gate as one matmul (`fuse`), for the decode step

    def __call__(self, x: mx.array, cache: SparseKVCache, offset: int | mx.array) -> mx.array:
        """x [B, T, hidden] (already input-normed); offset: position of x[:, 0] (int or [B]).
        While the cache is `stepwise` (a verify pass), the T queries attend one by one as T
        decode steps would (the same kernels), so the pass gives what decoding gives."""
        T = x.shape[1]
        q, k, v = self.qkv(x, offset)
        cache.append(k, v)
        if cache.stepwise and T > 1:  # a verify pass: each query as its decode step sees it
            return self.out(self.attend_stepwise(q, cache), x)
        return self.out(self.attend(q, cache), x)

    def attend_stepwise(self, q: mx.array, cache: SparseKVCache) -> mx.array:
        """A verify pass's queries q [B, H, T, d] (the last T positions of each row), each
        attending as the decode step at its position does → [B, H, T, d]: the decode step's
        kernels take them all at once (T rows of queries per row of keys: the native step, or
        for sparse rows the MLX-op graphs, the GPU path's); dense rows off the native step, and
        a batch with rows on both sides of dense_len, go one by one (`attend` with `ahead`)."""
        B, H, T, d = q.shape
        sc = self.sparse
        starts = [n - T for n in cache.lengths]
        # each query's own mode (SPEC P7): a pass whose last query reaches dense_len is mixed
        modes = {self.is_sparse(cache.prefill_len, s + t, 1) for s in starts for t in range(T)}
        kv = cache.kv_view()
        # the decode step's top-k: min(topk, blocks of the longest row at that step)
        longest = max(cache.lengths)
        ks = {min(sc.topk_eff, -(-(longest - T + 1 + t) // sc.block_size)) for t in range(T)}
        native = runs_native(q, kv)
        # off the native step, the MLX-op graphs batch B·T·Hk·K block products in one gather_mm,
        # which MLX's CUDA backend launches only under GRID_ROWS entries
        too_many = B * T * self.n_kv_heads * max(ks) >= GRID_ROWS
        one_by_one = not native and (modes == {False} or too_many)
        if len(modes) > 1 or len(ks) > 1 or cache.trace is not None or one_by_one:
            parts = [self.attend(q[:, :, t : t + 1], cache, T - 1 - t) for t in range(T)]
            return mx.concatenate(parts, axis=2)
        flat = q.transpose(0, 2, 1, 3).reshape(B * T, H, 1, d)  # row b's queries, then b + 1's
        at = [s + t for s in starts for t in range(T)]
        if modes == {False}:
            o = dense_step(flat, kv, at, self.scale, sc.block_size, queries=T)
        else:
            whole = [cache.chunk_parts(level, whole=True) for level in range(len(sc.compression))]
            o, _ = infllm_v2_step(
                flat, kv, *whole, at, prefill_len=cache.prefill_len,
                n_blocks=-(-longest // sc.block_size), k=ks.pop(), scale=self.scale,
                init_blocks=sc.init_blocks, local_blocks=sc.local_blocks,
                block=sc.block_size, compression=sc.compression, queries=T,
            )  # fmt: skip
        return o.reshape(B, T, H, d).transpose(0, 2, 1, 3)

    def attend(self, q: mx.array, cache: SparseKVCache, ahead: int = 0) -> mx.array:
        """q [B, H, T, d], the queries of the last T positions each row holds but `ahead`, over
        their cached sequences → [B, H, T, d]: dense below dense_len, InfLLM-v2 from there."""
        B, T = q.shape[0], q.shape[2]
        starts = [n - T - ahead for n in cache.lengths]  # position of each row's first query
        sparse = [b for b, s in enumerate(starts) if self.is_sparse(cache.prefill_len, s, T)]
        if not sparse:
            return self.dense(q, cache.kv_view(ahead), starts)
        if len(sparse) == B:
            return self.infllm_v2(q, cache, starts, ahead=ahead)
        # rows on both sides of dense_len: each group its own way, then back in order
        dense = [b for b in range(B) if b not in sparse]
        o_dense = self.dense(
            q[mx.array(dense)], cache.kv_view(ahead).take(dense), [starts[b] for b in dense]
        )
        o_sparse = self.infllm_v2(
            q[mx.array(sparse)], cache, [starts[b] for b in sparse], sparse, ahead
        )
        order = mx.argsort(mx.array(dense + sparse))
        return mx.concatenate([o_dense, o_sparse])[order]

    def fuse(self) -> None:
        gate = [self.o_gate] if "o_gate" in self else []
        self.fused = fuse([self.q_proj, self.k_proj, self.v_proj, *gate])

    def step(
        self, x: mx.array, arrays: tuple, info: mx.array, tables: dict, mode: str, weights: tuple
    ) -> tuple[mx.array, tuple, mx.array]:
        """One decode step inside the compiled model step (salabatch.engine.decode): x [B, 1,
        hidden]; arrays: (the rows' `step_arrays`, the `shared_arrays`); info, tables, mode:
        what `kernels.sparse_decode.decode_attention` takes; the fused projections' `weights`
        or (). → (the gated output before o_proj [B, 1, H·d], the rows' rewritten arrays, the
        blocks each row attended)."""
        rows, shared = arrays
        B, d, H, Hk = x.shape[0], self.head_dim, self.n_heads, self.n_kv_heads
        if weights:
            q, k, v, *gate = self.fused.apply(x, weights)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            gate = [self.o_gate(x)] if "o_gate" in self else []
        q = q.reshape(B, 1, H, d).transpose(0, 2, 1, 3)  # [B, H, 1, d]
        k, v = (t.reshape(B, 1, Hk, d).transpose(0, 2, 1, 3) for t in (k, v))
        if self.use_rope:
            rope = dict(traditional=False, base=self.rope_theta, scale=1.0, offset=info[:, 0])
            q, k = mx.fast.rope(q, d, **rope), mx.fast.rope(k, d, **rope)
        rows = write_step(rows, k, v, info[:, 1])
        sc = self.sparse
        o, idx = decode_attention(
            q, rows, shared, info, tables, mode=mode, k=sc.topk_eff, dense_len=sc.dense_len,
            scale=self.scale, init_blocks=sc.init_blocks, local_blocks=sc.local_blocks,
            block=sc.block_size, compression=sc.compression,
        )  # fmt: skip
        o = o.transpose(0, 2, 1, 3).reshape(B, 1, -1)  # [B, 1, H*d]
        return (sigmoid_mul(o, gate[0]) if gate else o), rows, idx

    def qkv(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x [B, T, hidden] → q [B, H, T, d], k, v [B, Hk, T, d]."""
        B, T, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).reshape(B, T, self.n_heads, d).transpose(0, 2, 1, 3)  # [B, H, T, d]
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, d).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, d).transpose(0, 2, 1, 3)
        if self.use_rope:
            rope = dict(traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
            q, k = mx.fast.rope(q, d, **rope), mx.fast.rope(k, d, **rope)
        return q, k, v

    def out(self, o: mx.array, x: mx.array) -> mx.array:
        """o [B, H, T, d] → gated (o_gate of the layer input x) → o_proj → [B, T, hidden]."""
        B, _, T, _ = o.shape
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)  # [B, T, H*d]
        if "o_gate" in self:
            o = sigmoid_mul(o, self.o_gate(x))
        return self.o_proj(o)

    def is_sparse(self, prefill_len: int, start: int, T: int) -> bool:
        """HF's rule (SPEC P7): sparse iff the total length is ≥ dense_len — for a planned
        prefill, the whole prompt's length, so chunked prefill decides like one call."""
        dense_len = self.sparse.dense_len
        return start + T >= dense_len or (start < prefill_len and prefill_len >= dense_len)

    def dense(self, q: mx.array, kv: KVView, starts: list[int]) -> mx.array:
        """Causal attention over each row's whole sequence → [B, H, T, d]."""
        T = q.shape[2]
        if T == 1 and runs_native(q, kv):  # a decode step on the CPU: the native kernel
            return dense_step(q, kv, starts, self.scale, self.sparse.block_size)
        end = max(starts) + T
        keys, values = kv.parts(end)
        if kv.start == 0 and len(set(starts)) == 1:  # queries are the last T keys: fused causal
            return attention(q, keys, values, self.scale, "causal" if T > 1 else None)
        q_pos = mx.array(starts)[:, None, None, None] + mx.arange(T)[:, None]  # [B, 1, T, 1]
        mask = mx.arange(end) <= q_pos  # also hides a shorter row's spare positions
        return attention(q, keys, values, self.scale, mask)

    def infllm_v2(
        self,
        q: mx.array,
        cache: SparseKVCache,
        starts: list[int],
        rows: list[int] | None = None,
        ahead: int = 0,
    ) -> mx.array:
        """q [B', H, T, d] of `rows` (default: all) against their cached sequences (but the last
        `ahead` positions)."""
        sc = self.sparse
        block = sc.block_size
        kv = cache.kv_view(ahead)
        n_blocks = -(-max(kv.lengths) // block)
        settings = dict(
            prefill_len=cache.prefill_len,
            n_blocks=n_blocks,
            k=min(sc.topk_eff, n_blocks),
            scale=self.scale,
            init_blocks=sc.init_blocks,
            local_blocks=sc.local_blocks,
            block=block,
            compression=sc.compression,
        )
        step = q.shape[2] == 1  # decode: one compiled step, a mixed batch's sparse rows too
        parts = [cache.chunk_parts(level, whole=step) for level in range(len(sc.compression))]
        if rows is not None:
            kv = kv.take(rows)
            idx = mx.array(rows)
            parts = [(*p[:-1], p[-1][idx]) for p in parts]  # the shared part is not per row
            n_blocks = -(-max(kv.lengths) // block)
            settings["n_blocks"], settings["k"] = n_blocks, min(sc.topk_eff, n_blocks)
        if step:  # the same kernels as the row's step alone: its logits keep to its own company
            o, selected = infllm_v2_step(q, kv, *parts, starts, **settings)
            if cache.trace is not None:
                cache.trace.append(selected)
            return o
        # The choice of blocks is discrete: no gradient through it (its ids index gathers), only
        # through the keys and values it attends (what training needs; inference is unchanged).
        selected = mx.stop_gradient(select_blocks(q, parts[0], parts[1], starts, **settings))
        if cache.trace is not None:
            cache.trace.append(selected)
        return block_sparse_attention(q, kv, selected, starts, self.scale, block)
