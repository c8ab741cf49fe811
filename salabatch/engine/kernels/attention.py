"""Softmax attention for the sparse layers: dense causal (below `dense_len`) and masked.

Layout: q [B, H, Tq, d]; k, v [B, Hk, Tk, d] with H a multiple of Hk (GQA: query head h reads kv
head h // (H / Hk)). Dense attention's queries are the last Tq of the Tk positions (causal mask
aligned bottom-right). Results are [B, H, Tq, d] in q's dtype.

`attend` is the one dispatcher: on a GPU, MLX's fused SDPA; on the CPU, where MLX's `exp` costs
~30 ns an element (12× numpy), a softmax in base 2 (`power(2, ·)` is 2–3× cheaper there), which
changes results by float32 rounding only.
"""

from __future__ import annotations

import math

import mlx.core as mx

LOG2E = math.log2(math.e)
# Query rows per call: bounds the [B, H, rows, Tk] score buffer a non-fused path materialises
# (2048 × 8192 × 32 heads × 4 B = 2 GiB for one 9B chunk otherwise).
MAX_SCORE_ELEMENTS = 1 << 26


def dense_attention_ref(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Plain float32 softmax attention; the reference the fast paths are tested against."""
    B, H, Tq, d = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    G = H // Hk
    qf = q.astype(mx.float32).reshape(B, Hk, G, Tq, d)
    kf = k.astype(mx.float32)[:, :, None]
    vf = v.astype(mx.float32)[:, :, None]
    s = (qf @ kf.swapaxes(-1, -2)) * scale  # [B, Hk, G, Tq, Tk]
    q_pos = mx.arange(Tk - Tq, Tk)[:, None]
    s = mx.where(mx.arange(Tk)[None, :] <= q_pos, s, -mx.inf)
    o = mx.softmax(s, axis=-1) @ vf
    return o.reshape(B, H, Tq, d).astype(q.dtype)


def dense_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Causal attention, split into query tiles when the score matrix would be large."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    rows = max(1, MAX_SCORE_ELEMENTS // (B * H * Tk))
    outs = []
    for start in range(0, Tq, rows):
        stop = min(start + rows, Tq)
        end_key = Tk - Tq + stop  # each tile sees the keys up to its own last query
        mask = None
        if stop - start > 1:
            q_pos = mx.arange(end_key - (stop - start), end_key)[:, None]
            mask = mx.arange(end_key)[None, :] <= q_pos
        outs.append(attend(q[:, :, start:stop], k[:, :, :end_key], v[:, :, :end_key], scale, mask))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    """softmax(q·kᵀ·scale, where mask) · v; mask is boolean (True = attend), broadcast to
    [B, H, Tq, Tk], or None. Every query must be allowed at least one key."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return _attend_base2(q, k, v, scale, mask)


def _attend_base2(q, k, v, scale, mask):
    B, H, Tq, d = q.shape
    Hk = k.shape[1]
    qg = q.reshape(B, Hk, H // Hk, Tq, d)
    s = (qg @ k[:, :, None].swapaxes(-1, -2)) * (scale * LOG2E)  # [B, Hk, G, Tq, Tk]
    if mask is not None:  # to [b, Hk, G, Tq, Tk] or [b, 1, 1, Tq, Tk], never copied per head
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        b, h = mask.shape[:2]
        mask = mask.reshape(b, Hk, H // Hk, *mask.shape[2:]) if h == H > 1 else mask[:, :, None]
        s = mx.where(mask, s, -mx.inf)
    p = mx.power(2.0, s - s.max(axis=-1, keepdims=True))
    o = (p @ v[:, :, None]) / p.sum(axis=-1, keepdims=True)
    return o.reshape(B, H, Tq, d).astype(q.dtype)
