"""The selection loss: its chunk sums and means equal a loop over the chunks, it adds nothing at
weight 0, its gradient reaches only the sparse layers' queries and keys (the target attention is
held fixed), and a few steps on it alone lower it."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from salabatch.demo.checkpoint import random_weights
from salabatch.engine.config import ModelConfig
from salabatch.engine.model import Model
from salabatch.train.data import TaskGenerator
from salabatch.train.scoring import loss_fn, make_batch
from salabatch.train.selection import (
    CHUNK,
    STRIDE,
    hidden_and_sparse_inputs,
    loss_with_selection,
    selection_loss,
)
from salabatch.train.train import model_config
from tests.train.test_train import TINY


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = Model(ModelConfig.from_dict(model_config(tokenizer.vocab_size, [2], **TINY)))
    model.load_weights(list(random_weights(model.config, 0).items()))
    gen = TaskGenerator(tokenizer, seed=0, kinds=("lookup",))
    batch = make_batch([gen.encoded(0, 400), gen.encoded(1, 360)], pad_id=2)
    return model, batch


def reference(attn, x, at, mask) -> float:
    """The same loss, one query, head and chunk at a time (numpy, float64)."""
    x, at, mask = np.array(x, np.float64), np.array(at), np.array(mask)
    wq = np.array(attn.q_proj.weight, np.float64)
    wk = np.array(attn.k_proj.weight, np.float64)
    H, Hk, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    total, weight = 0.0, 0.0
    for b in range(x.shape[0]):
        k = (x[b] @ wk.T).reshape(-1, Hk, d)
        for a, pos in enumerate(at[b]):
            chunks = [s for s in range(0, x.shape[1] - CHUNK + 1, STRIDE) if s + CHUNK - 1 <= pos]
            if mask[b, a] == 0 or len(chunks) < 2:
                continue
            q = (x[b, pos] @ wq.T).reshape(H, d)
            ce = 0.0
            for h in range(H):
                kh = k[: pos + 1, h // (H // Hk)]
                logits = kh @ q[h] / math.sqrt(d)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                mass = np.array([p[s : s + CHUNK].sum() for s in chunks])
                scores = np.array([kh[s : s + CHUNK].mean(0) @ q[h] for s in chunks]) / math.sqrt(d)
                logq = scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())
                ce -= (mass / mass.sum() * logq).sum()
            total += ce / H
            weight += 1
    return total / max(weight, 1)


def test_selection_loss_is_the_chunk_by_chunk_cross_entropy(setup):
    model, batch = setup
    _, sparse = hidden_and_sparse_inputs(model, batch.inputs)
    assert len(sparse) == 1
    attn, x = sparse[0]
    got = selection_loss(attn, x, batch.at, batch.mask).item()
    assert got == pytest.approx(reference(attn, x, batch.at, batch.mask), rel=1e-4)


def test_weight_zero_is_the_answer_loss_and_the_gradient_spares_values(setup):
    model, batch = setup
    assert loss_with_selection(model, batch, 0.0).item() == pytest.approx(
        loss_fn(model, batch).item(), rel=1e-6
    )
    select_only = nn.value_and_grad(model, lambda m, b: loss_with_selection(m, b, 1.0))
    answer_only = nn.value_and_grad(model, loss_fn)
    diff = {
        k: float(mx.abs(g1 - g0).max())
        for (k, g1), (_, g0) in zip(
            tree_flatten(select_only(model, batch)[1]),
            tree_flatten(answer_only(model, batch)[1]),
            strict=True,
        )
    }
    sparse = [i for i, kind in enumerate(model.config.layer_kinds) if kind != "lightning"]
    prefix = f"model.layers.{sparse[0]}.self_attn."
    assert diff[prefix + "q_proj.weight"] > 0 and diff[prefix + "k_proj.weight"] > 0
    for name in ("v_proj.weight", "o_proj.weight"):  # the target attention is held fixed
        assert diff[prefix + name] == 0


def test_training_on_it_lowers_it(setup):
    model, batch = setup
    _, (before,) = hidden_and_sparse_inputs(model, batch.inputs)
    start = selection_loss(*before, batch.at, batch.mask).item()
    step = nn.value_and_grad(model, lambda m, b: loss_with_selection(m, b, 1.0) - loss_fn(m, b))
    opt = optim.Adam(learning_rate=3e-3)
    for _ in range(30):
        _, grads = step(model, batch)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    _, (after,) = hidden_and_sparse_inputs(model, batch.inputs)
    assert selection_loss(*after, batch.at, batch.mask).item() < 0.8 * start
