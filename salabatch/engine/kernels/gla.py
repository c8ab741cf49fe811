"""Simple-GLA kernels for the lightning layers (SPEC §3.6): a token-loop reference, a chunked
prefill form, a one-token decode step and its T-token twin for verify passes (on the CPU both one
native primitive, `native.gla_steps`), a rollback's replay, and the one dispatcher the model
calls.

Layout, for every function here:
    q, k   [B, H, T, dk]   any float dtype; cast to float32 inside
    v      [B, H, T, dv]
    g      [H]             log-decay per head, negative: g_h = -slope_h, gamma_h = exp(g_h)
    state  [B, H, dk, dv]  float32, or None for zeros
    scale  float
    returns (o [B, H, T, dv] float32 (`gla` and `gla_parallel`: out_dtype), final_state
             [B, H, dk, dv] float32)

Recurrence for token t (the current token is included in its own output):
    S_t = gamma * S_{t-1} + k_t ⊗ v_t,    o_t = scale * q_t^T S_t
"""

from __future__ import annotations

import mlx.core as mx

from salabatch.engine.kernels import gla_cuda, native
from salabatch.engine.kernels.attention import on_gpu
from salabatch.engine.runtime import dtype_name

# Tokens per chunk of the chunked forms (`gla_chunked`, `gla_parallel`).
CHUNK = 64
# Full chunks are processed this many at a time: the per-chunk start states of a segment,
# [B, H, n, dk, dv], are the largest intermediate (64 MiB for the 9B at n = 32, B = 1).
_SEGMENT_CHUNKS = 32
# GPU path: tokens per compiled graph. A longer call runs in segments of this many, so the
# [N, N] carry and the N chunk states (256 MiB for the 9B, B = 1) stay bounded; an 8K prefill
# chunk is one graph.
GPU_SEGMENT = 8192


def decay_slopes(n_heads: int) -> list[float]:
    """ALiBi slopes s_h (SPEC §3.5); the lightning log-decay is g_h = -s_h for every layer (P3).

    For n a power of 2, s_h = start^(h+1) with start = 2^(-2^(-(log2 n - 3))) = 2^(-8/n).
    Otherwise the slopes for the largest power of 2 p < n, then every other slope of the 2p
    schedule until there are n.
    """
    if n_heads < 1:
        raise ValueError(f"decay_slopes: expected n_heads >= 1, got {n_heads}")

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    p = 1 << (n_heads.bit_length() - 1)  # largest power of 2 <= n_heads
    if p == n_heads:
        return power_of_2(n_heads)
    return power_of_2(p) + power_of_2(2 * p)[0::2][: n_heads - p]


def _prepare(q, k, v, g, state):
    """Check shapes against the layout above and cast everything to float32."""
    state = _state(q, k, v, g, state)
    f32 = mx.float32
    return q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32), state


def _state(q, k, v, g, state):
    """Check shapes against the layout above → the state in float32 (zeros for None)."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (B, H, T) or g.shape != (H,):
        raise ValueError(
            "gla: expected q, k [B, H, T, dk], v [B, H, T, dv], g [H]; "
            f"got q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}"
        )
    if state is None:
        state = mx.zeros((B, H, dk, dv), dtype=mx.float32)
    elif state.shape != (B, H, dk, dv):
        raise ValueError(f"gla: expected state {(B, H, dk, dv)}, got {state.shape}")
    return state.astype(mx.float32)


def gla_recurrent_ref(q, k, v, g, scale, state=None):
    """Float32 token loop: the reference every other form is tested against."""
    q, k, v, g, S = _prepare(q, k, v, g, state)
    B, H, T, _ = q.shape
    gamma = mx.exp(g)[:, None, None]  # [H, 1, 1]
    outs = []
    for t in range(T):
        S = gamma * S + k[:, :, t, :, None] * v[:, :, t, None, :]  # [B, H, dk, dv]
        outs.append(scale * (q[:, :, t, None, :] @ S))  # [B, H, 1, dv]
    o = mx.concatenate(outs, axis=2) if outs else mx.zeros((B, H, 0, v.shape[-1]), mx.float32)
    return o, S


def _chunk_decays(g, C):
    """Decay factors for chunks of C tokens. Every exponent is g * (non-negative), so all
    factors lie in (0, 1] and strong decays underflow to 0, never overflow to inf."""
    pos = mx.arange(C, dtype=mx.float32)
    gh = g[:, None]  # [H, 1]
    q_decay = mx.exp(gh * (pos + 1))  # [H, C]  gamma^(τ+1): S_prev seen from position τ
    k_decay = mx.exp(gh * (C - 1 - pos))  # [H, C]  gamma^(C-1-σ): token σ seen from chunk end
    diff = pos[:, None] - pos[None, :]  # [C, C]  τ - σ
    intra = mx.where(diff >= 0, mx.exp(gh[:, :, None] * mx.maximum(diff, 0)), 0.0)  # [H, C, C]
    chunk_decay = mx.exp(g * C)  # [H]  gamma^C
    return q_decay, k_decay, intra, chunk_decay


def _gla_chunks(q, k, v, g, S, C):
    """Whole chunks of exactly C tokens: q already scaled, T a multiple of C, all float32."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    N = T // C
    q = q.reshape(B, H, N, C, dk)
    k = k.reshape(B, H, N, C, dk)
    v = v.reshape(B, H, N, C, dv)
    q_decay, k_decay, intra, chunk_decay = _chunk_decays(g, C)

    # Inside each chunk: causal decayed scores [B, H, N, C, C] applied to v.
    o = ((q @ k.swapaxes(-1, -2)) * intra[:, None]) @ v  # [B, H, N, C, dv]

    # Each chunk's own contribution to the state at its end.
    U = (k * k_decay[:, None, :, None]).swapaxes(-1, -2) @ v  # [B, H, N, dk, dv]

    # Carry the state across chunks: N elementwise steps over [B, H, dk, dv]. The parallel form
    # (an [N+1, N] decay matrix times all N states) costs N^2 d^2 flops and was ~5x slower on CPU.
    starts = []
    for n in range(N):
        starts.append(S)
        S = chunk_decay[:, None, None] * S + U[:, :, n]
    starts = mx.stack(starts, axis=2)  # [B, H, N, dk, dv], the state before each chunk

    o = o + (q * q_decay[:, None, :, None]) @ starts  # [B, H, N, C, dv]
    return o.reshape(B, H, T, dv), S


def gla_chunked(q, k, v, g, scale, state=None, chunk=CHUNK):
    """Chunked prefill form: batched matmuls over [B, H, chunks], state carried between chunks.

    A last partial chunk of C' < chunk tokens is processed on its own with decay factors built
    for C', so the carried state decays by gamma^C', not gamma^chunk (SPEC §8 P4).
    """
    if chunk < 1:
        raise ValueError(f"gla_chunked: expected chunk >= 1, got {chunk}")
    q, k, v, g, S = _prepare(q, k, v, g, state)
    B, H, T, _ = q.shape
    q = q * scale
    full = T - T % chunk
    step = chunk * _SEGMENT_CHUNKS
    # (start, end, chunk length): full chunks a segment at a time, then the partial chunk.
    pieces = [(s, min(s + step, full), chunk) for s in range(0, full, step)]
    if full < T:
        pieces.append((full, T, T - full))
    outs = []
    for start, end, C in pieces:
        sl = slice(start, end)
        o, S = _gla_chunks(q[:, :, sl], k[:, :, sl], v[:, :, sl], g, S, C)
        outs.append(o)
    o = mx.concatenate(outs, axis=2) if outs else mx.zeros((B, H, 0, v.shape[-1]), mx.float32)
    return o, S


def gla_parallel(q, k, v, g, scale, state=None, chunk=CHUNK, out_dtype=mx.float32):
    """GPU form of `gla_chunked`: one compiled graph per GPU_SEGMENT tokens, the tokens padded
    with zeros to whole chunks, the state carried across chunks by one matmul with an [N, N]
    decay matrix (N²·dk·dv flops: nothing for a GPU at N = 128, an 8K segment) instead of N
    steps. q, k, v are cast to float32 inside the graph, q's cast and scale one kernel. o is
    rounded once to `out_dtype` (default float32) as its last sum is written, in the layout
    [B, T, H, dv] (returned as its [B, H, T, dv] view): what the layer takes next (SPEC §3.6
    step 7), with no float32 copy between."""
    if chunk < 1:
        raise ValueError(f"gla_parallel: expected chunk >= 1, got {chunk}")
    S, g = _state(q, k, v, g, state), g.astype(mx.float32)
    fresh = state is None  # the zero state, which the first graph need not read
    dtype = dtype_name(out_dtype)  # a compile constant: the dtype's name
    T = q.shape[2]
    outs = []
    for s in range(0, T, GPU_SEGMENT):
        sl = slice(s, s + GPU_SEGMENT)
        settings = (scale, chunk, fresh and s == 0, dtype)
        o, S = _parallel(q[:, :, sl], k[:, :, sl], v[:, :, sl], g, S, settings)
        outs.append(o)
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return o.transpose(0, 2, 1, 3), S


@mx.compile
def _parallel(q, k, v, g, S, settings):
    """One segment → (o [B, T, H, dv] in the settings' dtype, the final state)."""
    scale, C, fresh, dtype = settings
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    N = -(-T // C)
    whole = N * C == T
    # Padding after the last token changes no output before it; the final state is taken from
    # the real tokens only (below), so it decays by gamma^T, never by the padded length. Whole
    # chunks (every segment but a prefill's last) are not padded: a pad is a copy. Padded in
    # the inputs' dtype, then cast to float32 (q's cast and scale one kernel).
    if not whole:
        pad = [(0, 0), (0, 0), (0, N * C - T), (0, 0)]
        q, k, v = (mx.pad(t, pad) for t in (q, k, v))
    k, v = k.astype(mx.float32), v.astype(mx.float32)
    qc = (q.astype(mx.float32) * scale).reshape(B, H, N, C, dk)
    kc = k.reshape(B, H, N, C, dk)
    vc = v.reshape(B, H, N, C, dv)
    _, k_decay, intra, _ = _chunk_decays(g, C)
    o = ((qc @ kc.swapaxes(-1, -2)) * intra[:, None]) @ vc  # [B, H, N, C, dv]
    U = (kc * k_decay[:, None, :, None]).swapaxes(-1, -2) @ vc  # [B, H, N, dk, dv]
    # The chunks' part of the state before chunk n: Σ_{m<n} gamma^((n-1-m)C) U_m (exponents
    # ≤ 0; S's part is read separately below).
    n = mx.arange(N, dtype=mx.float32)
    lag = n[:, None] - 1 - n[None, :]  # [N, N]
    carry = mx.where(lag >= 0, mx.exp(g[:, None, None] * C * mx.maximum(lag, 0)), 0.0)
    states = (carry @ U.reshape(B, H, N, dk * dv)).reshape(B, H, N, dk, dv)

    # Token t (chunk t // C) reads that state decayed by gamma^(t mod C + 1), and S decayed by
    # gamma^(t + 1): the decays scale the products inside the one kernel that sums o and
    # rounds it, which reads its parts transposed and so writes o as [B, T, H, dv].
    def tokens(x):  # [B, H, N, C, ·] or [B, H, N·C, ·] → the real tokens' [B, T, H, ·] view
        return x.reshape(B, H, N * C, -1)[:, :, :T].transpose(0, 2, 1, 3)

    t = mx.arange(T, dtype=mx.float32)[:, None, None]  # [T, 1, 1], against g [H, 1]
    o = tokens(o) + mx.exp(g[:, None] * (t % C + 1)) * tokens(qc @ states)
    if not fresh:
        o = o + mx.exp(g[:, None] * (t + 1)) * tokens(qc.reshape(B, H, N * C, dk) @ S)  # q_t · S
    o = o.astype(getattr(mx, dtype))
    # The final state: the last chunk's start state carried over its C' real tokens, their own
    # part, and gamma^T S (C' and T enter through `arange` only, as above). Whole chunks have
    # that part already (U's last); a padded one sums its real tokens, its pads being zeros.
    left = mx.arange(T - (N - 1) * C - 1, T - N * C - 1, -1, dtype=mx.float32)  # C' - 1 - σ
    if whole:
        own = U[:, :, -1]
    else:
        decayed = kc[:, :, -1] * mx.exp(g[:, None] * mx.maximum(left, 0))[..., None]
        own = decayed.swapaxes(-1, -2) @ vc[:, :, -1]  # [B, H, dk, dv]
    end = mx.exp(g * (left[0] + 1))[:, None, None] * states[:, :, -1] + own
    if fresh:
        return o, end
    return o, end + mx.exp(g * (t[-1, 0, 0] + 1))[:, None, None] * S


# Compiled so the decay, the outer product and the add make one pass over the state (decode is
# memory-bound: about 1.7x faster on CPU at B = 8). Retraces once per shape and scale.
@mx.compile
def _advance(k, v, g, S):
    """The state after one token k, v [B, H, 1, d]: the update of every form fed token by token
    (decode, verify passes, rollbacks), so they agree to the bit."""
    return mx.exp(g)[:, None, None] * S + k.swapaxes(-1, -2) * v  # [B, H, dk, 1] * [B, H, 1, dv]


@mx.compile
def _step(q, k, v, g, S, scale):
    S = _advance(k, v, g, S)
    return (scale * q) @ S, S  # [B, H, 1, dv]


def gla_step(q, k, v, g, scale, state=None):
    """One-token decode (T == 1): one state update and one read-out; on the CPU the native
    kernel that verify passes run (`gla_stepwise`), so the two agree to the bit."""
    q, k, v, g, S = _prepare(q, k, v, g, state)
    if q.shape[2] != 1:
        raise ValueError(f"gla_step: expected T == 1, got q {q.shape}")
    if _native_steps():
        o, states = native.gla_steps(q, k, v, mx.exp(g), S, scale)
        return o, states[:, 0]
    return _step(q, k, v, g, S, scale)


def gla_stepwise(q, k, v, g, scale, state=None):
    """T tokens with the arithmetic of T decode steps (`gla_step` each), for a verify pass over
    a few drafted tokens that must give what decoding them one by one gives. → (o, the state
    after each token [B, T, H, dk, dv]: the last is the final state). On the CPU one native
    primitive (`native.gla_steps`, ~1 µs a token); elsewhere, or without the native module,
    the states by `_step`'s update token by token (one compiled function) and each token's
    output by `_step`'s one-row product with its state (one batched product)."""
    q, k, v, g, S = _prepare(q, k, v, g, state)
    if _native_steps():
        return native.gla_steps(q, k, v, mx.exp(g), S, scale)
    states = _states(k, v, g, S)  # [B, T, H, dk, dv]
    o = (scale * q).transpose(0, 2, 1, 3)[..., None, :] @ states  # [B, T, H, 1, dv]
    return o[..., 0, :].transpose(0, 2, 1, 3), states


@mx.compile
def _states(k, v, g, S):
    """The state after each of the tokens k, v [B, H, T, d] from S (`_advance` token by
    token): a kernel a token, reading k and v in place (T calls of `_step` sliced and copied
    them, ~10 kernels more a layer)."""
    out = []
    for t in range(k.shape[2]):
        S = _advance(k[:, :, t : t + 1], v[:, :, t : t + 1], g, S)
        out.append(S)
    return mx.stack(out, axis=1)


@mx.compile
def gla_replay(k, v, g, state, keep):
    """The state after the first keep[b] of the T tokens k, v [B, H, T, d] (float32) fed to row
    b from `state`: `_advance` token by token, a row keeping its state once past its count
    (keep [B] int32). Rolls a recurrence back to any point of a verify pass; one compiled graph
    per T and batch size."""
    S = state
    for t in range(k.shape[2]):
        at = slice(t, t + 1)
        S = mx.where((keep > t)[:, None, None, None], _advance(k[:, :, at], v[:, :, at], g, S), S)
    return S


def _native_steps() -> bool:
    """Token-by-token forms run the native kernel: the CPU path, the module built."""
    return not on_gpu() and native.missing() is None


def gla_step_decayed(q, k, v, decay, state):
    """The decode step inside a compiled model step, where every op is a kernel: q already
    scaled, decay = exp(g) [H] given, state [B, H, dk, dv] float32 (not None)."""
    S = decay[:, None, None] * state + k.astype(mx.float32).swapaxes(-1, -2) * v.astype(mx.float32)
    return q.astype(mx.float32) @ S, S  # [B, H, 1, dv]


def gla(q, k, v, g, scale, state=None, out_dtype=mx.float32):
    """The dispatcher the model calls: decode step for T == 1; otherwise on the GPU path the
    CUDA kernels where they are on and take the shapes (`gla_cuda`: each chunk's own state, a
    scan of the state across the chunks, each chunk's outputs), else the one-graph parallel
    form; the chunked form on the CPU. o is rounded once to `out_dtype`, and where that is a
    cast it is written in the order [B, T, H, dv] that the layer reads next (returned as its
    [B, H, T, dv] view): the GPU forms as they sum o, the others after."""
    if q.shape[2] != 1 and on_gpu():
        if gla_cuda.available() and gla_cuda.supports(q, k, v):
            return gla_cuda.gla(q, k, v, g, scale, state, out_dtype)
        return gla_parallel(q, k, v, g, scale, state, out_dtype=out_dtype)
    form = gla_step if q.shape[2] == 1 else gla_chunked
    o, state = form(q, k, v, g, scale, state)
    return o.swapaxes(1, 2).astype(out_dtype).swapaxes(1, 2), state
