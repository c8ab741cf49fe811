"""The emulator's own checks of CUDA's alignment rules (`cuda_emu.h`): a kernel source that a GPU
would fault on, or read wrong, raises here; the same source with its memory where the rules want
it runs and gives the product. The kernels' emulated tests count on these checks."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from tests.engine.kernels import cuda_emu

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ with C++20")

# One warp: a 16×16 tile of `a` (bf16, row stride LDM elements, from shared memory at byte
# OFFSET) times the identity, stored as float32 to `out`.
SOURCE = """
    using namespace nvcuda;
    extern __shared__ __align__(ALIGN) unsigned char smem[];
    T* tile = reinterpret_cast<T*>(smem + OFFSET);
    for (int i = threadIdx.x; i < 16 * LDM; i += 32) {
        tile[i] = i % LDM < 16 ? a[(i / LDM) * 16 + i % LDM] : static_cast<T>(0.0f);
    }
    T* eye = reinterpret_cast<T*>(smem + OFFSET + 16 * LDM * sizeof(T) + 64);
    for (int i = threadIdx.x; i < 256; i += 32) {
        eye[i] = static_cast<T>(i / 16 == i % 16 ? 1.0f : 0.0f);
    }
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> x;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> e;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> y;
    wmma::fill_fragment(y, 0.0f);
    wmma::load_matrix_sync(x, tile, LDM);
    wmma::load_matrix_sync(e, eye, 16);
    wmma::mma_sync(y, x, e, y);
    wmma::store_matrix_sync(out, y, 16, wmma::mem_row_major);
"""


def run_tile(offset: int, ldm: int, align: int = 32) -> np.ndarray:
    a = np.arange(256, dtype=np.float32).reshape(16, 16)
    source = SOURCE.replace("ALIGN", str(align))
    return cuda_emu.run(
        source, [("a", "bf16", cuda_emu.to_numpy(mx.array(a), "bf16"))], ("out", "f32", (16, 16)),
        [("T", "bf16"), ("OFFSET", offset), ("LDM", ldm)],
        blocks=1, threads=32, shared_bytes=offset + 16 * ldm * 2 + 64 + 512,
    )  # fmt: skip


def test_a_tile_where_the_rules_want_it_gives_the_product():
    got = run_tile(offset=64, ldm=24)  # 48-byte rows: a multiple of 16 bytes
    np.testing.assert_array_equal(got, np.arange(256, dtype=np.float32).reshape(16, 16))


def test_a_tile_off_a_32_byte_address_is_a_fault():
    with pytest.raises(cuda_emu.EmulatedFault, match="not 32-byte aligned"):
        run_tile(offset=48, ldm=24)


def test_a_row_stride_off_16_bytes_is_a_fault():
    with pytest.raises(cuda_emu.EmulatedFault, match="not a multiple of 16 bytes"):
        run_tile(offset=64, ldm=20)  # 40-byte rows


def test_shared_memory_is_only_as_aligned_as_declared():
    """A kernel declaring 16 bytes and reading a tile at its base counts on more than CUDA
    promises: the emulator's base is 16 bytes off 32."""
    with pytest.raises(cuda_emu.EmulatedFault, match="not 32-byte aligned"):
        run_tile(offset=0, ldm=16, align=16)
    run_tile(offset=0, ldm=16, align=32)


# A thread block of 64: each thread writes its value to shared memory, then reads its
# neighbour's (across the warps at the ends); BARRIER is __syncthreads() or nothing.
NEIGHBOUR = """
    extern __shared__ __align__(16) unsigned char smem[];
    float* mine = reinterpret_cast<float*>(smem);
    const int t = threadIdx.x;
    mine[t] = x[t];
    BARRIER
    out[t] = mine[(t + 1) % 64] + mine[(t + 63) % 64];
"""


def run_neighbours(barrier: str) -> np.ndarray:
    x = np.arange(64, dtype=np.float32)
    return cuda_emu.run(
        NEIGHBOUR.replace("BARRIER", barrier), [("x", "f32", x)], ("out", "f32", (64,)), [],
        blocks=2, threads=64, shared_bytes=64 * 4,
    )  # fmt: skip


def test_threads_read_what_others_wrote_only_after_a_barrier():
    """Without the barrier some thread reads a neighbour's slot before the neighbour writes
    it (shared memory starts as NaN), as on a GPU; with it every sum is right. So too where
    each thread reads only a lower thread's slot (in order of index, each would find it
    written)."""
    fibers = not os.environ.get("CUDA_EMU_SANITIZE")  # OS threads race: no order is certain
    want = (np.arange(64) + 1) % 64 + (np.arange(64) + 63) % 64
    np.testing.assert_array_equal(run_neighbours("__syncthreads();"), want)
    assert np.isnan(run_neighbours("")).any() or not fibers
    lower = NEIGHBOUR.replace("mine[(t + 1) % 64] + mine[(t + 63) % 64]", "mine[t > 0 ? t - 1 : 0]")
    x = np.arange(64, dtype=np.float32)
    for barrier in ("__syncthreads();", ""):
        got = cuda_emu.run(
            lower.replace("BARRIER", barrier), [("x", "f32", x)], ("out", "f32", (64,)), [],
            blocks=2, threads=64, shared_bytes=64 * 4,
        )  # fmt: skip
        if barrier:
            np.testing.assert_array_equal(got, np.maximum(np.arange(64) - 1, 0))
        else:
            assert np.isnan(got).any() or not fibers


@pytest.mark.skipif(
    bool(os.environ.get("CUDA_EMU_SANITIZE")),
    reason="sanitized, a CUDA thread is an OS thread: it hangs",
)
def test_a_barrier_some_threads_never_reach_is_a_fault():
    """Thread 0 returns before the block's barrier: the others wait for it, forever on a GPU;
    here the launch raises."""
    with pytest.raises(cuda_emu.EmulatedFault, match="a barrier some of its threads never reach"):
        run_neighbours("if (t == 0) return; __syncthreads();")
