"""Estimated FLOPs and bytes moved, per prefill chunk and per decode step, of SALA's forms and
the dense peer's: what `salabatch bench long --graph` sets beside the kernel counts.

Arithmetic from the configs, not a measurement. A chunk of T queries sits at positions
n − T … n − 1 of an n-token context (costs taken at its middle query); a decode step is `rows`
queries at position n. Parts:

* `weights`: every linear layer and the head, 2 FLOPs per weight and token; read once per call.
* SALA's lightning layers: the simple-GLA recurrence (chunked form in prefill, 64-token chunks,
  with the passes over its activations and float32 intermediates; the state read and written
  per row in decode; float32 state).
* SALA's sparse layers below dense_len: dense attention. From it: stage 1 (every query scores
  the level-1 and level-2 compressed keys, float32 keys as the cache stores them), stage 2 (the
  K = topk + window blocks of 64 keys each query attends).
* the peer: dense attention over all n keys, per layer.

Bytes of attention in prefill: a tile of TILE_QUERIES queries reads the keys it scores once
(flash attention's reuse; stage 2 reads each query's own blocks, the upper bound when queries
share none).
"""

from __future__ import annotations

from dataclasses import dataclass

from salabatch.engine.config import LIGHTNING, ModelConfig

GLA_CHUNK = 64
TILE_QUERIES = 64


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


def sala(cfg: ModelConfig, n: int, *, queries: int, decode: bool, itemsize: int) -> dict:
    """SALA's parts for `queries` queries at context n (a chunk, or a decode step's rows)."""
    d, H, Hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    Hl, dl = cfg.lightning_heads, cfg.lightning_head_dim
    sc = cfg.sparse
    at = n if decode else max(1, n - queries // 2)  # the middle query's position
    n_light = sum(k == LIGHTNING for k in cfg.layer_kinds)
    n_sparse = len(cfg.layer_kinds) - n_light
    parts = {"weights": _weights(_sala_params(cfg), queries, itemsize)}
    if decode:
        per_row = Cost(4 * Hl * dl * dl, 2 * Hl * dl * dl * 4)  # update + read-out; the state
        parts["lightning"] = _times(per_row, queries * n_light)
    else:
        flops = Hl * (4 * GLA_CHUNK * dl + 4 * dl * dl)  # intra-chunk, state in and out
        per_token = Cost(flops, _gla_bytes(Hl, dl, itemsize))
        parts["lightning"] = _times(per_token, queries * n_light)
    if at + 1 < sc.dense_len:
        parts["dense attention"] = _times(
            _attention(H, Hk, d, at, queries, decode, itemsize), n_sparse
        )
        return parts
    chunks = at // sc.compression[0][1] + at // sc.compression[1][1]
    stage1 = _attention(H, Hk, d, chunks, queries, decode, 4, softmax_only=True)
    keys = sc.topk_eff * sc.block_size
    stage2 = Cost(4 * H * d * keys * queries, 2 * Hk * keys * d * itemsize * queries)
    parts["stage 1"] = _times(stage1, n_sparse)
    parts["stage 2"] = _times(stage2, n_sparse)
    return parts


def peer(args: dict, n: int, *, queries: int, decode: bool, itemsize: int) -> dict:
    """The dense peer's (mlx-lm llama args as `bench.long.SHAPES` holds them) parts."""
    H, Hk, d = args["num_attention_heads"], args["num_key_value_heads"], args["head_dim"]
    at = n if decode else max(1, n - queries // 2)
    layers = args["num_hidden_layers"]
    attention = _attention(H, Hk, d, at, queries, decode, itemsize)
    return {
        "weights": _weights(_peer_params(args), queries, itemsize),
        "attention": _times(attention, layers),
    }


def total(parts: dict) -> Cost:
    out = Cost(0.0, 0.0)
    for cost in parts.values():
        out = out + cost
    return out


def _attention(H, Hk, d, keys, queries, decode, itemsize, softmax_only=False) -> Cost:
    """Queries against `keys` keys of width d: QK and PV (QK only for stage-1 scores)."""
    flops = (2 if softmax_only else 4) * H * d * keys * queries
    reads = (1 if softmax_only else 2) * Hk * keys * d * itemsize
    tiles = queries if decode else -(-queries // TILE_QUERIES)
    return Cost(flops, reads * tiles)


def _gla_bytes(heads: int, d: int, itemsize: int) -> float:
    """Bytes a lightning layer's prefill moves per token besides its projections (the GPU's
    form, `kernels.gla.gla_parallel`, one read or write per kernel's operand): 17 passes over
    an activation (q, k norms and ropes, casts, o_norm, the gate, o), 18 over a float32 one
    (casts, the chunks' products, the read-out), 4 over the chunk scores and 4 over the chunk
    states (each chunk's own part, then the carried states)."""
    activation, wide = heads * d * itemsize, heads * d * 4
    scores, states = GLA_CHUNK * heads * 4, heads * d * d * 4 / GLA_CHUNK
    return 17 * activation + 18 * wide + 4 * scores + 4 * states


def _weights(params: int, queries: int, itemsize: int) -> Cost:
    return Cost(2 * params * queries, params * itemsize)


def _times(cost: Cost, k: int) -> Cost:
    return Cost(cost.flops * k, cost.bytes * k)


def _sala_params(cfg: ModelConfig) -> int:
    """Weights of SALA's linear layers and head (the embedding is read by row, not counted)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    d, H, Hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    Hl, Hlk, dl = cfg.lightning_heads, cfg.lightning_kv_heads, cfg.lightning_head_dim
    lightning = h * dl * (2 * Hl + 2 * Hlk) + Hl * dl * h  # q, z; k, v; o
    sparse = h * d * (2 * H + 2 * Hk) + H * d * h  # q, o_gate; k, v; o
    mixers = sum(lightning if k == LIGHTNING else sparse for k in cfg.layer_kinds)
    return mixers + len(cfg.layer_kinds) * 3 * h * inter + h * cfg.vocab_size


def _peer_params(args: dict) -> int:
    h, inter = args["hidden_size"], args["intermediate_size"]
    H, Hk, d = args["num_attention_heads"], args["num_key_value_heads"], args["head_dim"]
    layer = h * d * (2 * H + 2 * Hk) + 3 * h * inter
    return args["num_hidden_layers"] * layer + h * args["vocab_size"]
