"""The CUDA kernels' sources compile, on any machine: NVRTC (the compiler MLX's CUDA backend
runs on first use, from the nvidia-cuda-nvrtc wheel) builds each one as `mx.fast.cuda_kernel`
wraps it — the signature from its inputs' dtypes, its template arguments as constants — for an
H100 (sm_90a, MLX's flags), in every dtype the engine gives it, with no register spills. Their
results are tested where a GPU is (`test_stage1_cuda.py`); this catches a
source that would not build before a GPU is lent. Skipped where the wheels are not installed
(they exist for Linux x86_64)."""

from __future__ import annotations

import ctypes
import importlib.util
import re
from pathlib import Path

import pytest

from salabatch.engine.kernels import (
    decode_cuda,
    gla_cuda,
    norm_cuda,
    rows_cuda,
    scores_cuda,
    stage1_cuda,
    stage2_cuda,
)


def _cuda_dir() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        if (Path(root) / "cu13" / "lib" / "libnvrtc.so.13").exists():
            return Path(root) / "cu13"
    return None


CUDA = _cuda_dir()
pytestmark = pytest.mark.skipif(
    CUDA is None or not (CUDA / "include" / "cuda_bf16.h").exists(),
    reason="needs the nvidia-cuda-nvrtc, -runtime and -crt 13 wheels (Linux x86_64)",
)
# what MLX's default header brings in, short of its own utils.cuh
PRELUDE = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\ntypedef int int32_t;\n"
TYPES = {"bf16": "__nv_bfloat16", "f16": "__half", "f32": "float", "i32": "int32_t"}


def _build(name, source, inputs, outputs, header="", template=()) -> str:
    """The translation unit MLX's `cuda_kernel` makes (mlx/backend/cuda/custom_kernel.cpp):
    its header, then the signature, each template argument a constant, the body."""
    params = [f"const {TYPES[t]}* {n}" for n, t in inputs]
    params += [f"{TYPES[t]}* {n}" for n, t in outputs]
    constants = "".join(
        f"  using {k} = {TYPES[v]};\n" if v in TYPES else f"  constexpr int {k} = {v};\n"
        for k, v in template
    )
    body = f"__global__ void {name}({', '.join(params)}) {{\n{constants}{source}\n}}\n"
    return f"{PRELUDE}{header}namespace mlx::core::cu {{\n{body}}}\n"


def _compile(unit: str) -> tuple[int, str]:
    lib = ctypes.CDLL(str(CUDA / "lib" / "libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), unit.encode(), b"k.cu", 0, None, None) == 0
    options = [
        b"--device-as-default-execution-space",
        b"--gpu-architecture=sm_90a",
        f"--include-path={CUDA / 'include'}".encode(),
        b"--ptxas-options=-v",
    ]
    rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode()


def _assert_builds(unit: str, threads: int = 256) -> None:
    """Builds, with no spills and no stack frame (an array indexed at run time, tensor-core
    accumulators say, lives in local memory then), within the registers a thread block of
    `threads` can have (an SM's 65,536: at 1,024 threads, 64 a thread, or the launch fails)."""
    rc, log = _compile(unit)
    assert rc == 0, log
    assert "0 bytes spill stores" in log, log
    assert " 0 bytes stack frame" in log, log
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    assert registers * threads <= 65536, log


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_stage1_kernels_compile(dtype):
    _assert_builds(
        _build(
            "lse", stage1_cuda._LSE,
            [("s2", dtype), ("seen2", "i32"), ("dims", "i32"), ("scale", "f32")],
            [("lse", "f32")],
        )
    )  # fmt: skip
    _assert_builds(
        _build(
            "pool", stage1_cuda._POOL,
            [("s1", dtype), ("lse", "f32"), ("seen1", "i32"), ("seen2", "i32"), ("dims", "i32"),
             ("scale", "f32")],
            [("pooled", "f32")],
        )
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("qreg", [1, 0])
@pytest.mark.parametrize(("d", "tile"), [(128, 2), (128, 4), (128, 8), (64, 4)])
def test_stage2_kernel_compiles(dtype, d, tile, qreg):
    """Every variant the dispatcher or the profile launches: q's dtype, head dim, queries a
    thread block (the 9B's G = 16 heads a kv group, 64-key blocks), the query in registers or
    in shared memory."""
    inputs = [("q", dtype), ("keys", dtype), ("values", dtype), ("idx", "i32"),
              ("first", "i32"), ("dims", "i32"), ("scale", "f32")]  # fmt: skip
    assert tuple(n for n, _ in inputs) == stage2_cuda.INPUTS
    template = [("T", dtype), ("D", d), ("G", 16), ("QT", tile), ("BLOCK", 64), ("QREG", qreg)]
    unit = _build("stage2", stage2_cuda._SOURCE, inputs, [("out", dtype)],
                  stage2_cuda.BLOCK_ATTENTION, template)  # fmt: skip
    _assert_builds(unit, 32 * tile)
    assert stage2_cuda.shared_bytes(d, 64, tile, 2, bool(qreg)) <= stage2_cuda.MAX_SHARED


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_decode_selection_kernel_compiles(dtype):
    """The decode step's selection in every dtype the step's keys come in (the 9B's 16 heads a
    kv group, head dim 128, 5 entries a block's pool)."""
    inputs = [(n, dtype) for n in decode_cuda.SELECT_INPUTS[:4]]
    inputs += [(n, "i32") for n in decode_cuda.SELECT_INPUTS[4:9]] + [("scale", "f32")]
    assert tuple(n for n, _ in inputs) == decode_cuda.SELECT_INPUTS
    template = [("T", dtype), ("G", 16), ("D", 128), ("R1", 5)]
    unit = _build("top_k", decode_cuda._SELECT, inputs, [("top", "i32")], "", template)
    _assert_builds(unit, decode_cuda.THREADS)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("d", [128, 64])
def test_decode_attention_kernels_compile(dtype, d):
    """The decode step's stage 2 (a warp a thread block) and the sum of its splits."""
    names = decode_cuda.ATTEND_INPUTS
    kinds = dict(q=dtype, rows_k=dtype, rows_v=dtype, shared_k=dtype, shared_v=dtype, scale="f32")
    inputs = [(n, kinds.get(n, "i32")) for n in names]
    template = [("T", dtype), ("D", d), ("G", 16), ("BLOCK", 64)]
    unit = _build("attend", decode_cuda._ATTEND, inputs, [("part", "f32")],
                  stage2_cuda.BLOCK_ATTENTION, template)  # fmt: skip
    _assert_builds(unit, 32)
    assert decode_cuda.attend_bytes(d, 64, 2) <= 48000  # no opt-in to more shared memory
    unit = _build("combine", decode_cuda._COMBINE, [("part", "f32"), ("dims", "i32")],
                  [("out", dtype)], "", template[:3])  # fmt: skip
    _assert_builds(unit)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize(
    ("d", "out", "fresh"), [(128, "bf16", 1), (128, "f32", 0), (64, "bf16", 0)]
)
def test_lightning_kernels_compile(dtype, d, out, fresh):
    """The lightning prefill's three kernels (the chunks' states, the scan, the outputs): q's
    dtype, the 9B's head dim and a smaller, the output's dtype (the layer's, or float32), from
    a zero state or a given one."""
    kinds = {"g": "f32", "dims": "i32", "scale": "f32", "chunk_states": "f32", "state": "f32",
             "starts": "f32"}  # fmt: skip
    for name, source, names, outputs, header, template, threads in (
        ("states", gla_cuda._STATES, gla_cuda.STATES_INPUTS, [("chunk_states", "f32")],
         gla_cuda.HEADER, [("InT", dtype), ("D", d)], gla_cuda.THREADS),
        ("scan", gla_cuda._SCAN, gla_cuda.SCAN_INPUTS, [("starts", "f32"), ("final_state", "f32")],
         "", [("D", d), ("FRESH", fresh)], gla_cuda.SCAN_THREADS),
        ("out", gla_cuda._OUT, gla_cuda.OUT_INPUTS, [("out", out)], gla_cuda.HEADER,
         [("InT", dtype), ("OutT", out), ("D", d)], gla_cuda.THREADS),
    ):  # fmt: skip
        inputs = [(n, kinds.get(n, dtype)) for n in names]
        _assert_builds(_build(name, source, inputs, outputs, header, template), threads)
        if name != "scan":
            assert gla_cuda.shared_bytes(name, d) <= stage2_cuda.MAX_SHARED


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize(
    ("d", "heads", "kv", "norm", "rope"), [(128, 32, 32, 1, 1), (64, 8, 2, 0, 1)]
)
def test_lightning_step_kernel_compiles(dtype, d, heads, kv, norm, rope):
    """The decode step's lightning kernel: the 9B's 32 heads of 128 (norms and rope), and a
    smaller layer of shared kv heads without norms."""
    inputs = [("y", dtype), ("wq", dtype), ("wk", dtype), ("pos", "i32"), ("decay", "f32"),
              ("state", "f32"), ("params", "f32")]  # fmt: skip
    assert tuple(n for n, _ in inputs) == gla_cuda.STEP_INPUTS
    template = [("InT", dtype), ("D", d), ("H", heads), ("HK", kv), ("N", (2 * heads + 2 * kv) * d),
                ("QKNORM", norm), ("ROPE", rope)]  # fmt: skip
    unit = _build("step", gla_cuda._STEP, inputs, [("out", dtype), ("new_state", "f32")], "",
                  template)  # fmt: skip
    _assert_builds(unit, gla_cuda.THREADS)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("d", [128, 64])
def test_stage1_scores_kernel_compiles(dtype, d):
    """Stage 1's block scores straight from the queries (8 queries a thread block)."""
    inputs = [("q", dtype), ("c1", dtype), ("c2", dtype), ("seen1", "i32"), ("seen2", "i32"),
              ("dims", "i32"), ("scale", "f32")]  # fmt: skip
    assert tuple(n for n, _ in inputs) == scores_cuda.INPUTS
    template = [("T", dtype), ("D", d), ("QT", scores_cuda.QUERIES)]
    unit = _build("scores", scores_cuda._SOURCE, inputs, [("pooled", "f32")], scores_cuda.HEADER,
                  template)  # fmt: skip
    _assert_builds(unit, 32 * scores_cuda.QUERIES)
    assert scores_cuda.shared_bytes(d, 2) <= stage2_cuda.MAX_SHARED


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("n", [4096, 256, 300])
def test_add_rms_norm_kernel_compiles(dtype, n):
    """The residual add and norm: the 9B's width, a small one, one not a multiple of 256."""
    inputs = [("h", dtype), ("y", dtype), ("weight", dtype), ("params", "f32")]
    assert tuple(name for name, _ in inputs) == norm_cuda.INPUTS
    unit = _build("add_norm", norm_cuda._SOURCE, inputs, [("h_out", dtype), ("normed", dtype)],
                  "", [("T", dtype), ("N", n)])  # fmt: skip
    _assert_builds(unit, norm_cuda.THREADS)


def test_a_broken_source_fails_to_build():
    """The check itself: a kernel that reads an input it does not have does not build."""
    broken = stage1_cuda._LSE.replace("seen2[b * t + query]", "seen3[b * t + query]")
    rc, log = _compile(
        _build("lse", broken, [("s2", "bf16"), ("seen2", "i32"), ("dims", "i32"),
                                   ("scale", "f32")], [("lse", "f32")])
    )  # fmt: skip
    assert rc != 0 and "seen3" in log


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize(("rows", "in_flight"), [(1, 4), (8, 4), (1, 8), (8, 2)])
def test_rows_kernel_compiles(dtype, rows, in_flight):
    """The decode step's product: one row and the most the dispatcher sends (8), the loads in
    flight the dispatcher's and the profile's."""
    inputs = [("x", dtype), ("w", dtype), ("dims", "i32")]
    assert tuple(n for n, _ in inputs) == rows_cuda.INPUTS
    unit = _build("rows", rows_cuda._SOURCE, inputs, [("y", dtype)], "",
                  [("T", dtype), ("M", rows), ("U", in_flight)])  # fmt: skip
    _assert_builds(unit, rows_cuda.THREADS)
