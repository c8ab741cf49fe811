"""Lightning attention layer (simple-GLA with a fixed per-head decay), SPEC §3.

x → q, k, v, z projections → qk-norm → RoPE (full head dim, NeoX layout) → float32 simple-GLA
recurrence → full-width RMSNorm (o_norm) → × sigmoid(z) → o_proj. The recurrent state is the whole
cache: [B, H, dk, dv] in float32, whatever the activation dtype.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.cache import LightningCache
from salabatch.engine.config import ModelConfig
from salabatch.engine.kernels import attention, gla_cuda
from salabatch.engine.kernels.gates import sigmoid_mul
from salabatch.engine.kernels.gla import decay_slopes, gla, gla_step_decayed, gla_stepwise
from salabatch.engine.linear import Linear, fuse

# A verify pass keeps a lightning layer's state after each of its tokens (a rollback then takes
# the one it keeps, one op) where they take at most this many bytes; beyond, the k, v it fed
# are kept and a rollback replays them (`kernels.gla.gla_replay`): the 9B's state is 2 MiB a
# row, so one row's pass of up to 8 tokens keeps its states.
STATES_BYTES = 16 << 20


class LightningAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.lightning_heads
        self.n_kv_heads = cfg.lightning_kv_heads
        self.head_dim = d = cfg.lightning_head_dim
        self.scale = cfg.lightning_scale_value
        self.use_rope = cfg.lightning_use_rope
        self.rope_theta = cfg.rope_theta
        self.eps = cfg.rms_norm_eps
        hidden = cfg.hidden_size
        self.q_proj = Linear(hidden, self.n_heads * d, bias=False)
        self.k_proj = Linear(hidden, self.n_kv_heads * d, bias=False)
        self.v_proj = Linear(hidden, self.n_kv_heads * d, bias=False)
        self.o_proj = Linear(self.n_heads * d, hidden, bias=False)
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(d, eps=self.eps)
            self.k_norm = nn.RMSNorm(d, eps=self.eps)
        if cfg.use_output_norm:
            self.o_norm = nn.RMSNorm(self.n_heads * d, eps=self.eps)
        if cfg.use_output_gate:
            self.z_proj = Linear(hidden, self.n_heads * d, bias=False)
        # Log-decay per head: fixed ALiBi slopes, the same in every layer (SPEC §3.5, P3). Built
        # from Python floats, so it is data, not an op bound to the stream of the loading thread.
        slopes = decay_slopes(self.n_heads)
        self._log_decay = mx.array([-s for s in slopes], dtype=mx.float32)
        self._decay = mx.array([math.exp(-s) for s in slopes], dtype=mx.float32)  # exp(g)
        heads = self.n_heads + self.n_kv_heads  # q's heads then k's, in the decode step
        # [heads, 1, 1], built whole from Python values for the same reason (a view of an array
        # would be an op on this thread's stream, which another thread's decode cannot run)
        self._is_q = mx.array([[[h < self.n_heads]] for h in range(heads)])
        self._qk_scale = mx.array(
            [[[self.scale if h < self.n_heads else 1.0]] for h in range(heads)], dtype=mx.float32
        )
        self.fused = None  # q, k, v, z as one matmul (`fuse`), for the decode step
        # A decode step has the same shapes every time: one compiled graph per batch size
        # replaces ~25 op dispatches; the weights are its implicit inputs, so it sees updates.
        self._step = mx.compile(self._forward, inputs=self.state)
        # per T and batch size; keeping the state after every token, or the k, v fed (smaller)
        self._verify = mx.compile(self._recorded, inputs=self.state)
        self._verify_states = mx.compile(self._recorded_states, inputs=self.state)

    def __call__(self, x: mx.array, cache: LightningCache, offset: int | mx.array) -> mx.array:
        """x [B, T, hidden] (already input-normed); offset: position of x[:, 0] (int or [B])."""
        if cache.record is not None and cache.stepwise:  # a verify pass: token by token
            positions = mx.broadcast_to(mx.array(offset, dtype=mx.int32), (x.shape[0],))
            B, T = x.shape[:2]
            fits = B * T * cache.state[0].nbytes <= STATES_BYTES
            if cache.record[:1] == [None] or (not cache.record and fits):  # as the first call
                y, states = self._verify_states(x, cache.state, positions)
                cache.states = (
                    states
                    if cache.states is None
                    else mx.concatenate([cache.states, states], axis=1)
                )
                cache.state = states[:, -1]
                cache.record.append(None)  # a call of T tokens, its states kept
            else:
                y, cache.state, k, v = self._verify(x, cache.state, positions)
                cache.record.append((k, v, self._log_decay))
            return y
        if cache.record is not None:  # a call that may be partly taken back: recorded
            return self._out(self.core(x, cache, offset), x)
        if x.shape[1] == 1 and cache.state is not None:
            positions = mx.broadcast_to(mx.array(offset, dtype=mx.int32), (x.shape[0],))
            y, cache.state = self._step(x, cache.state, positions)
            return y
        y, cache.state = self._forward(x, cache.state, offset)
        return y

    def fuse(self) -> None:
        gate = [self.z_proj] if "z_proj" in self else []
        self.fused = fuse([self.q_proj, self.k_proj, self.v_proj, *gate])

    def step(
        self, x: mx.array, state: mx.array, pos: mx.array, weights: tuple
    ) -> tuple[mx.array, mx.array]:
        """One decode step inside the compiled model step: x [B, 1, hidden] at positions
        pos [B], the state [B, H, dk, dv], the fused projections' `weights` or () → (the
        gated output before o_proj [B, 1, H·dv], the new state). The dispatcher: on CUDA with
        its kernel on, the fused product's q, k, v go through one launch (`gla_cuda.step`:
        norms, rope, the state's update and read-out); else `_step_ops`."""
        d, H, Hk = self.head_dim, self.n_heads, self.n_kv_heads
        if weights:  # q and k are neighbours in the fused product: one view of both
            y = self.fused.product(x, weights)
            z = [y[..., (H + 2 * Hk) * d :]] if "z_proj" in self else []
            if gla_cuda.available() and gla_cuda.step_supports(y, H, Hk, d):
                norms = (self.q_norm.weight, self.k_norm.weight) if "q_norm" in self else None
                o, state = gla_cuda.step(
                    y, norms, pos, self._decay, state, heads=H, kv_heads=Hk, d=d,
                    scale=self.scale, eps=self.eps,
                    rope_base=self.rope_theta if self.use_rope else None,
                )  # fmt: skip
            else:
                qk, v = y[..., : (H + Hk) * d], y[..., (H + Hk) * d : (H + 2 * Hk) * d]
                o, state = self._step_ops(qk, v, pos, state)
        else:
            qk = mx.concatenate([self.q_proj(x), self.k_proj(x)], axis=-1)
            z = [self.z_proj(x)] if "z_proj" in self else []
            o, state = self._step_ops(qk, self.v_proj(x), pos, state)
        if "o_norm" in self:
            o = self.o_norm(o)
        if z:
            o = sigmoid_mul(o, z[0])
        return o, state

    def _step_ops(
        self, qk: mx.array, v: mx.array, pos: mx.array, state: mx.array
    ) -> tuple[mx.array, mx.array]:
        """The step's recurrence as MLX ops, from the projections' q and k side by side
        [B, 1, (H + Hk)·d] and v [B, 1, Hk·d] → (o [B, 1, H·dv] in their dtype, the new
        state). q and k go through one norm and one rope together, q pre-scaled (the rotation
        is linear)."""
        B, d, H, Hk = qk.shape[0], self.head_dim, self.n_heads, self.n_kv_heads
        qk = qk.reshape(B, 1, H + Hk, d).transpose(0, 2, 1, 3)  # [B, H + Hk, 1, d]
        if "q_norm" in self:
            qk = mx.fast.rms_norm(qk, None, self.eps)
            w = mx.where(self._is_q, self.q_norm.weight, self.k_norm.weight)
            qk = qk * w
        dtype = qk.dtype
        qk = (qk * self._qk_scale).astype(mx.float32)  # q pre-scaled: the rotation is linear
        if self.use_rope:
            qk = mx.fast.rope(qk, d, traditional=False, base=self.rope_theta, scale=1.0, offset=pos)
        q, k = qk[:, :H], qk[:, H:]
        v = v.reshape(B, 1, Hk, d).transpose(0, 2, 1, 3)
        if Hk != H:
            k, v = mx.repeat(k, H // Hk, axis=1), mx.repeat(v, H // Hk, axis=1)
        o, state = gla_step_decayed(q, k, v, self._decay, state)
        return o.transpose(0, 2, 1, 3).reshape(B, 1, -1).astype(dtype), state

    def _forward(
        self, x: mx.array, state: mx.array | None, offset: int | mx.array
    ) -> tuple[mx.array, mx.array]:
        cache = LightningCache(state)
        return self._out(self.core(x, cache, offset), x), cache.state

    def _recorded(
        self, x: mx.array, state: mx.array, offset: mx.array
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """A verify pass's call: `_forward` token by token (`gla_stepwise`) → (y, the state,
        and the k, v [B, H, T, d] float32 it fed the recurrence, for a rollback to replay)."""
        cache = LightningCache(state)
        cache.record, cache.stepwise = [], True
        o = self.core(x, cache, offset)
        ((k, v, _),) = cache.record
        return self._out(o, x), cache.state, k, v

    def _recorded_states(
        self, x: mx.array, state: mx.array, offset: mx.array
    ) -> tuple[mx.array, mx.array]:
        """`_recorded`, keeping the state after every token [B, T, H, dk, dv] instead of the k,
        v: a rollback takes the one it keeps (`LightningCache.rollback`)."""
        cache = LightningCache(state)
        cache.record, cache.stepwise = [], True
        return self._out(self.core(x, cache, offset), x), cache.states

    def _out(self, o: mx.array, x: mx.array) -> mx.array:
        """The recurrence's output o [B, T, H*dv] → o_norm → × sigmoid(z_proj(x)) → o_proj."""
        if "o_norm" in self:
            o = self.o_norm(o)
        if "z_proj" in self:
            o = sigmoid_mul(o, self.z_proj(x))
        return self.o_proj(o)

    def core(self, x: mx.array, cache: LightningCache, offset: int | mx.array) -> mx.array:
        """The recurrence's output [B, T, H*dv] cast to x's dtype (SPEC §3.6 step 7), before
        o_norm and the gate."""
        B, T, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).reshape(B, T, self.n_heads, d)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, d)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, d)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, H, T, d]
        if self.use_rope:
            q = _rope(q, offset, self.rope_theta)
            k = _rope(k, offset, self.rope_theta)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        if cache.record is not None:  # what rollback replays
            f32 = mx.float32
            cache.record.append((k.astype(f32), v.astype(f32), self._log_decay))
        if cache.stepwise:  # decode's arithmetic, token by token
            o, cache.states = gla_stepwise(q, k, v, self._log_decay, self.scale, cache.state)
            cache.state = cache.states[:, -1]
            o = o.transpose(0, 2, 1, 3).astype(x.dtype)  # cast as transposed: one copy
        else:  # o rounded by the dispatcher, in the order read here
            o, cache.state = gla(q, k, v, self._log_decay, self.scale, cache.state, x.dtype)
            o = o.transpose(0, 2, 1, 3)
        return o.reshape(B, T, -1)  # [B, T, H*dv]


def _rope(x: mx.array, offset: int | mx.array, base: float) -> mx.array:
    """NeoX-style RoPE over the full head dim, computed in float32 like HF, cast back: on a
    GPU one kernel of x as it is (`attention.rotates_in_float32`), on the CPU upcast."""
    rope = dict(traditional=False, base=base, scale=1.0, offset=offset)
    if attention.rotates_in_float32():
        return mx.fast.rope(x, x.shape[-1], **rope)
    return mx.fast.rope(x.astype(mx.float32), x.shape[-1], **rope).astype(x.dtype)
