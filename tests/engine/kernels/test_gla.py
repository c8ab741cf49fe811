"""Simple-GLA kernels: every fast form against the float32 token loop, outputs and final state,
on lengths around the chunk boundary, with zero and non-zero initial states."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from salabatch.engine.kernels import gla as gla_module
from salabatch.engine.kernels import native
from salabatch.engine.kernels.gla import (
    decay_slopes,
    gla,
    gla_chunked,
    gla_recurrent_ref,
    gla_replay,
    gla_step,
    gla_stepwise,
)

# Relative RMS error, ||got - want|| / ||want||.
F32_RTOL = 1e-5  # float32 forms against the float32 reference (measured <= 2e-6)
BF16_RTOL = 2e-2  # bf16-rounded inputs against the same inputs in float32

B, H = 2, 4
SLOPES_32 = decay_slopes(32)
# Strongest to weakest decay of the 9B's 32 heads: gamma 0.43, 0.78, 0.94, 0.996.
G4 = -mx.array([SLOPES_32[h] for h in (0, 7, 15, 31)], dtype=mx.float32)


def rel_rms(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.sqrt(mx.mean((got - want) ** 2)) / mx.sqrt(mx.mean(want**2))).item()


def make_inputs(T, dk=16, dv=16, heads=H, with_state=True, seed=0):
    """q, k, v [B, heads, T, d] and an initial state [B, heads, dk, dv] (or None)."""
    keys = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((B, heads, T, dk), key=keys[0])
    k = mx.random.normal((B, heads, T, dk), key=keys[1]) / math.sqrt(dk)
    v = mx.random.normal((B, heads, T, dv), key=keys[2])
    state = mx.random.normal((B, heads, dk, dv), key=keys[3]) if with_state else None
    return q, k, v, state


def assert_close(got, want, tol, what):
    err = rel_rms(got, want)
    assert err <= tol, f"{what}: relative RMS error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("dk,dv", [(16, 16), (16, 24)])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 100, 500])
def test_chunked_matches_reference(T, dk, dv, with_state):
    # T = 65, 100, 500 end in a partial chunk: a state over-decayed by gamma^(64 - C') (P4) fails.
    q, k, v, state = make_inputs(T, dk, dv, with_state=with_state)
    scale = dk**-0.5
    o_ref, s_ref = gla_recurrent_ref(q, k, v, G4, scale, state)
    o, s = gla_chunked(q, k, v, G4, scale, state)
    assert o.shape == (B, H, T, dv) and o.dtype == mx.float32
    assert s.shape == (B, H, dk, dv) and s.dtype == mx.float32
    assert_close(o, o_ref, F32_RTOL, "output")
    assert_close(s, s_ref, F32_RTOL, "final state")


def test_all_32_head_decays():
    q, k, v, state = make_inputs(130, dk=8, dv=8, heads=32)
    g = -mx.array(SLOPES_32, dtype=mx.float32)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, g, 0.3, state)
    o, s = gla_chunked(q, k, v, g, 0.3, state)
    assert_close(o, o_ref, F32_RTOL, "output")
    assert_close(s, s_ref, F32_RTOL, "final state")


def test_step_repeated_matches_reference():
    T = 70
    q, k, v, state = make_inputs(T, 16, 24)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, G4, 0.25, state)
    outs, s = [], state
    for t in range(T):
        o_t, s = gla_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], G4, 0.25, s)
        outs.append(o_t)
    assert_close(mx.concatenate(outs, axis=2), o_ref, F32_RTOL, "output")
    assert_close(s, s_ref, F32_RTOL, "final state")


@pytest.mark.parametrize("path", ["native", "mlx-ops"])
@pytest.mark.parametrize("T", [1, 5, 9])
def test_token_by_token_forms_match_the_reference_and_each_other(T, path, monkeypatch):
    """`gla_stepwise` (a verify pass) against the reference, and to the bit against `gla_step`
    fed its tokens one by one (decoding them): on the CPU's native kernel and on the MLX-op form
    (the GPU path, a CPU without the module). Either way the states are `_advance`'s, which a
    rollback's replay (`gla_replay`) uses."""
    if path == "native" and native.missing() is not None:
        pytest.skip(str(native.missing()))
    if path == "mlx-ops":
        monkeypatch.setattr(gla_module, "_native_steps", lambda: False)
    q, k, v, state = make_inputs(T, 16, 24)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, G4, 0.25, state)
    o, states = gla_stepwise(q, k, v, G4, 0.25, state)
    assert o.shape == (B, H, T, 24) and states.shape == (B, T, H, 16, 24)
    assert_close(o, o_ref, F32_RTOL, "output")
    assert_close(states[:, -1], s_ref, F32_RTOL, "final state")
    outs, s = [], state
    for t in range(T):
        o_t, s = gla_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], G4, 0.25, s)
        assert mx.array_equal(s, states[:, t]).item(), f"state after token {t}"
        outs.append(o_t)
    assert mx.array_equal(mx.concatenate(outs, axis=2), o).item()
    keep = mx.array([T, max(T - 2, 0)], dtype=mx.int32)  # rows rolled back to different points
    replayed = gla_replay(k, v, G4, state, keep)
    for b, n in enumerate(keep.tolist()):
        want = states[b, n - 1] if n else state[b]
        assert mx.array_equal(replayed[b], want).item(), f"row {b} replayed over {n} tokens"


def test_native_steps_do_not_depend_on_the_thread_count():
    if native.missing() is not None:
        pytest.skip(str(native.missing()))
    q, k, v, state = make_inputs(5, 64, 64, heads=8)  # states over the size split between threads
    gamma = mx.exp(mx.repeat(G4, 2))
    one = native.gla_steps(q, k, v, gamma, state, 0.1, n_threads=1)
    for n in (2, 3):
        many = native.gla_steps(q, k, v, gamma, state, 0.1, n_threads=n)
        assert all(mx.array_equal(a, b).item() for a, b in zip(one, many, strict=True))


def test_dispatcher_matches_reference():
    q, k, v, state = make_inputs(65)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, G4, 0.25, state)
    o, s = gla(q, k, v, G4, 0.25, state)  # chunked
    assert_close(o, o_ref, F32_RTOL, "prefill output")
    o1_ref, s1_ref = gla_recurrent_ref(q[:, :, :1], k[:, :, :1], v[:, :, :1], G4, 0.25, s)
    o1, s1 = gla(q[:, :, :1], k[:, :, :1], v[:, :, :1], G4, 0.25, s)  # decode step
    assert_close(o1, o1_ref, F32_RTOL, "decode output")
    assert_close(s1, s1_ref, F32_RTOL, "decode state")


def test_chunked_in_pieces_matches_one_call():
    # Every piece but the 64 ends in a partial chunk; the carried state must stay exact.
    q, k, v, state = make_inputs(500)
    o_one, s_one = gla_chunked(q, k, v, G4, 0.25, state)
    outs, s, start = [], state, 0
    for n in (7, 64, 100, 329):
        sl = slice(start, start + n)
        o, s = gla_chunked(q[:, :, sl], k[:, :, sl], v[:, :, sl], G4, 0.25, s)
        outs.append(o)
        start += n
    assert_close(mx.concatenate(outs, axis=2), o_one, F32_RTOL, "output")
    assert_close(s, s_one, F32_RTOL, "final state")


@pytest.mark.parametrize("chunk", [1, 4, 16, 32, 128])
def test_chunk_size_does_not_change_result(chunk):
    # chunk = 4 over 501 tokens: 125 full chunks in 4 segments, then a 1-token chunk.
    q, k, v, state = make_inputs(501)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, G4, 0.25, state)
    o, s = gla_chunked(q, k, v, G4, 0.25, state, chunk=chunk)
    assert_close(o, o_ref, F32_RTOL, "output")
    assert_close(s, s_ref, F32_RTOL, "final state")


def test_strong_decay_underflows_without_nan():
    # gamma = e^-30: gamma^63 underflows to 0 in float32; it must never meet an inf.
    q, k, v, state = make_inputs(100)
    g = mx.array([-30.0, -5.0, -1e-6, 0.0], dtype=mx.float32)
    o_ref, s_ref = gla_recurrent_ref(q, k, v, g, 0.25, state)
    o, s = gla_chunked(q, k, v, g, 0.25, state)
    assert not mx.any(mx.isnan(o)).item() and not mx.any(mx.isnan(s)).item()
    assert_close(o, o_ref, F32_RTOL, "output")
    assert_close(s, s_ref, F32_RTOL, "final state")


@pytest.mark.parametrize("fn,T", [(gla_chunked, 65), (gla_step, 1), (gla_recurrent_ref, 9)])
def test_bf16_inputs_give_float32(fn, T):
    q, k, v, state = make_inputs(T)
    lo = [x.astype(mx.bfloat16) for x in (q, k, v)]
    o16, s16 = fn(*lo, G4, 0.25, state)
    assert o16.dtype == mx.float32 and s16.dtype == mx.float32
    # Cast first, compute in float32: identical to upcasting the bf16 values ourselves.
    o_up, s_up = fn(*(x.astype(mx.float32) for x in lo), G4, 0.25, state)
    assert_close(o16, o_up, F32_RTOL, "bf16 vs upcast output")
    assert_close(s16, s_up, F32_RTOL, "bf16 vs upcast state")
    o32, s32 = fn(q, k, v, G4, 0.25, state)
    assert_close(o16, o32, BF16_RTOL, "bf16 vs float32 output")
    assert_close(s16, s32, BF16_RTOL, "bf16 vs float32 state")


def test_tolerance_detects_p4_overdecay():
    # SPEC P4: zero-padding the last chunk to 64 and decaying by gamma^64 leaves the state
    # over-decayed by exactly gamma^(64 - C'). Our tolerance must see that, and we must not do it.
    T = 65  # C' = 1
    q, k, v, state = make_inputs(T)
    _, s_ref = gla_recurrent_ref(q, k, v, G4, 0.25, state)
    _, s = gla_chunked(q, k, v, G4, 0.25, state)
    s_p4 = mx.exp(G4 * (64 - 1))[:, None, None] * s_ref
    assert rel_rms(s_p4, s_ref) > 100 * F32_RTOL
    assert_close(s, s_ref, F32_RTOL, "final state")


def test_decay_slopes_32_heads():
    s = decay_slopes(32)
    assert len(s) == 32
    for h, want in [(0, 0.840896), (3, 0.5), (7, 0.25), (15, 0.0625), (31, 0.00390625)]:
        assert s[h] == pytest.approx(want, rel=1e-6)
    assert s == pytest.approx([2 ** (-(h + 1) / 4) for h in range(32)], rel=1e-12)
    gamma = [math.exp(-x) for x in s]
    assert gamma[0] == pytest.approx(0.431324, rel=1e-6)
    assert gamma[31] == pytest.approx(0.996101, rel=1e-6)


@pytest.mark.parametrize(
    "n,want",
    [
        (1, [2**-8]),
        (8, [2**-h for h in range(1, 9)]),
        # 4-head schedule 2^-2, 2^-4, 2^-6, 2^-8; then 8-head schedule 2^-1 .. 2^-8, every other.
        (6, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]),
        # 8-head schedule; then 16-head schedule 2^-0.5 .. 2^-8, every other (2^-0.5, 2^-1.5, ..).
        (12, [2**-h for h in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]),
    ],
)
def test_decay_slopes_alibi_rule(n, want):
    assert decay_slopes(n) == pytest.approx(want, rel=1e-12)


def test_bad_shapes_are_rejected():
    q, k, v, state = make_inputs(3)
    with pytest.raises(ValueError, match="T == 1"):
        gla_step(q, k, v, G4, 0.25, state)
    with pytest.raises(ValueError, match="state"):
        gla_chunked(q, k, v, G4, 0.25, state[:, :, :8])
    with pytest.raises(ValueError, match="g"):
        gla_chunked(q, k, v, G4[:2], 0.25, state)
