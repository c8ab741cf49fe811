"""Caches: one object per layer, plus the position of every sequence, held by `ModelCache`.

* `LightningCache`: the simple-GLA state [B, H, dk, dv], always float32. It is the whole history of
  the layer, so it cannot be trimmed: a prefix cache must be saved at the exact prefix boundary.
* `SparseKVCache`: keys and values [B, Hk, n, d] of a sparse layer plus their two levels of
  compressed keys (InfLLM-v2), in buffers that grow in steps so that chunked prefill and decode
  do not copy the history on every call.

Positions belong to `ModelCache`, not to a layer, so they do not depend on which kind layer 0 is.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from salabatch.engine.config import LIGHTNING, ModelConfig


class LightningCache:
    """State of one lightning layer: [B, H, dk, dv] float32, None before the first call."""

    def __init__(self) -> None:
        self.state: mx.array | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes


class GrowingBuffer:
    """[B, Hk, capacity, d] filled up to `length` along axis 2; grows geometrically in steps."""

    step = 256  # tokens; a multiple of the 64-token block so block views never overrun

    def __init__(self) -> None:
        self.data: mx.array | None = None
        self.length = 0

    def append(self, x: mx.array) -> None:
        end = self.length + x.shape[2]
        if self.data is None or end > self.data.shape[2]:
            # Geometric growth keeps a 1M-token prefill from copying the history thousands of times.
            old = 0 if self.data is None else self.data.shape[2]
            capacity = -(-max(end, old + old // 2) // self.step) * self.step
            grown = mx.zeros((*x.shape[:2], capacity, x.shape[3]), dtype=x.dtype)
            if self.data is not None:
                grown[..., : self.length, :] = self.data[..., : self.length, :]
            self.data = grown
        self.data[..., self.length : end, :] = x
        self.length = end

    def view(self, length: int | None = None) -> mx.array:
        """The first `length` (default: all filled) positions; length may run into spare room."""
        return self.data[..., : self.length if length is None else length, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.nbytes


# InfLLM-v2 key compression levels (size, stride): fixed by its kernels (SPEC P14).
COMPRESSION = ((32, 16), (128, 64))


class SparseKVCache:
    """One sparse layer: un-rotated keys/values [B, Hk, n, d] and their compressed keys.

    Compressed keys are kept for every complete chunk of the keys so far, level 1 (mean of 32
    keys every 16) and level 2 (128 every 64), float32. They are extended on every append, from
    the new keys only, so a decode step never recompresses the history (SPEC §4.4).
    """

    def __init__(self) -> None:
        self.keys, self.values = GrowingBuffer(), GrowingBuffer()
        self.compressed = tuple(GrowingBuffer() for _ in COMPRESSION)
        self.prefill_len = 0  # planned prompt length (ModelCache.plan_prefill)
        self.trace: list[mx.array] | None = None  # set to a list to record block selections

    @property
    def length(self) -> int:
        return self.keys.length

    def append(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Adds k, v [B, Hk, T, d]; returns all keys and values so far [B, Hk, length, d]."""
        self.keys.append(k)
        self.values.append(v)
        for (size, stride), buf in zip(COMPRESSION, self.compressed, strict=True):
            if buf.data is None:  # allocate even while no chunk is complete: views work at once
                buf.append(mx.zeros((*k.shape[:2], 0, k.shape[3]), dtype=mx.float32))
            total = max(0, (self.length - size) // stride + 1)
            new = total - buf.length
            if new > 0:
                # chunk j = mean(k[stride·j : stride·j + size]), size = 2·stride: sum stride-groups
                span = self.keys.data[..., stride * buf.length : stride * (total + 1), :]
                groups = span.astype(mx.float32).reshape(*span.shape[:2], new + 1, stride, -1)
                sums = groups.sum(axis=3)
                buf.append((sums[:, :, :-1] + sums[:, :, 1:]) / size)
        return self.keys.view(), self.values.view()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in (self.keys, self.values, *self.compressed))


LayerCache = LightningCache | SparseKVCache


class ModelCache:
    """The caches of all layers and the number of tokens each sequence has seen."""

    def __init__(self, layers: list[LayerCache]) -> None:
        self.layers = layers
        self.positions: list[int] | None = None  # per sequence; None until the first call
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
    def offset(self) -> int:
        """Tokens seen, when every sequence has seen the same number (else an error)."""
        if self.positions is None:
            return 0
        if len(set(self.positions)) != 1:
            raise ValueError(f"sequences are at different positions: {self.positions}")
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

    def advance(self, batch: int, tokens: int) -> int:
        """Records `tokens` new tokens for each of `batch` sequences; returns the old offset."""
        if self.positions is None:
            self.positions = [0] * batch
            if not self.prefill_len:
                self.plan_prefill(tokens)
        if len(self.positions) != batch:
            raise ValueError(
                f"this cache holds {len(self.positions)} sequences, the input has {batch}"
            )
        start = self.offset
        self.positions = [p + tokens for p in self.positions]
        return start

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)
