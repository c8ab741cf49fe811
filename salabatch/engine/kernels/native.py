"""salabatch's native CPU kernels: MLX primitives in C++ (salabatch/engine/native), built on
the machine that runs them by `scripts/build-native.sh` (`make install` runs it).

They are a fast path only: every one has an MLX-op form that computes the same thing, is its
reference in the tests, and is what runs wherever the module is not built or the device is a
GPU. `missing()` says why the module cannot be used here (None when it can).

The kernels split their work over `threads()` threads (MLX runs a CPU op on one); the results
do not depend on the count."""

from __future__ import annotations

import functools

import mlx.core as mx

try:
    from salabatch.engine.kernels import _native
except ImportError as error:  # not built (no compiler at install time) or built for another MLX
    _native = None
    _WHY = f"the native kernels did not load ({error}); build them with `make install`"
else:
    _WHY = None
    if _native.mlx_version != mx.__version__:  # MLX's C++ ABI is not stable across versions
        _WHY = (
            f"the native kernels were built for MLX {_native.mlx_version}, this is "
            f"{mx.__version__}: rebuild them with `make install`"
        )


def missing() -> str | None:
    return _WHY


def split_floats() -> int:
    """Weights of at least this many floats are split between the threads by `rows_matmul`."""
    return _native.split_floats


@functools.cache
def threads() -> int:
    """How many threads the kernels split their work over: `blas.default_threads()`."""
    from salabatch.engine.blas import default_threads

    return default_threads()


def sparse_decode_step(
    q: mx.array,
    pos: mx.array,
    c1: tuple[mx.array, ...],
    c2: tuple[mx.array, ...],
    shared: tuple[mx.array, ...],
    rows_k: mx.array,
    rows_v: mx.array,
    *,
    compression: tuple[tuple[int, int], tuple[int, int]],
    stream: mx.Stream,
    n_threads: int | None = None,
    queries: int = 1,
    **settings,
) -> tuple[mx.array, mx.array]:
    """`sparse_decode._step` as one primitive on a CPU stream (float32): (o, idx). `settings`:
    start, prefill_len, k, scale, init_blocks, local_blocks, block (as the C++ names them);
    `n_threads` defaults to `threads()`; `queries` rows of q (and pos) per row of the keys
    and the rows' compressed chunks (a verify pass's positions of one row)."""
    (_, stride1), (_, stride2) = compression
    o, idx = _native.sparse_decode_step(
        q, pos, list(c1), list(c2), list(shared), rows_k, rows_v,
        stride1=stride1, stride2=stride2, threads=n_threads or threads(), dense=False,
        queries=queries, stream=stream, **settings,
    )  # fmt: skip
    return o, idx


def dense_decode_step(
    q: mx.array,
    pos: mx.array,
    shared: tuple[mx.array, ...],
    rows_k: mx.array,
    rows_v: mx.array,
    *,
    start: int,
    blocks: int,
    scale: float,
    block: int,
    stream: mx.Stream,
    n_threads: int | None = None,
    queries: int = 1,
) -> mx.array:
    """Dense attention of one query per row, each over every key up to its position `pos[b]`,
    as the sparse step with every one of its blocks selected (no stage 1): o [B, H, 1, d].
    `blocks` ≥ the longest row's block count; `queries` as in `sparse_decode_step`."""
    o, _ = _native.sparse_decode_step(
        q, pos, [], [], list(shared), rows_k, rows_v,
        start=start, prefill_len=0, k=blocks, scale=scale, init_blocks=0, local_blocks=0,
        block=block, stride1=block, stride2=block, threads=n_threads or threads(), dense=True,
        queries=queries, stream=stream,
    )  # fmt: skip
    return o


def rows_matmul(x: mx.array, w: mx.array, n_threads: int | None = None) -> mx.array:
    """x [M, K] · w [O, K]ᵀ → [M, O] (float32, K a multiple of 8) as one primitive on the
    default CPU stream, on `n_threads` (default `threads()`); differentiable."""
    stream = mx.default_stream(mx.default_device())
    return _native.rows_matmul(x, w, threads=n_threads or threads(), stream=stream)


def gate(z: mx.array, x: mx.array, *, silu: bool, n_threads: int | None = None) -> mx.array:
    """x·σ(z), or silu(z)·x with `silu`, as one primitive on the default CPU stream (float32, z
    and x of one shape); differentiable."""
    stream = mx.default_stream(mx.default_device())
    return _native.gate(z, x, silu=silu, threads=n_threads or threads(), stream=stream)


def gla_steps(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    gamma: mx.array,
    state: mx.array,
    scale: float,
    n_threads: int | None = None,
) -> tuple[mx.array, mx.array]:
    """A lightning recurrence fed token by token (the decode step, a verify pass) as one
    primitive on the default CPU stream: q, k [B, H, T, dk], v [B, H, T, dv], gamma = exp(g)
    [H], state [B, H, dk, dv], float32 → (o [B, H, T, dv], the state after every token
    [B, T, H, dk, dv]). The state's update rounds as `kernels.gla`'s MLX ops do; the read-out
    sums over dk in order."""
    stream = mx.default_stream(mx.default_device())
    o, states = _native.gla_steps(
        q, k, v, gamma, state, scale=scale, threads=n_threads or threads(), stream=stream
    )
    return o, states
