"""Caches: one object per layer, plus the position of every sequence, held by `ModelCache`.

A batch is B rows (sequences). Rows may be at different positions, and they may hold shared keys:
* `LightningCache`: the simple-GLA state [B, H, dk, dv], always float32. It is the layer's whole
  history, so it cannot be trimmed: a prefix cache must be saved at the exact end of its
  document prompt, and every row of a batch gets its own copy (2 MiB per row and layer in the 9B).
* `SparseKVCache` (sparse_cache.py): a sparse layer's keys/values and their two levels of
  compressed keys (InfLLM-v2), with the shared keys of all rows stored once.

`ModelCache.fork(n)` turns a one-row cache (a prefilled document) into n rows that share its
sparse-layer keys; `select` drops rows, `concat` joins rows; positions live here, not in a layer,
so they do not depend on which kind layer 0 is.

Each layer cache owns its serialization (`to_state` / `from_state`, arrays named within the
layer); `ModelCache` adds the layer's name scope (`layers.{i}.`), the metadata and the format
version, and finds a layer's class by its kind in `LAYER_CACHES`. A state may hold only what
came after a position (`to_state(since=)`: the keys of the tokens from there, the lightning
states whole), and `joined_state` puts such parts back together (`joined`), so that a long
prefill's snapshots write each token's keys once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx

from salabatch.engine.config import LIGHTNING, ModelConfig
from salabatch.engine.kernels.gla import gla_replay
from salabatch.engine.sparse_cache import SharedKeys, SparseKVCache
from salabatch.errors import CacheFormatError

FORMAT_VERSION = 1  # of `ModelCache.to_state`; a different version is never read


class LightningCache:
    """State of one lightning layer: [B, H, dk, dv] float32, None before the first call."""

    kind = LIGHTNING  # the layer kind it caches (config.LIGHTNING), also its name on disk

    def __init__(self, state: mx.array | None = None) -> None:
        self.state = state
        # While a call may be taken back (`ModelCache.checkpoint`): the (k, v) [B, H, T, d]
        # float32 and log-decay g [H] each call since fed the recurrence, from which `rollback`
        # replays the state.
        self.record: list[tuple[mx.array, mx.array, mx.array] | None] | None = None
        self.stepwise = False  # recorded calls run token by token, as decode steps
        # Stepwise calls that kept the state after each of their tokens record None each and
        # leave them here, [B, tokens, H, dk, dv] (`LightningAttention.__call__`)
        self.states: mx.array | None = None

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> LightningCache:
        return cls()

    def arrays(self) -> list[mx.array]:
        return [] if self.state is None else [self.state]

    def fork(self, n: int) -> LightningCache:
        return LightningCache(mx.repeat(self.state, n, axis=0))

    def select(self, rows: Sequence[int]) -> LightningCache:
        return LightningCache(self.state[mx.array(list(rows))])

    @staticmethod
    def concat(caches: Sequence[LightningCache]) -> LightningCache:
        return LightningCache(mx.concatenate([c.state for c in caches], axis=0))

    def to_state(self, since: int = 0) -> dict[str, mx.array]:
        """`state` [1, H, dk, dv] of a one-row cache (whole, whatever `since`: it is the
        layer's whole history)."""
        if self.state is None or self.state.shape[0] != 1:
            raise ValueError("only a one-row cache can be saved")
        return {"state": self.state}

    @staticmethod
    def joined(parts: Sequence[dict[str, mx.array]]) -> dict[str, mx.array]:
        """The state of consecutive parts (`to_state(since=)` each): the last one's."""
        return parts[-1]

    @classmethod
    def from_state(
        cls, state: dict[str, mx.array], position: int, cfg: ModelConfig
    ) -> LightningCache:
        """The inverse of `to_state` (KeyError for a missing array)."""
        return cls(state["state"])

    @property
    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes

    def rollback(self, state: mx.array, keep: Sequence[int]) -> None:
        """The state after the first keep[b] tokens fed to row b since it was `state`: the one
        kept by stepwise calls that kept their states, else replayed from the record with the
        decode step's arithmetic (`gla_replay`)."""
        record, self.record, self.stepwise = self.record, None, False
        states, self.states = self.states, None
        if not any(keep):
            self.state = state
            return
        if record and record[0] is None:  # stepwise calls that kept their states: take one
            if states.shape[1] < max(keep):
                raise ValueError("rolling a lightning layer forward past the tokens it was fed")
            if len(set(keep)) == 1:  # (every row the same: a view of one token's states)
                self.state = states[:, keep[0] - 1]
                return
            at = mx.array([max(n - 1, 0) for n in keep], dtype=mx.int32)
            kept = states[mx.arange(len(keep)), at]
            self.state = mx.where(mx.array(list(keep))[:, None, None, None] > 0, kept, state)
            return
        fed = -1 if record is None else sum(k.shape[2] for k, _, _ in record)
        if fed < max(keep):
            raise ValueError("rolling a lightning layer forward needs the calls' record")
        if min(keep) == fed:  # every row keeps all it was fed: the state is already right
            return
        k = mx.concatenate([k for k, _, _ in record], axis=2)
        v = mx.concatenate([v for _, v, _ in record], axis=2)
        self.state = gla_replay(k, v, record[0][2], state, mx.array(list(keep), dtype=mx.int32))


LayerCache = LightningCache | SparseKVCache

# kind → class: what `ModelCache` builds for a layer of that kind, and reads back from disk.
LAYER_CACHES: dict[str, type[LayerCache]] = {c.kind: c for c in (LightningCache, SparseKVCache)}


@dataclass(frozen=True)
class Checkpoint:
    """What a cache held before calls that may be partly taken back (`ModelCache.checkpoint`):
    the rows' positions, and per layer its lightning state (an array: a reference is a copy, as
    MLX arrays never change) or its sparse rows' own lengths."""

    positions: tuple[int, ...]
    layers: tuple[mx.array | tuple[int, ...] | None, ...]


class ModelCache:
    """The caches of all layers and the number of tokens each row (sequence) has seen."""

    def __init__(self, layers: list[LayerCache], positions: list[int] | None = None) -> None:
        self.layers = layers
        self.positions = positions  # per row; None until the first call
        self.prefill_len = 0

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> ModelCache:
        return cls([LAYER_CACHES[k].for_config(cfg) for k in cfg.layer_kinds])

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

    # -- taking tokens back (speculative decoding, ragged batches) ----------------------------
    def checkpoint(self, record: bool = True, stepwise: bool = True) -> Checkpoint:
        """Marks the cache as it is, so that `rollback` can keep any number of the tokens fed to
        each row after it. `record`: lightning layers record what the calls until then feed
        their recurrence (which rolling back to a point other than this one needs); without,
        only rolling back to here is possible. `stepwise` (with `record`): the calls are a
        verify pass, and every layer feeds their tokens one by one with the decode step's
        arithmetic, so the pass gives what decoding them gives; without, they run as a
        prefill does (a batch of prompts of different lengths, padded, each rolled back to its
        own length)."""
        layers = []
        for c in self.layers:
            if isinstance(c, SparseKVCache):
                layers.append(tuple(c.keys.lengths))
                c.stepwise = record and stepwise
            else:
                layers.append(c.state)
                c.record = [] if record else None
                c.stepwise = record and stepwise
        return Checkpoint(tuple(self.positions), tuple(layers))

    def rollback(self, point: Checkpoint, keep: Sequence[int]) -> None:
        """Keeps the first keep[b] tokens fed to row b since `point`, as if the rest were never
        fed: lightning states replayed exactly (`LightningCache.rollback`), sparse keys, values
        and compressed chunks cut, positions set back. The rows must be the checkpoint's."""
        if len(keep) != len(point.positions) or self.rows != len(keep):
            raise ValueError(f"rollback of {len(keep)} rows, the cache has {self.rows}")
        for c, before in zip(self.layers, point.layers, strict=True):
            if isinstance(c, SparseKVCache):
                c.truncate([n + k for n, k in zip(before, keep, strict=True)])
            else:
                c.rollback(before, keep)
        self.positions = [p + k for p, k in zip(point.positions, keep, strict=True)]

    # -- batches -------------------------------------------------------------------------------
    def fork(self, n: int) -> ModelCache:
        """n rows that continue this one-row cache (a prefilled document): lightning states are
        copied per row, sparse-layer keys are shared, not copied n times.

        Forks made while this cache holds the same number of tokens share the same `SharedKeys`
        objects, so they can be concatenated, however many forks and whenever they were made
        (see `SparseKVCache.fork`). The document must not be continued meanwhile: forks made
        after it grew cannot join rows forked before.
        """
        if self.rows != 1:
            raise ValueError(f"fork needs a one-row cache, this one has {self.rows} rows")
        return ModelCache([c.fork(n) for c in self.layers], self.positions * n)

    def select(self, rows: Sequence[int]) -> ModelCache:
        """A cache with only these rows, in this order; it keeps the shared keys, so it can be
        concatenated with other forks of the same document."""
        return ModelCache([c.select(rows) for c in self.layers], [self.positions[b] for b in rows])

    @staticmethod
    def concat(caches: Sequence[ModelCache]) -> ModelCache:
        """One batch of all rows of `caches`, at any positions. Their sparse layers must hold the
        same shared keys: either all are forks of one document (made at one length, perhaps
        selected or concatenated since), or none holds shared keys (fresh caches, each prefilled
        on its own). A batch reads its shared keys from one buffer, so mixing is refused."""
        layers = [type(parts[0]).concat(parts) for parts in zip(*caches, strict=True)]
        return ModelCache(layers, [p for c in caches for p in c.positions])

    def arrays(self) -> list[mx.array]:
        """Every array the cache holds (to evaluate them together with a step's output)."""
        return [a for c in self.layers for a in c.arrays()]

    # -- the compiled decode step (salabatch.engine.decode) ------------------------------------
    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions in every row's own buffers (past any shared keys), so
        that many decode steps run on buffers of one shape (one compiled trace)."""
        for c in self.layers:
            if isinstance(c, SparseKVCache) and c.keys.data is not None:
                c.reserve(tokens, c.keys.data)

    def own_length(self) -> int:
        """Positions the longest row holds in its own buffers (past any shared keys)."""
        return max((p - self.shared_start for p in self.positions), default=0)

    @property
    def shared_start(self) -> int:
        """Positions every row shares (a fork's document, up to a level-2 chunk), 0 without."""
        sparse = [c for c in self.layers if isinstance(c, SparseKVCache)]
        return sparse[0].start if sparse else 0

    def step_inputs(self) -> tuple[SharedKeys | None, list]:
        """What `Model.step` reads of the cache: the shared keys (the same in every sparse
        layer: they come from one document; None without) and each layer's arrays."""
        sparse = [c for c in self.layers if isinstance(c, SparseKVCache)]
        layers = [
            (c.step_arrays(), c.shared_arrays()) if isinstance(c, SparseKVCache) else c.state
            for c in self.layers
        ]
        return (sparse[0].shared if sparse else None), layers

    def own_capacity(self) -> int:
        """Positions the rows' own buffers hold in every sparse layer (0 without one)."""
        return next((c.keys.data.shape[2] for c in self.layers if isinstance(c, SparseKVCache)), 0)

    def stepped(self, layers: list, selected: list[mx.array], sparse: bool = True) -> None:
        """Takes a decode step's outputs: each layer's rewritten arrays, one more position per
        row; a sparse layer that records its selections (`trace`) gets its blocks when some row
        ran `sparse` (as the per-layer path records only InfLLM-v2 calls)."""
        blocks = iter(selected)
        for c, arrays in zip(self.layers, layers, strict=True):
            if isinstance(c, SparseKVCache):
                c.stepped(arrays)
                chosen = next(blocks)
                if c.trace is not None and sparse:
                    c.trace.append(chosen)
            else:
                c.state = arrays
        self.positions = [p + 1 for p in self.positions]

    # -- serialization -------------------------------------------------------------------------
    def to_state(self, since: int = 0) -> tuple[dict[str, mx.array], dict[str, str]]:
        """Arrays and string metadata of a one-row cache (a prefix, or a prefill
        snapshot): everything needed to continue it exactly. Layer i's arrays are named
        `layers.{i}.<name>`; buffers are cut to their length. With `since` (a position before
        this one), only what came after it: a part for `joined_state`."""
        if self.rows != 1:
            raise ValueError(f"only a one-row cache can be saved, this one has {self.rows} rows")
        if not 0 <= since <= self.offset:
            raise ValueError(f"since must be in [0, {self.offset}], got {since}")
        arrays = {
            f"layers.{i}.{name}": a
            for i, c in enumerate(self.layers)
            for name, a in c.to_state(since).items()
        }
        meta = {
            "format_version": str(FORMAT_VERSION),
            "layer_kinds": json.dumps([c.kind for c in self.layers]),
            "position": str(self.offset),
            "prefill_len": str(self.prefill_len),
        }
        return arrays, meta | ({"since": str(since)} if since else {})

    @staticmethod
    def joined_state(
        parts: Sequence[tuple[dict[str, mx.array], dict[str, str]]], source: str = ""
    ) -> tuple[dict[str, mx.array], dict[str, str]]:
        """The whole state (`from_state`'s) of consecutive parts of one cache (`to_state`
        with `since` each its predecessor's position, the first 0), in order; CacheFormatError
        where they are not."""
        at = 0
        for _, meta in parts:
            if meta.get("since", "0") != str(at) or meta.get("layer_kinds") is None:
                why = f"a part from {meta.get('since')} where {at} was expected"
                raise CacheFormatError(f"not a usable cache: {why}", path=source or None)
            at = int(meta.get("position", "0"))
        kinds = json.loads(parts[-1][1]["layer_kinds"])
        arrays = {}
        for i, kind in enumerate(kinds):
            scope = f"layers.{i}."
            layer = [
                {k[len(scope) :]: a for k, a in p.items() if k.startswith(scope)} for p, _ in parts
            ]
            arrays |= {scope + k: a for k, a in LAYER_CACHES[kind].joined(layer).items()}
        return arrays, {k: v for k, v in parts[-1][1].items() if k != "since"}

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
        if kinds != list(cfg.layer_kinds):
            raise bad("its layer layout is not this model's")
        layers = []
        for i, kind in enumerate(kinds):
            scope = f"layers.{i}."
            state = {k[len(scope) :]: a for k, a in arrays.items() if k.startswith(scope)}
            try:
                layers.append(LAYER_CACHES[kind].from_state(state, position, cfg))
            except KeyError as e:
                raise bad(f"missing array '{scope}{e.args[0]}'") from None
            except ValueError as e:
                raise bad(f"layer {i} {e}") from None
        cache = cls(layers, [position])
        cache.plan_prefill(prefill_len)
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes held, the shared keys counted once."""
        shared = {
            id(c.shared): c.shared_nbytes for c in self.layers if isinstance(c, SparseKVCache)
        }
        return sum(c.nbytes for c in self.layers) + sum(shared.values())
