"""Caches: one object per layer, plus the position of every sequence, held by `ModelCache`.

A batch is B rows (sequences). Rows may be at different positions, and they may share a prefix:
* `LightningCache`: the simple-GLA state [B, H, dk, dv], always float32. It is the layer's whole
  history, so it cannot be trimmed: a prefix cache must be saved at the exact prefix boundary,
  and every row of a batch gets its own copy (2 MiB per row and layer in the 9B).
* `SparseKVCache` (sparse_cache.py): a sparse layer's keys/values and their two levels of
  compressed keys (InfLLM-v2), with a prefix shared by all rows stored once.

`ModelCache.fork(n)` turns a one-row cache (a prefilled document) into n rows that share its
sparse-layer keys; `select` drops rows, `concat` joins rows; positions live here, not in a layer,
so they do not depend on which kind layer 0 is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import mlx.core as mx

from salabatch.engine.config import LIGHTNING, ModelConfig
from salabatch.engine.sparse_cache import COMPRESSION, RowBuffer, SparseKVCache
from salabatch.errors import CacheFormatError

FORMAT_VERSION = 1  # of `ModelCache.to_state`; a different version is never read


class LightningCache:
    """State of one lightning layer: [B, H, dk, dv] float32, None before the first call."""

    def __init__(self, state: mx.array | None = None) -> None:
        self.state = state

    def fork(self, n: int) -> LightningCache:
        return LightningCache(mx.repeat(self.state, n, axis=0))

    def select(self, rows: Sequence[int]) -> LightningCache:
        return LightningCache(self.state[mx.array(list(rows))])

    @staticmethod
    def concat(caches: Sequence[LightningCache]) -> LightningCache:
        return LightningCache(mx.concatenate([c.state for c in caches], axis=0))

    @property
    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes


LayerCache = LightningCache | SparseKVCache


class ModelCache:
    """The caches of all layers and the number of tokens each row (sequence) has seen."""

    def __init__(self, layers: list[LayerCache], positions: list[int] | None = None) -> None:
        self.layers = layers
        self.positions = positions  # per row; None until the first call
        self.prefill_len = 0

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> ModelCache:
        return cls(
            [LightningCache() if k == LIGHTNING else SparseKVCache() for k in cfg.layer_kinds]
        )

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerCache]:
        return iter(self.layers)

    @property
    def rows(self) -> int:
        return 0 if self.positions is None else len(self.positions)

    @property
    def offset(self) -> int:
        """Tokens seen, when every row has seen the same number (else an error)."""
        if self.positions is None:
            return 0
        if len(set(self.positions)) != 1:
            raise ValueError(f"rows are at different positions: {self.positions}")
        return self.positions[0]

    def plan_prefill(self, total: int) -> None:
        """Announces that the next calls prefill a prompt of `total` tokens, in chunks.

        Sparse layers decide dense vs InfLLM-v2 (and the stage-1 length quirk) for the prompt as
        a whole, as one call over `total` tokens would; without a plan, the first call's length
        is taken as the prompt length. Planning is what makes chunked prefill equal one call.
        """
        self.prefill_len = total
        for c in self.layers:
            if isinstance(c, SparseKVCache):
                c.prefill_len = total

    def advance(self, batch: int, tokens: int) -> int | mx.array:
        """Records `tokens` new tokens for each of `batch` rows; returns where they start: an int
        when all rows are at the same position, else an int32 array [batch]."""
        if self.positions is None:
            self.positions = [0] * batch
            if not self.prefill_len:
                self.plan_prefill(tokens)
        if len(self.positions) != batch:
            raise ValueError(f"this cache holds {len(self.positions)} rows, the input has {batch}")
        start = self.positions
        self.positions = [p + tokens for p in start]
        if len(set(start)) == 1:
            return start[0]
        return mx.array(start, dtype=mx.int32)

    # -- batches -------------------------------------------------------------------------------
    def fork(self, n: int) -> ModelCache:
        """n rows that continue this one-row cache (a prefilled document): lightning states are
        copied per row, sparse-layer keys are shared, not copied n times."""
        if self.rows != 1:
            raise ValueError(f"fork needs a one-row cache, this one has {self.rows} rows")
        return ModelCache([c.fork(n) for c in self.layers], self.positions * n)

    def select(self, rows: Sequence[int]) -> ModelCache:
        """A cache with only these rows, in this order."""
        return ModelCache([c.select(rows) for c in self.layers], [self.positions[b] for b in rows])

    @staticmethod
    def concat(caches: Sequence[ModelCache]) -> ModelCache:
        """One batch of all rows of `caches` (their sparse layers must share one prefix)."""
        layers = [type(parts[0]).concat(parts) for parts in zip(*caches, strict=True)]
        return ModelCache(layers, [p for c in caches for p in c.positions])

    def arrays(self) -> list[mx.array]:
        """Every array the cache holds (to evaluate them together with a step's output)."""
        out = []
        for c in self.layers:
            if isinstance(c, LightningCache):
                out += [] if c.state is None else [c.state]
            else:
                bufs = (c.keys, c.values, *c.compressed)
                out += [b.data for b in bufs if b.data is not None]
        return out

    # -- serialization -------------------------------------------------------------------------
    def to_state(self) -> tuple[dict[str, mx.array], dict[str, str]]:
        """Arrays and string metadata of a one-row cache (a document prefix, or a prefill
        snapshot): everything needed to continue it exactly. Buffers are cut to their length."""
        if self.rows != 1 or any(isinstance(c, SparseKVCache) and c.shared for c in self.layers):
            raise ValueError("only a one-row cache without a shared prefix can be saved")
        arrays: dict[str, mx.array] = {}
        kinds = []
        for i, c in enumerate(self.layers):
            if isinstance(c, LightningCache):
                kinds.append("lightning")
                arrays[f"layers.{i}.state"] = c.state
            else:
                kinds.append("sparse")
                n = c.keys.lengths[0]
                arrays[f"layers.{i}.keys"] = c.keys.data[:, :, :n]
                arrays[f"layers.{i}.values"] = c.values.data[:, :, :n]
                for level, buf in enumerate(c.compressed):
                    arrays[f"layers.{i}.chunks{level}"] = buf.data[:, :, : buf.lengths[0]]
        meta = {
            "format_version": str(FORMAT_VERSION),
            "layer_kinds": json.dumps(kinds),
            "position": str(self.offset),
            "prefill_len": str(self.prefill_len),
        }
        return arrays, meta

    @classmethod
    def from_state(
        cls, arrays: dict[str, mx.array], meta: dict[str, str], cfg: ModelConfig, source: str = ""
    ) -> ModelCache:
        """The inverse of `to_state`; anything inconsistent raises CacheFormatError."""

        def bad(why: str) -> CacheFormatError:
            return CacheFormatError(f"not a usable cache: {why}", path=source or None)

        if meta.get("format_version") != str(FORMAT_VERSION):
            raise bad(f"format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
        try:
            kinds = json.loads(meta["layer_kinds"])
            position, prefill_len = int(meta["position"]), int(meta["prefill_len"])
        except (KeyError, ValueError) as e:
            raise bad(f"metadata ({e})") from None
        if kinds != ["lightning" if k == LIGHTNING else "sparse" for k in cfg.layer_kinds]:
            raise bad("its layer layout is not this model's")
        cache = cls.for_config(cfg)
        try:
            for i, c in enumerate(cache.layers):
                if isinstance(c, LightningCache):
                    c.state = arrays[f"layers.{i}.state"]
                    continue
                keys, values = arrays[f"layers.{i}.keys"], arrays[f"layers.{i}.values"]
                if keys.shape[2] != position or values.shape != keys.shape:
                    raise bad(f"layer {i} holds {keys.shape[2]} keys for position {position}")
                c.keys, c.values = RowBuffer(keys, [position]), RowBuffer(values, [position])
                chunks = [arrays[f"layers.{i}.chunks{level}"] for level in range(len(COMPRESSION))]
                for (size, stride), got in zip(COMPRESSION, chunks, strict=True):
                    if got.shape[2] != max(0, (position - size) // stride + 1):
                        raise bad(f"layer {i} has {got.shape[2]} compressed chunks")
                c.compressed = tuple(RowBuffer(a, [a.shape[2]]) for a in chunks)
        except KeyError as e:
            raise bad(f"missing array {e}") from None
        cache.positions = [position]
        cache.plan_prefill(prefill_len)
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes held, the shared prefix counted once."""
        shared = {
            id(c.shared): c.shared_nbytes for c in self.layers if isinstance(c, SparseKVCache)
        }
        return sum(c.nbytes for c in self.layers) + sum(shared.values())
