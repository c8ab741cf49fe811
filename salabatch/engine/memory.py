"""Memory sized to the work: what a run will hold, from its plan, before it holds it.

A run holds the weights, one document's prefix cache at a time (the largest decides), a batch
of rows decoding over it, and the temporaries of one prefill chunk. The chunk's are bounded by
the kernels' tiles, not by the context: the tiles of a call are taken in turn
(`attention.in_turn`), so on the CPU path each of the two lanes holds one query tile at a time
(the largest, a dense-attention score tile: `attention.MAX_SCORE_ELEMENTS` floats), on the GPU
path one tile of at most `attention.TILE_MEMORY_SHARE` of the device's memory; beside them, a
layer's activations for the chunk. MLX encodes work ahead of the device and allocates as it
encodes: `bounded` sets its memory limit to the plan, past which it waits for earlier work, so
the run-ahead stays within what the plan counts (one op's allocation past it, `overshoot`).
MLX's buffer cache keeps freed buffers for reuse: `cache_limit` is what the chunks of a long
document reuse from one another (a tile of the sparse kernels per lane, the activations), so a
long prefill does not pile up freed buffers of every size. A share of RAM let `salabatch run`
on builtin:tiny hold 6.9 GB at 100K tokens while MLX's own peak was 0.8 GB; measured there,
limits from 128 MB to 6 GB prefill at the same speed (benchmarks/HISTORY.md, "Memory").

Every figure is an estimate from the config and the plan, in bytes; `MemoryPlan.line` says it
in one line, `check` refuses what the device cannot hold, and `bounded` holds a run to it.
On the GPU path forced on the CPU (`SALABATCH_GPU_PATH`), MLX's CPU SDPA is not fused: its
scores, which a GPU's fused kernel never writes, come on top of the plan.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from salabatch.engine.config import LIGHTNING, ModelConfig
from salabatch.engine.kernels import attention, gla, sparse_attention, sparse_select
from salabatch.engine.sparse_cache import capacity
from salabatch.errors import OutOfMemoryError

GB = 1 << 30
TILE_ARRAYS = 2  # arrays of a tile's size alive at once: its scores and their exponentials
MIN_CACHE = 64 << 20  # the buffer cache never goes below MLX's CPU default's order


@dataclass(frozen=True)
class MemoryPlan:
    """What a run holds at its peak (bytes): `weights`, the largest `document` prefix cache,
    the `rows` of a decoding batch (their states and own keys), a prefill chunk's `transient`
    temporaries; of these, `overshoot` is what one op may allocate past MLX's limit
    (`bounded`) before MLX waits for earlier work to free memory."""

    weights: int
    document: int
    rows: int
    transient: int
    overshoot: int

    @property
    def peak(self) -> int:
        return self.weights + self.document + self.rows + self.transient

    def line(self) -> str:
        parts = (
            f"weights {gb(self.weights)}, document cache {gb(self.document)}, "
            f"decoding rows {gb(self.rows)}, prefill chunk {gb(self.transient)}"
        )
        return f"about {gb(self.peak)} at its peak ({parts})"


# logits a scored prefill (`generate.Prefill(score=...)`) computes at once, positions × vocab:
# 128 MB in float32, 456 positions of the 9B's vocabulary; SCORE_ARRAYS of that size at once
# (the logits, in float32, their log-softmax, negated for the top-k, its order)
SCORE_ELEMENTS = 1 << 25
SCORE_ARRAYS = 5


def score_rows(cfg: ModelConfig) -> int:
    """Positions a scored prefill runs the head over at once."""
    return max(1, SCORE_ELEMENTS // cfg.vocab_size)


def score_bytes(cfg: ModelConfig, chunk: int) -> int:
    """What a scored prefill chunk adds to its temporaries: the head's arrays over
    `score_rows` of its positions, in float32."""
    return SCORE_ARRAYS * 4 * min(score_rows(cfg), chunk) * cfg.vocab_size


def gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


def plan_memory(
    cfg: ModelConfig,
    *,
    weights: int,
    doc_tokens: int,
    chunk: int,
    batch: int,
    row_tokens: int,
    itemsize: int,
    gpu: bool,
) -> MemoryPlan:
    """The plan of a run over documents of at most `doc_tokens` tokens, prefilled `chunk` at a
    time, answered `batch` rows at a time, each row holding up to `row_tokens` of its own
    (question and answer); activations of `itemsize` bytes, on the GPU path or the CPU's."""
    return MemoryPlan(
        weights=weights,
        document=document_bytes(cfg, doc_tokens, itemsize),
        rows=batch * row_bytes(cfg, row_tokens, itemsize),
        transient=transient_bytes(cfg, chunk, gpu),
        overshoot=overshoot_bytes(cfg, chunk, gpu),
    )


def answer_plan(
    cfg: ModelConfig,
    *,
    weights: int,
    doc_tokens: int,
    rows: list[int],
    chunk: int,
    batch_size: int,
    itemsize: int,
    gpu: bool,
) -> MemoryPlan:
    """What the run checks before it answers `rows` (each row's own tokens: its question
    and answer, or with no shared document its whole prompt too), `batch_size` at a time: over
    forks of a document prefix of `doc_tokens`, each row also holds its fork's tail (up to a
    level-2 compression stride, twice); pooled rows (`doc_tokens` 0) share nothing. The
    longest row decides, as the model's context allows."""
    tail = 2 * cfg.sparse.compression[1][1] if doc_tokens else 0
    longest = min(max(rows), cfg.context_length)
    batch = min(batch_size, len(rows))
    # no call is fed more than the document, or a batch of its longest rows: a chunk past that
    # is never filled (planned whole, prefill_chunk 2,000,000 refused a 6K-token document)
    chunk = max(1, min(chunk, max(doc_tokens, batch * (tail + longest))))
    return plan_memory(
        cfg, weights=weights, doc_tokens=doc_tokens, chunk=chunk,
        batch=batch, row_tokens=tail + longest, itemsize=itemsize, gpu=gpu,
    )  # fmt: skip


def model_plan(
    model, *, doc_tokens: int, rows: list[int], chunk: int, batch_size: int
) -> MemoryPlan:
    """`answer_plan` for a loaded model: its weights as they are, its dtype, the current
    device's path."""
    return answer_plan(
        model.config, weights=weights_bytes(model), doc_tokens=doc_tokens, rows=rows,
        chunk=chunk, batch_size=batch_size, itemsize=model.dtype.size, gpu=attention.on_gpu(),
    )  # fmt: skip


def weights_bytes(model) -> int:
    """Bytes of a loaded model's parameters."""
    from mlx.utils import tree_flatten

    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def checkpoint_weights_bytes(path, cfg: ModelConfig, itemsize: int) -> int:
    """Bytes a checkpoint's weights will take once loaded, without reading them: its
    parameter count in `itemsize` bytes, or for a quantized checkpoint the tensors loading
    keeps (the index's shards, less what `Model.sanitize` drops) as its safetensors headers
    list them, the packed integer weights as they are and every float tensor (scales, biases,
    unquantized weights) in `itemsize`, as loading casts them (a bf16-scaled checkpoint loaded
    in float32 takes ~20 % more than its files)."""
    from pathlib import Path

    from mlx.utils import tree_flatten

    from salabatch.engine.checkpoint import weight_files
    from salabatch.engine.model import Model
    from salabatch.errors import CheckpointError

    model = Model(cfg)  # lazy: nothing is allocated
    if cfg.quantization is None:
        return sum(p.size for _, p in tree_flatten(model.parameters())) * itemsize
    try:
        files = weight_files(Path(path))
    except CheckpointError:  # loading reports it; the sizes of what is there meanwhile
        files = sorted(Path(path).glob("*.safetensors"))
    return sum(_loaded_bytes(f, itemsize, model.sanitize) for f in files)


# safetensors' dtype names → bytes an element; the float ones load in the model's dtype
_SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4,
                      "U64": 8, "I64": 8, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # fmt: skip
_FLOATS = {"F16", "BF16", "F32", "F64"}


def _loaded_bytes(file, itemsize: int, kept) -> int:
    """A safetensors file's tensors that `kept` (a names → names filter: `Model.sanitize`)
    keeps, once loaded, from its header alone (8 bytes of its length, then JSON: each tensor's
    dtype and shape); a header that cannot be read, or lists a shape that is not one, counts
    the file's size (loading reports what is wrong with it)."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size <= 100 << 20 else None
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        total = 0
        for name in kept(dict.fromkeys(tensors)):
            kind, shape = tensors[name]["dtype"], tensors[name]["shape"]
            if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
                raise ValueError(f"{name}: no shape")
            total += math.prod(shape) * (itemsize if kind in _FLOATS else _SAFETENSORS_BYTES[kind])
        return total
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return file.stat().st_size if file.exists() else 0


def document_bytes(cfg: ModelConfig, tokens: int, itemsize: int) -> int:
    """A one-row cache of `tokens` positions: the sparse layers' keys, values and compressed
    keys in their capacity, the lightning layers' float32 states."""
    room = capacity(tokens)
    kv = cfg.num_key_value_heads * cfg.head_dim
    chunks = sum(room // stride + 1 for _, stride in cfg.sparse.compression)
    sparse = (2 * room + chunks) * kv * itemsize
    state = cfg.lightning_heads * cfg.lightning_head_dim**2 * 4
    kinds = cfg.layer_kinds
    return sum(state if k == LIGHTNING else sparse for k in kinds)


def row_bytes(cfg: ModelConfig, own_tokens: int, itemsize: int) -> int:
    """One decoding row over a shared document: its own lightning states and its own keys,
    values and chunks for `own_tokens` positions."""
    return document_bytes(cfg, own_tokens, itemsize)


def transient_bytes(cfg: ModelConfig, chunk: int, gpu: bool) -> int:
    """A prefill chunk's temporaries: the tiles in flight, a layer's float32 activations, and
    one allocation past the limit (`overshoot_bytes`)."""
    return (
        TILE_ARRAYS * tiles_bytes(gpu)
        + activation_bytes(cfg, chunk)
        + overshoot_bytes(cfg, chunk, gpu)
    )


def tiles_bytes(gpu: bool) -> int:
    """The largest tiles of the kernels in flight at once: one per lane (the kernels take their
    tiles in turn, `attention.in_turn`)."""
    return (1 if gpu else 2) * tile_bytes(gpu)


def tile_bytes(gpu: bool) -> int:
    """One tile's largest array: on the GPU path the whole tile budget, on the CPU's the
    largest of the kernels' float32 score tiles and gathered keys (the dense attention's)."""
    if gpu:
        return int(attention.device_memory() * attention.TILE_MEMORY_SHARE)
    scores = (
        attention.MAX_SCORE_ELEMENTS,
        sparse_select.MAX_SCORE_ELEMENTS,
        sparse_attention.MAX_SCORE_ELEMENTS,
    )
    return max(4 * max(scores), sparse_attention.MAX_GATHER_BYTES)


def overshoot_bytes(cfg: ModelConfig, chunk: int, gpu: bool) -> int:
    """The most one op of a prefill chunk allocates: a tile's array, or a layer's widest
    float32 activation (the heads' width, the MLP's, a lightning chunk's decayed scores). MLX
    checks its limit after an op has allocated, so a run bounded by `bounded` may pass the
    limit by this much."""
    heads = max(cfg.num_attention_heads, cfg.lightning_heads)
    widest = max(
        heads * max(cfg.head_dim, cfg.lightning_head_dim),
        cfg.intermediate_size,
        cfg.lightning_heads * gla.CHUNK,
    )
    return max(tile_bytes(gpu), chunk * widest * 4)


def reused_tiles_bytes(gpu: bool) -> int:
    """The tiles a long document's chunks allocate again and again: one per lane of the sparse
    kernels (a dense-attention tile of full size comes only below dense_len, in short
    prompts)."""
    if gpu:
        return tiles_bytes(gpu)
    return 2 * sparse_select.MAX_SCORE_ELEMENTS * 4


def activation_bytes(cfg: ModelConfig, chunk: int) -> int:
    """One layer's float32 intermediates for `chunk` tokens: the residual stream and norms, and
    the wider of the MLP's (gate, up, their product) and the mixer's: its projections, norms
    and rotations (six of the heads' width), and in a lightning layer the chunked forms'
    decayed scores (a chunk's length per head) and each chunk's state and start state."""
    d, heads = cfg.head_dim, max(cfg.num_attention_heads, cfg.lightning_heads)
    dk = cfg.lightning_head_dim
    states = 2 * cfg.lightning_heads * dk * dk // gla.CHUNK  # per token: two [dk, dv] a chunk
    mixer = 6 * heads * max(d, dk) + cfg.lightning_heads * gla.CHUNK + states
    return chunk * (4 * cfg.hidden_size + max(mixer, 3 * cfg.intermediate_size)) * 4


def cache_limit(cfg: ModelConfig, chunk: int, gpu: bool) -> int:
    """MLX's buffer cache for a run: what one chunk reuses from the last (a tile per lane, the
    activations), never a share of RAM."""
    return max(MIN_CACHE, reused_tiles_bytes(gpu) + activation_bytes(cfg, chunk))


def available_bytes(gpu: bool) -> int:
    """Memory the run may still take: on a GPU the device's working set less what MLX holds;
    on the CPU the system's available memory (Linux's MemAvailable), else its RAM."""
    import mlx.core as mx

    if gpu:
        return attention.device_memory() - mx.get_active_memory()
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# What a refused plan's error tells its user to change, by who made the plan (the Python API's
# calls each name their own keywords)
ADVICE_JOB = "lower engine.prefill_chunk or engine.batch_size, or free memory"
ADVICE_SERVE = (
    "send a shorter prompt or a lower max_tokens, or free memory (a smaller --prefix-memory)"
)


def check(plan: MemoryPlan, free: int | None = None, advice: str = ADVICE_JOB) -> None:
    """Refuses (OutOfMemoryError) the plan when its new memory (all but the weights, loaded
    already) exceeds `free` (by default what the device has available now, `available_bytes`),
    in one line naming both, and `advice`."""
    if free is None:
        free = available_bytes(attention.on_gpu())
    needs = plan.peak - plan.weights
    if needs > free:
        shown = gb if gb(needs) != gb(free) else (lambda n: f"{n / 2**20:.1f} MB")
        raise OutOfMemoryError(
            f"needs {shown(needs)} more than the weights ({plan.line()}) and {shown(free)} is "
            f"free: {advice}"
        )


@contextmanager
def bounded(plan: MemoryPlan) -> Iterator[int]:
    """MLX's memory limit for the block: what MLX holds now and the new memory of `plan` (all
    but the weights, loaded already); yields the limit, restores the one before after the
    block. MLX encodes ahead of the device, allocating as it encodes, and waits for earlier
    work only past its limit (by default about the device's memory): with the plan as the
    limit, a prefill's run-ahead stops at what the plan counts, so what `check` let in runs in
    what it was checked against."""
    import mlx.core as mx

    limit = mx.get_active_memory() + plan.peak - plan.weights - plan.overshoot
    previous = mx.set_memory_limit(limit)
    try:
        yield limit
    finally:
        mx.set_memory_limit(previous)
