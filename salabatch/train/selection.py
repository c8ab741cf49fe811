"""Teaching InfLLM-v2's block selection: a loss on the sparse layers' compressed-key scores.

The selection (SPEC 4.3) ranks a query's blocks by `q · mean(k over a 32-token chunk)`, a top-k
that no gradient passes through: the answer loss alone never tells the keys how to be found. A
model trained in dense mode puts its attention on a needle's value, but the value's chunk mean
is diluted by 31 other keys, and past `dense_len` the block it needs is chosen about as often
as chance (benchmarks/HISTORY.md, "Stage 3").

This loss asks each query head's scores over the level-1 chunks (`q · c_j / √d`, c_j the mean
of keys 16j … 16j+31, as stage 1 computes them) to put their softmax where the head's own dense
attention goes: the target of chunk j is the attention mass on its keys, normalised over the
chunks the query can see. The target is held fixed (`stop_gradient`): the attention is what it
is, the keys and queries learn to point the compressed scores at it. It is measured at the
answer positions only (where retrieval happens), in the dense forward pass training runs.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.config import LIGHTNING
from salabatch.engine.model import Model
from salabatch.train.scoring import Batch

CHUNK, STRIDE = 32, 16  # level-1 compression (SPEC 4.3 step A)


def hidden_and_sparse_inputs(model: Model, ids: mx.array) -> tuple[mx.array, list]:
    """The final hidden states [B, T, hidden] and, per sparse layer, (its attention module,
    its normed input [B, T, hidden])."""
    cache = model.make_cache()
    B, T = ids.shape
    offset = cache.advance(B, T)
    h = model.model.embed_tokens(ids) * model.model.scale_emb
    inputs = []
    for layer, layer_cache in zip(model.layers, cache, strict=True):
        if layer.kind != LIGHTNING:
            inputs.append((layer.self_attn, layer.input_layernorm(h)))
        h = layer(h, layer_cache, offset)
    return model.model.norm(h), inputs


def selection_loss(attn, x: mx.array, at: mx.array, mask: mx.array) -> mx.array:
    """Cross-entropy of the compressed-key softmax against the dense attention's mass per
    chunk, at the query positions `at` [B, A] (weighted by `mask` [B, A]), mean over heads."""
    B, T, _ = x.shape
    d, H, Hk = attn.head_dim, attn.n_heads, attn.n_kv_heads
    n_chunks = (T - CHUNK) // STRIDE + 1
    if n_chunks < 2:
        return mx.array(0.0)
    xq = mx.take_along_axis(x, at[..., None], axis=1)  # [B, A, hidden]
    q = attn.q_proj(xq).reshape(B, -1, H, d).transpose(0, 2, 1, 3)  # [B, H, A, d]
    k = attn.k_proj(x).reshape(B, T, Hk, d).transpose(0, 2, 1, 3)  # [B, Hk, T, d]
    k = mx.repeat(k, H // Hk, axis=1)  # query head h uses kv head h // (H / Hk)
    pos = at[:, None, :, None]  # [B, 1, A, 1]
    keys = mx.arange(T)
    logits = (q @ k.transpose(0, 1, 3, 2)) * attn.scale  # [B, H, A, T]
    logits = mx.where(keys <= pos, logits, -mx.inf)
    attention = mx.stop_gradient(mx.softmax(logits, axis=-1))
    # mass per chunk, and each chunk's mean key, from running sums over [16j, 16j + 32)
    starts = mx.arange(n_chunks) * STRIDE
    mass = _window_sums(attention, starts)  # [B, H, A, N]
    pooled = _window_sums(k.transpose(0, 1, 3, 2), starts) / CHUNK  # [B, H, d, N]
    visible = (starts + CHUNK - 1) <= pos  # chunk fully at or before the query
    mass = mx.where(visible, mass, 0.0)
    target = mass / mx.maximum(mass.sum(-1, keepdims=True), 1e-9)
    scores = (q @ pooled) * attn.scale  # [B, H, A, N]
    scores = mx.where(visible, scores, -1e9)  # finite: a row with no chunk stays NaN-free
    ce = -(target * nn.log_softmax(scores, axis=-1)).sum(-1)  # [B, H, A]
    weight = mask * (visible.squeeze(1).sum(-1) >= 2)  # [B, A]: queries with a choice to make
    return (ce.mean(1) * weight).sum() / mx.maximum(weight.sum(), 1.0)


def _window_sums(x: mx.array, starts: mx.array) -> mx.array:
    """Sums of x[..., s : s + CHUNK] along the last axis, for each s of `starts`."""
    total = mx.concatenate([mx.zeros((*x.shape[:-1], 1)), mx.cumsum(x, axis=-1)], axis=-1)
    return total[..., starts + CHUNK] - total[..., starts]


def loss_with_selection(model: Model, batch: Batch, weight: float) -> mx.array:
    """The answer loss plus `weight` × the selection loss of every sparse layer."""
    h, sparse = hidden_and_sparse_inputs(model, batch.inputs)
    logits = model.logits(mx.take_along_axis(h, batch.at[..., None], axis=1))
    ce = nn.losses.cross_entropy(logits, batch.targets)
    answer = (ce * batch.mask).sum() / batch.mask.sum()
    select = sum(selection_loss(attn, x, batch.at, batch.mask) for attn, x in sparse)
    return answer + weight * select / max(len(sparse), 1)
