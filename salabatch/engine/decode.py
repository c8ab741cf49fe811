"""The decode step of a batch: one compiled graph per model, traced once per shape.

A GPU pays for every kernel launch and its host for every op it records, so a decode step is
one `mx.compile`d call of `Model.step` (every layer, the head) over the batch's arrays, not
~1,400 ops dispatched one by one. What changes from step to step or document to document is an
array input (positions, the shared keys' length and chunk counts), never a Python constant, and
the cache buffers keep one shape for many steps (capacities in buckets, reserved ahead: see
`sparse_cache.capacity`): the graph is traced once per batch size, buffer capacities and mode
(dense, mixed, sparse), and replayed otherwise. The rows' buffers are inputs that the cache no
longer holds once the step is built, so MLX writes the new keys into them in place.

`decode(model, tokens, cache)` is the one dispatcher: this compiled step where the kernels take
their GPU branches (`kernels.attention.on_gpu`, also forced on any device by
SALABATCH_GPU_PATH=1), the model's per-layer call with the native CPU kernels otherwise.
"""

from __future__ import annotations

import mlx.core as mx

from salabatch.engine.kernels.attention import on_gpu
from salabatch.engine.kernels.sparse_decode import DENSE, step_mode, step_rows, step_tables


class DecodeStep:
    """`Model.step` compiled, with its weights as implicit inputs (it sees their updates).
    `traces` counts how often it was traced (a new shape or mode)."""

    def __init__(self, model) -> None:
        self.model = model
        self.traces = 0
        self._compiled = mx.compile(self._graph, inputs=model.state)
        self._tables: tuple[tuple, dict] | None = None  # the last batch's, by what made them

    def _graph(self, tokens, info, tables, layers, mode):
        self.traces += 1  # runs only while tracing
        return self.model.step(tokens, info, tables, layers, mode)

    def __call__(self, tokens: mx.array, cache) -> mx.array:
        """tokens [B] int32, one per row of `cache`, which it advances → logits [B, vocab]."""
        info, tables, layers, mode = self.inputs(cache)
        logits, layers, selected = self._compiled(tokens, info, tables, layers, mode)
        cache.stepped(layers, selected, sparse=mode != DENSE)
        return logits

    def inputs(self, cache) -> tuple[mx.array, dict, list, str]:
        """What the step takes for `cache`, with room reserved for one more position: the rows'
        `step_rows`, the batch's `step_tables`, each layer's (cache arrays, step weights) and
        the mode. The caller must hold the cache's buffers only through these, so that the step
        writes them in place."""
        sc = self.model.config.sparse
        cache.reserve(cache.own_length() + 1)
        shared, arrays = cache.step_inputs()
        start = 0 if shared is None else shared.start
        info = step_rows(cache.positions, start, sc.block_size, [s for _, s in sc.compression])
        tables = self._step_tables(shared, cache)
        weights = [layer.step_weights() for layer in self.model.layers]
        mode = step_mode(cache.positions, sc.dense_len)
        return info, tables, list(zip(arrays, weights, strict=True)), mode

    def _step_tables(self, shared, cache) -> dict:
        """`step_tables` of this batch's shared keys and buffer shapes (made once per batch)."""
        sc = self.model.config.sparse
        own = cache.own_capacity()
        if shared is None:
            key = (0, (0, 0), (0, 0), own)
        else:
            entries = tuple(c.shape[2] for c in shared.chunks)
            key = (shared.start, shared.counts, entries, own, shared.keys.shape[2])
        if self._tables is None or self._tables[0] != key:
            n_blocks = (own + (0 if shared is None else shared.keys.shape[2])) // sc.block_size
            tables = step_tables(
                key[0], key[1], key[2], own, n_blocks, sc.block_size, sc.compression
            )
            self._tables = (key, tables)
        return self._tables[1]


def decode(model, tokens: mx.array, cache) -> mx.array:
    """One decode step of every row of `cache`: tokens [B] int32 → logits [B, vocab]."""
    if on_gpu():
        return model.decoder(tokens, cache)
    return model(tokens[:, None], cache)[:, -1]
