"""A CUDA kernel's source, as `mx.fast.cuda_kernel` would compile it, built for the CPU against
`cuda_emu.h` (a CUDA thread a fiber, barriers and shuffles kept, WMMA as whole matrices)
and run on numpy arrays: the kernel's own indexing, synchronisation and arithmetic checked on a
machine without a GPU. Inputs and outputs start at 256-byte addresses, as MLX's CUDA allocations
do: MLX passes a row-contiguous view with an offset as it is, so the engine's wrappers give the
kernels whole buffers, or copies. Slow (a thread block at a time); for small shapes only."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).parent
CXX = shutil.which("g++")
TYPES = {"bf16": "__nv_bfloat16", "f32": "float", "i32": "int32_t"}
NUMPY = {"bf16": np.uint16, "f32": np.float32, "i32": np.int32}
_BUILT: dict[str, ctypes.CDLL] = {}
# a kernel's dynamic shared memory, and the alignment it declares
SHARED = re.compile(r"extern __shared__ (?:__align__\((\d+)\) )?unsigned char smem\[\];")


class EmulatedFault(AssertionError):
    """A kernel did what a GPU would fault on or misread (`cuda_emu.h`'s checks)."""


def available() -> bool:
    """Whether this machine has what the emulator needs: g++ with C++20's <barrier> (a probe
    that leaves the emulator itself out, so that an error in it fails the tests)."""
    if CXX is None:
        return False
    try:
        _build('#include <barrier>\nextern "C" int probe() { std::barrier<> b(1); return 1; }\n')
    except RuntimeError:
        return False
    return True


def to_numpy(a: mx.array, kind: str) -> np.ndarray:
    """An MLX array as the kernel reads it (bfloat16 as its bits)."""
    if kind == "bf16":
        return np.ascontiguousarray(np.array(a.astype(mx.bfloat16).view(mx.uint16)))
    return np.ascontiguousarray(np.array(a), dtype=NUMPY[kind])


def from_numpy(a: np.ndarray, kind: str) -> mx.array:
    return mx.array(a).view(mx.bfloat16) if kind == "bf16" else mx.array(a)


def run(source, inputs, output, template, *, blocks, threads, shared_bytes, header=""):
    """inputs: [(name, kind, numpy array)]; output: (name, kind, shape) → the output array, or
    a list of them → the output arrays. template: [(name, kind or int)] as `cuda_kernel` takes
    them (dtype names as in TYPES); header: `cuda_kernel`'s (its CUDA includes left out: the
    emulator stands in for them)."""
    outputs = output if isinstance(output, list) else [output]
    params = [f"const {TYPES[k]}* {n}" for n, k, _ in inputs]
    params += [f"{TYPES[k]}* {n}" for n, k, _ in outputs]
    constants = "".join(
        f"  using {k} = {TYPES[v]};\n" if v in TYPES else f"  constexpr int {k} = {v};\n"
        for k, v in template
    )
    declared = SHARED.search(source)
    align = int(declared[1]) if declared and declared[1] else 16  # a GPU's base has at least
    body = SHARED.sub("unsigned char* smem = emu::shared();", source)
    casts = [f"(const {TYPES[k]}*)args[{i}]" for i, (_, k, _) in enumerate(inputs)]
    casts += [f"({TYPES[k]}*)args[{len(inputs) + i}]" for i, (_, k, _) in enumerate(outputs)]
    unit = (
        f'#include "{HERE / "cuda_emu.h"}"\n' + re.sub(r"#include <[^>]+>", "", header) + "\n"
        "namespace mlx::core::cu {\n"
        f"void kernel({', '.join(params)}) {{\n{constants}{body}\n}}\n"
        "}\n"
        'extern "C" const char* run(void** args, int blocks, int threads, int shared) {\n'
        "  emu::failed.clear();\n"
        f"  emu::launch(blocks, threads, shared, {align}, [&] {{\n"
        f"    mlx::core::cu::kernel({', '.join(casts)});\n"
        "  });\n"
        "  return emu::failed.c_str();\n}\n"
        'extern "C" void poison(unsigned char* p, long n, int on) { emu::poison(p, n, on); }\n'
    )
    lib = _build(unit)
    placed = [_aligned(np.asarray(a, dtype=NUMPY[k])) for _, k, a in inputs]
    placed += [_aligned(_garbage(shape, k)) for _, k, shape in outputs]
    ptrs = (ctypes.c_void_p * len(placed))(*[a.ctypes.data for a, _ in placed])
    lib.run.restype = ctypes.c_char_p
    lib.poison.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    margins = [m for _, around in placed for m in around]
    for at, n in margins:  # the bytes around each array out of bounds for AddressSanitizer
        lib.poison(at, n, 1)
    try:
        failed = lib.run(ptrs, blocks, threads, shared_bytes)
    finally:
        for at, n in margins:
            lib.poison(at, n, 0)
    if failed:
        raise EmulatedFault(f"the kernel broke a CUDA rule a GPU enforces: {failed.decode()}")
    outs = [a for a, _ in placed[len(inputs) :]]
    return outs if isinstance(output, list) else outs[0]


def _aligned(a: np.ndarray, to: int = 256) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A contiguous copy of `a` starting at an address of `to` bytes, as a CUDA allocation
    does (numpy's own start at 16), and the (address, bytes) of its buffer's parts before and
    after it."""
    raw = np.empty(a.nbytes + to, dtype=np.uint8)
    skip = -raw.ctypes.data % to
    out = raw[skip : skip + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    around = ((raw.ctypes.data, skip), (out.ctypes.data + a.nbytes, to - skip))
    return out, [(at, n) for at, n in around if n]


def _garbage(shape: tuple, kind: str) -> np.ndarray:
    """An output as MLX's allocator hands it over, unwritten: NaN for floats (so that an
    element the kernel leaves shows, even times zero), a huge number for int32 (no index)."""
    fill = {"bf16": 0xFFFF, "f32": np.float32(np.nan), "i32": 0x5A5A5A5A}[kind]
    return np.full(shape, fill, dtype=NUMPY[kind])


def _build(unit: str) -> ctypes.CDLL:
    key = hashlib.sha256((unit + os.environ.get("CUDA_EMU_SANITIZE", "")).encode()).hexdigest()[:16]
    if key not in _BUILT:
        folder = Path(tempfile.mkdtemp(prefix="cuda-emu-"))
        (folder / "k.cpp").write_text(unit)
        lib = folder / "k.so"
        # CUDA_EMU_SANITIZE=thread: built with ThreadSanitizer, which reports a kernel's data
        # races (a barrier missing) as races between the emulated threads; =address,undefined:
        # AddressSanitizer (a read or write past an input, an output or the shared memory) and
        # UBSan (a misaligned 16-byte load among others). Run python with LD_PRELOAD of libtsan
        # or libasan (and ASAN_OPTIONS=detect_leaks=0); slow, by hand, not in `make test`.
        sanitize = os.environ.get("CUDA_EMU_SANITIZE")
        flags = [f"-fsanitize={sanitize}", "-g"] if sanitize else []
        done = subprocess.run(
            # -fno-strict-aliasing: kernels read a 16-byte load's elements through a pointer
            # of their type, as CUDA code does (nvcc keeps it; g++ -O2 may not)
            [CXX, "-std=c++20", "-O2", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread",
             *flags, "-o", str(lib), str(folder / "k.cpp")],
            capture_output=True, text=True,
        )  # fmt: skip
        try:
            if done.returncode:
                raise RuntimeError(f"the emulated kernel did not build:\n{done.stderr[-4000:]}")
            _BUILT[key] = ctypes.CDLL(str(lib))
        finally:
            # the loaded library stays mapped: its folder goes now (a run left one a kernel in
            # the temp dir), kept when sanitized, for the reports' source lines
            if not sanitize:
                shutil.rmtree(folder, ignore_errors=True)
    return _BUILT[key]


KINDS = {mx.bfloat16: "bf16", mx.float32: "f32", mx.int32: "i32"}


@contextmanager
def emulated_kernels(monkeypatch, *modules):
    """Within the block, `modules`' kernels (stage2_cuda, decode_cuda, ...) are switched on and
    run here through `cuda_kernel`, the GPU path's branches taken: the engine's dispatchers and
    wrappers run as on CUDA. Yields the names of the kernels launched, in order."""
    launched: list[str] = []

    def made(name, *args, **kwargs):
        kernel = cuda_kernel(name, *args, **kwargs)

        def launch(**options):
            launched.append(name)
            return kernel(**options)

        return launch

    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    monkeypatch.setattr(mx.fast, "cuda_kernel", made, raising=False)
    for module in modules:
        monkeypatch.setattr(module, "available", lambda: True)
        module._kernel.cache_clear()
    try:
        yield launched
    finally:
        for module in modules:
            module._kernel.cache_clear()  # no emulated kernel object outlives the block


def cuda_kernel(name, input_names, output_names, source, header="", **options):
    """Stands in for `mx.fast.cuda_kernel` off CUDA: the kernel object it returns runs the
    source here (`run`) on its inputs, evaluated, as MLX would launch it (grid in threads,
    template arguments as constants, the shared memory asked for): what the engine's Python
    wrappers pass their kernels is then tested end to end. bfloat16, float32 and int32 only."""

    def launch(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), **_):
        args = [(n, KINDS[a.dtype], to_numpy(a, KINDS[a.dtype]))
                for n, a in zip(input_names, inputs, strict=True)]  # fmt: skip
        constants = [(k, KINDS[v] if isinstance(v, mx.Dtype) else v) for k, v in template]
        outputs = [(n, KINDS[dtype], tuple(shape))
                   for n, shape, dtype in zip(output_names, output_shapes, output_dtypes,
                                              strict=True)]  # fmt: skip
        outs = run(
            source, args, outputs, constants,
            blocks=grid[0] // threadgroup[0], threads=threadgroup[0],
            shared_bytes=options.get("shared_memory", 0), header=header,
        )  # fmt: skip
        return [from_numpy(out, kind) for out, (_, kind, _) in zip(outs, outputs, strict=True)]

    return launch
