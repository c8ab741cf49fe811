"""MiniCPM-SALA: embeddings → 32 hybrid blocks (sparse or lightning mixer + SwiGLU MLP) → logits.

Module names mirror the HF checkpoint (`model.layers.{i}.self_attn.q_proj`, …), so weights load
under their own names; `sanitize` is the only place that knows about checkpoint quirks.
muP scaling (SPEC §2): embeddings × scale_emb, each residual branch × scale_depth/√L, and the final
hidden state ÷ (hidden_size / dim_model_base) before lm_head.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.cache import ModelCache
from salabatch.engine.config import LIGHTNING, ModelConfig
from salabatch.engine.decode import DecodeStep
from salabatch.engine.kernels.gates import silu_mul
from salabatch.engine.lightning import LightningAttention
from salabatch.engine.linear import Linear, add_product_norm, fuse, product
from salabatch.engine.sparse import SparseAttention


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        self.fused = None  # gate and up as one matmul (`fuse`), for the decode step

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    def hidden(self, x: mx.array, weights: tuple) -> mx.array:
        """silu(gate(x))·up(x), before down_proj; `weights`: the fused gate and up, or ()."""
        if weights:
            g, u = self.fused.apply(x, weights)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        return silu_mul(g, u)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.residual_scale = cfg.residual_scale
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        mixer = LightningAttention if kind == LIGHTNING else SparseAttention
        self.self_attn = mixer(cfg)
        self.mlp = MLP(cfg)

    def __call__(self, h: mx.array, cache, offset: int | mx.array) -> mx.array:
        h = h + self.residual_scale * self.self_attn(self.input_layernorm(h), cache, offset)
        return h + self.residual_scale * self.mlp(self.post_attention_layernorm(h))

    def fuse(self) -> None:
        """Each group of projections of one input as one matmul, for the decode step."""
        self.self_attn.fuse()
        self.mlp.fused = fuse([self.mlp.gate_proj, self.mlp.up_proj])

    def step_weights(self) -> tuple:
        """The fused buffers the decode step takes: (the mixer's, the MLP's), each () where the
        layers run one by one."""
        parts = (self.self_attn.fused, self.mlp.fused)
        return tuple(() if f is None else f.arrays() for f in parts)

    def step(self, h: mx.array, x: mx.array, arrays, info: mx.array, tables: dict, mode: str, norm):
        """A decode step (see `Model.step`): h, and x = this layer's input norm of h; arrays:
        (the layer's cache arrays, `step_weights`); norm: what reads h next (the next layer's
        input norm, or the model's final norm) → (h, norm(h), the rewritten cache arrays, the
        blocks a sparse layer attended or None). Each residual add comes with the norm after it
        (`add_product_norm`): on Metal an addmm then the norm; on CUDA the MLP's follows a
        plain product of its down projection, the step's largest, which an addmm would run as
        a slower GEMM (an H100's measure: `add_product`), and with the norm kernel on both
        products are plain and each add is one launch with its norm."""
        arrays, (mixer_w, mlp_w) = arrays
        attn, s = self.self_attn, self.residual_scale
        if self.kind == LIGHTNING:
            o, arrays = attn.step(x, arrays, info[:, 0], mixer_w)
            selected = None
        else:
            o, arrays, selected = attn.step(x, arrays, info, tables, mode, mixer_w)
        h, x = add_product_norm(h, attn.o_proj, o, s, self.post_attention_layernorm)
        y = self.mlp.hidden(x, mlp_w)
        h, x = add_product_norm(h, self.mlp.down_proj, y, s, norm, split_on_cuda=True)
        return h, x, arrays, selected


def with_writes(h: mx.array, cache) -> mx.array:
    """h, the output of a layer, computed only with what the layer wrote to `cache` (a lightning
    layer's new state). Those writes are a branch off the chain of h that only the caller's
    eval reads, and MLX computes such a branch after all the rest: each layer's temporaries
    that it reads (a lightning layer's chunk states, 0.5 GB a layer and 8K chunk at the 9B's
    heads on the GPU path) were held until the last layer. A no-kernel node (`mx.depends`)."""
    return mx.depends(h, cache.arrays())


class SALAModel(nn.Module):
    """The decoder without the head (`model.*` in the checkpoint)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.scale_emb = cfg.scale_emb
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Block(cfg, kind) for kind in cfg.layer_kinds]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: ModelCache, queue: bool = False) -> mx.array:
        """`queue`: each layer is queued for the device as soon as it is built, so the device
        runs it while the host builds the next (a verify pass, which cannot overlap the step
        before it: its drafts needed that step's tokens)."""
        B, T = ids.shape
        offset = cache.advance(B, T)
        h = self.embed_tokens(ids) * self.scale_emb  # [B, T, hidden]
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = with_writes(layer(h, layer_cache, offset), layer_cache)
            if queue:
                mx.async_eval(h)
        return self.norm(h)


class Model(nn.Module):
    """`model(ids [B, T], cache) -> logits [B, T, vocab]`; later calls continue the sequence.

    A prompt fed in chunks equals one call over it when `cache.plan_prefill(total)` announced
    it: sparse layers choose dense attention or InfLLM-v2 by the prompt's whole length, as one
    call does. Without a plan each call chooses by the tokens seen so far, as a decode step
    does, so a prompt that crosses `dense_len` in a later chunk differs from one call in the
    queries of its earlier chunks that sit past the top-k's reach (`ModelCache.plan_prefill`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = SALAModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.decoder = DecodeStep(self)  # the compiled decode step (salabatch.engine.decode)
        self._no_token: mx.array | None = None  # see `limit_vocab`

    def __call__(
        self, ids: mx.array, cache: ModelCache | None = None, queue: bool = False
    ) -> mx.array:
        return self.logits(self.hidden(ids, cache, queue))

    def hidden(
        self, ids: mx.array, cache: ModelCache | None = None, queue: bool = False
    ) -> mx.array:
        """Final-normed hidden states [B, T, hidden]; generation takes logits of the last only.
        `queue`: each layer evaluated asynchronously as soon as it is built (`SALAModel`)."""
        if ids.ndim != 2 or 0 in ids.shape:
            raise ValueError(f"ids must be [batch, tokens], both ≥ 1, got shape {tuple(ids.shape)}")
        return self.model(ids, self.make_cache() if cache is None else cache, queue)

    def limit_vocab(self, tokens: int) -> None:
        """Only ids below `tokens` (the tokenizer's) are ever drawn or scored: a checkpoint
        whose vocab_size pads the embedding table past its tokenizer (for the matmul's shape)
        would otherwise draw ids that decode to nothing. Their logits become -inf: one add
        per call, none when nothing pads."""
        vocab = self.config.vocab_size
        if not 0 < tokens <= vocab:
            raise ValueError(f"tokens must be in 1..{vocab}, got {tokens}")
        if tokens == vocab:
            self._no_token = None
            return
        self._no_token = mx.where(mx.arange(vocab) < tokens, 0.0, -mx.inf).astype(mx.float32)

    def logits(self, h: mx.array) -> mx.array:
        h = h / self.config.logit_divisor
        if "lm_head" in self:
            logits = self.lm_head(h)
        elif "scales" in self.model.embed_tokens:  # the tied head, quantized: its own product
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = product(h, self.model.embed_tokens.weight)
        return logits if self._no_token is None else logits + self._no_token.astype(logits.dtype)

    def step(self, tokens: mx.array, info: mx.array, tables: dict, layers: list, mode: str):
        """One decode step as a pure function, what `salabatch.engine.decode` compiles: tokens
        [B] int32; layers: each layer's (cache arrays, `Block.step_weights`); info (its first
        column the rows' positions), tables and mode as `kernels.sparse_decode
        .decode_attention` takes them. → (logits [B, vocab], each layer's rewritten cache
        arrays, each sparse layer's blocks)."""
        h = self.model.embed_tokens(tokens[:, None]) * self.model.scale_emb  # [B, 1, hidden]
        x = self.layers[0].input_layernorm(h)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.model.norm]
        out, selected = [], []
        for layer, arrays, norm in zip(self.layers, layers, norms, strict=True):
            h, x, arrays, blocks = layer.step(h, x, arrays, info, tables, mode, norm)
            out.append(arrays)
            if blocks is not None:
                selected.append(blocks)
        return self.logits(x)[:, 0], out, selected

    def fuse(self) -> None:
        """Projections of one input as one matmul each (`linear.Fused`): their weights become
        views of shared buffers; for the compiled decode step, which pays per kernel."""
        for layer in self.layers:
            layer.fuse()

    @property
    def is_fused(self) -> bool:
        return any(layer.mlp.fused is not None for layer in self.layers)

    def update(self, *args, **kwargs):
        """nn.Module.update (what loading weights and optimizers call); new weights make the
        fused buffers stale, so the decode step runs each projection on its own after it."""
        self._unfuse()
        return super().update(*args, **kwargs)

    def update_modules(self, *args, **kwargs):
        """nn.Module.update_modules (what quantizing calls): new layers make the fused buffers
        stale, as new weights do."""
        self._unfuse()
        return super().update_modules(*args, **kwargs)

    def _unfuse(self) -> None:
        for layer in self.layers:
            layer.self_attn.fused = layer.mlp.fused = None

    def make_cache(self) -> ModelCache:
        return ModelCache.for_config(self.config)

    @property
    def layers(self) -> list[Block]:
        return self.model.layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names → ours: drops rotary buffers some exports carry, and a tied head."""
        out = {}
        for name, w in weights.items():
            if "rotary_emb." in name:
                continue
            if name.startswith("lm_head.") and self.config.tie_word_embeddings:
                continue  # the head is the embedding (also its quantized scales and biases)
            out[name] = w
        return out
