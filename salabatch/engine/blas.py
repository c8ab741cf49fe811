"""Load an optimized BLAS for MLX's Linux CPU backend, before `mlx.core` is imported.

Why: the `mlx[cpu]` wheel links the reference (netlib) BLAS from `mlx_cpu.libs/`, and
`libmlx.so` resolves `cblas_sgemm` at load time. A library loaded earlier with RTLD_GLOBAL is
searched first, so loading OpenBLAS or BLIS that way makes MLX use it. It must happen before the
first `import mlx.core`, and it changes the whole process for good, so importing salabatch never
does it: the `salabatch` command calls `activate_blas()` at start, and library users call it
once themselves (`salabatch.engine.activate_blas()`).

Measured on the 2-core Linux x86_64 dev machine (AVX-512, fp32, 2 threads, best of 4 runs): GEMM
1024² in GFLOP/s; x[M, 4096] @ W[4096, 4096]^T in GB/s of weights read (decode, batch M):

                              GEMM    M=1    M=8
    reference (mlx_cpu.libs)   2.6    3.3    0.4
    OpenBLAS 0.3.21 (Debian)   161    8.7    6.2
    BLIS 0.9 (Debian)          100   14.0    8.5
    scipy-openblas32 0.3.34    162    8.8    7.9   (patched copy, see `blas_patch`)

OpenBLAS is tried first: it wins prefill by 1.6x and BLIS wins decode by 1.4x, so OpenBLAS is
ahead once a document is longer than ~25x the tokens decoded from it, the pipeline's usual case.
BLIS comes next, then scipy-openblas32 (pip-installed, so present without root or a compiler).

Choose with `SALABATCH_BLAS`: `off` / `0` / `none` keeps MLX's own BLAS; `openblas`, `blis` or
`scipy` forces a kind; any other value is a path to a library exporting `cblas_sgemm`.
Thread count, set through threadpoolctl: the physical cores available to the process, unless
OPENBLAS_NUM_THREADS, BLIS_NUM_THREADS, MKL_NUM_THREADS or OMP_NUM_THREADS is set (the libraries
read those themselves). OpenBLAS's idle threads sleep at once instead of polling for ~0.1 s
(`SPIN`: OPENBLAS_THREAD_TIMEOUT, unless set).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import os
import platform
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from threadpoolctl import ThreadpoolController

from salabatch.engine.blas_patch import BlasLoadError, patch_scipy_openblas

ENV = "SALABATCH_BLAS"
_OFF = {"off", "0", "none", "reference"}


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's CPU backend uses in this process, and why."""

    kind: str  # "openblas" | "blis" | "scipy-openblas32" | "reference" | "accelerate" | "custom"
    path: str | None
    threads: int | None
    reason: str


class BlasWarning(UserWarning):
    """MLX will run on its slow reference BLAS (or a BLAS could not be swapped in)."""


# The one piece of module state: loading a shared library is process-wide and cannot be undone,
# so what was loaded is a fact about the process, recorded once.
_ACTIVE: BlasInfo | None = None


def activate_blas() -> BlasInfo:
    """Load the best available BLAS into the global symbol scope (once) and return what is used.

    Call it before anything imports `mlx.core`; later it can only warn. Never raises: any
    failure is one `BlasWarning` and MLX keeps its reference BLAS.
    """
    global _ACTIVE
    if _ACTIVE is None:
        try:
            _ACTIVE = _choose()
        except Exception as e:  # a bug here, or `-W error`, must not stop the engine loading
            _ACTIVE = BlasInfo("reference", None, None, f"{type(e).__name__}: {e}")
    return _ACTIVE


def active() -> BlasInfo:
    """The BLAS MLX uses in this process: what `activate_blas()` chose, else MLX's own (or one
    loaded before salabatch, e.g. with LD_PRELOAD). Changes nothing."""
    if _ACTIVE is not None:
        return _ACTIVE
    return _unswapped() or BlasInfo(
        "reference", _reference_path(), None, "activate_blas() was not called"
    )


def _unswapped() -> BlasInfo | None:
    """What MLX uses where there is nothing to swap: not Linux, or a BLAS already in the global
    scope (LD_PRELOAD, or loaded globally before us), which wins. None otherwise."""
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, None, "macOS: MLX uses Accelerate")
    if not sys.platform.startswith("linux"):
        return BlasInfo("reference", None, None, f"no BLAS swap on {sys.platform}")
    provider = _global_provider("cblas_sgemm")
    if provider is None:
        return None
    return BlasInfo(
        _kind_of(provider), provider, _threads(provider), "already loaded (LD_PRELOAD?)"
    )


def _choose() -> BlasInfo:
    found = _unswapped()
    if found is not None:
        if found.path:  # a BLAS loaded before us wins; its thread count is still ours to set
            _set_default_threads(found.path)
            found = replace(found, threads=_threads(found.path))
        return found
    want = os.environ.get(ENV, "").strip()
    if want.lower() in _OFF:
        return BlasInfo("reference", _reference_path(), None, f"disabled by {ENV}={want}")
    if "mlx.core" in sys.modules:
        return _fallback("mlx.core was imported before activate_blas(), too late to swap the BLAS")

    if want.lower() in ("", "auto"):
        candidates, reason = _candidates(), "first found of openblas, blis, scipy-openblas32"
    elif want.lower() in ("openblas", "blis", "scipy", "scipy-openblas32"):
        kind = "scipy-openblas32" if want.lower().startswith("scipy") else want.lower()
        candidates = [c for c in _candidates() if c[0] == kind]
        reason = f"{ENV}={want}"
        if not candidates:
            return _fallback(f"{ENV}={want}: no {kind} library found")
    else:
        candidates, reason = [(_kind_of(want), want)], f"{ENV}={want}"
    if not candidates:
        return _fallback(
            "no optimized BLAS found (apt install libopenblas0-pthread, "
            "or pip install scipy-openblas32)"
        )

    failures = []
    for kind, path in candidates:
        try:
            return _load(kind, path, reason)
        except (OSError, BlasLoadError) as e:
            failures.append(str(e) if path in str(e) else f"{path}: {e}")
    return _fallback("; ".join(failures))


def _fallback(why: str) -> BlasInfo:
    warnings.warn(f"{why}; MLX uses its reference BLAS (slow)", BlasWarning, stacklevel=2)
    return BlasInfo("reference", _reference_path(), None, why)


# ----- candidates -------------------------------------------------------------------------------


def _candidates() -> list[tuple[str, str]]:
    """(kind, path) of installed libraries, best first; paths cover Debian/Ubuntu, Fedora, Arch."""
    arch = f"/usr/lib/{platform.machine()}-linux-gnu"
    openblas = [
        f"{arch}/openblas-pthread/libopenblas.so.0",
        f"{arch}/openblas-openmp/libopenblas.so.0",
        f"{arch}/libopenblas.so.0",
        "/usr/lib64/libopenblasp.so.0",  # Fedora: pthreads build
        "/usr/lib64/libopenblaso.so.0",  # Fedora: OpenMP build
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",  # Arch
    ]
    blis = [
        f"{arch}/blis-pthread/libblis.so.4",
        f"{arch}/blis-openmp/libblis.so.4",
        f"{arch}/libblis.so.4",
        "/usr/lib64/libblisp.so.4",
        "/usr/lib64/libblis.so.4",
        "/usr/lib/libblis.so.4",
    ]
    found = [("openblas", p) for p in openblas if os.path.exists(p)]
    found += [("blis", p) for p in blis if os.path.exists(p)]
    if not found:  # elsewhere on the loader's path; asked only now as each name runs ldconfig
        names = [("openblas", "openblasp"), ("openblas", "openblas"), ("blis", "blis")]
        found = [(k, p) for k, n in names if (p := ctypes.util.find_library(n))]
    scipy = _scipy_openblas_path()
    if scipy:
        found.append(("scipy-openblas32", scipy))
    return found


def _exists(path: str) -> bool:
    # a bare soname ("libopenblas.so.0", as find_library returns) is searched for by dlopen
    return os.path.exists(path) or "/" not in path


def _scipy_openblas_path() -> str | None:
    spec = importlib.util.find_spec("scipy_openblas32")  # no import: it would load the library
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = glob.glob(
        os.path.join(spec.submodule_search_locations[0], "lib", "libscipy_openblas*.so")
    )
    return libs[0] if libs else None


def _kind_of(path: str) -> str:
    name = os.path.basename(path).lower()
    if "scipy_openblas" in name:
        return "scipy-openblas32"
    return next((k for k in ("openblas", "blis", "mkl") if k in name), "custom")


def _reference_path() -> str | None:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = glob.glob(
        os.path.join(spec.submodule_search_locations[0], "..", "mlx_cpu.libs", "libblas*")
    )
    return os.path.realpath(libs[0]) if libs else None


# ----- loading ----------------------------------------------------------------------------------


def _load(kind: str, path: str, reason: str) -> BlasInfo:
    """Load `path` with RTLD_GLOBAL so `libmlx.so` binds `cblas_sgemm` to it; set its threads."""
    if not _exists(path):
        raise BlasLoadError("no such file")
    if kind == "scipy-openblas32":
        path = str(patch_scipy_openblas(Path(path)))
    if kind in ("openblas", "scipy-openblas32"):  # read once, as the library loads
        os.environ.setdefault(*SPIN)
    lib = ctypes.CDLL(path)  # local first: a library without CBLAS must not shadow anything
    if not hasattr(lib, "cblas_sgemm"):
        raise BlasLoadError("does not export cblas_sgemm")
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # promotes the same handle to global scope
    if _address(ctypes.CDLL(None), "cblas_sgemm") != _address(lib, "cblas_sgemm"):
        raise BlasLoadError(f"cblas_sgemm still resolves to {_global_provider('cblas_sgemm')}")
    provider = _global_provider("cblas_sgemm")  # the absolute path, also for a bare soname
    _set_default_threads(provider)
    return BlasInfo(kind, provider, _threads(provider), reason)


# ----- threads ----------------------------------------------------------------------------------

# OpenBLAS's idle worker threads poll (sched_yield) for 2^28 cycles, about 0.1 s, after each
# threaded call before they sleep. A decode step follows a prompt's threaded matmuls within
# that time, so they poll through it on the cores its host thread and MLX's own thread need:
# measured on the 2-core machine, builtin:tiny decoded ~20 % slower (1.5M involuntary context
# switches in 4 s) than with 2^4 cycles, which lets them sleep at once; a 16K prefill was no
# slower (a chunk's matmuls take milliseconds, waking the workers microseconds). A value the
# user set wins.
SPIN = ("OPENBLAS_THREAD_TIMEOUT", "4")

_THREAD_VARIABLES = (
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_NUM_THREADS",
)


@contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with MLX's BLAS on n threads, then restore its count. Nothing changes when
    the user chose a count (OPENBLAS_NUM_THREADS, …) or the BLAS has no such setting."""
    info = active()
    if info.path is None or _user_chose_threads():
        yield
        return
    with _controller(info.path).limit(limits=n):
        yield


def _user_chose_threads() -> bool:
    return any(v in os.environ for v in _THREAD_VARIABLES)


@functools.cache
def _controller(path: str) -> ThreadpoolController:
    """threadpoolctl's handle on the loaded library at `path`; empty for a library it does not
    know (MLX's reference BLAS). It lists loaded libraries by resolved path, ctypes-loaded too.
    Made once a path: a loaded library stays, and listing them all costs ~1 ms, which
    `stream_generate` would pay every token (it sets the threads around each step)."""
    return ThreadpoolController().select(filepath=os.path.realpath(path))


def _threads(path: str) -> int | None:
    libraries = _controller(path).info()
    return libraries[0]["num_threads"] if libraries else None


def _set_default_threads(path: str) -> None:
    """One thread per physical core (OpenBLAS starts with one per hyperthread, BLIS with one in
    all), for the rest of the process, unless the user chose (the libraries read the variables)."""
    if _user_chose_threads():
        return
    controller, n = _controller(path), physical_cores()
    controller.limit(limits=n)  # called, not entered: the count stays
    # threadpoolctl lets only the thread that set OpenBLAS's count change it again until one of
    # its `with` blocks ends; ending one here (it restores n) lets `threads()` run on any thread.
    with controller.limit(limits=n):
        pass


def default_threads() -> int:
    """Threads for salabatch's own CPU kernels: the count the user chose for BLAS (the first of
    OPENBLAS_NUM_THREADS, … set to a whole number), else one per physical core, as BLAS."""
    for name in _THREAD_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return physical_cores()


def physical_cores() -> int:
    """Cores this process may run on, counting hyperthread siblings once (BLAS gains nothing)."""
    if not hasattr(os, "sched_getaffinity"):  # macOS
        return os.cpu_count() or 1
    cpus = os.sched_getaffinity(0)
    cores = set()
    for c in cpus:
        topo = f"/sys/devices/system/cpu/cpu{c}/topology"
        try:
            cores.add(
                (Path(topo, "physical_package_id").read_text(), Path(topo, "core_id").read_text())
            )
        except OSError:
            return len(cpus)
    return max(1, len(cores))


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _address(lib: ctypes.CDLL, symbol: str) -> int | None:
    try:
        return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None


def _global_provider(symbol: str) -> str | None:
    """Path of the library that the global scope resolves `symbol` to, or None if none does."""
    scope = ctypes.CDLL(None)  # dlopen(NULL): the executable and every RTLD_GLOBAL library
    address, info = _address(scope, symbol), _DlInfo()
    if address is None or not scope.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return None
    return os.fsdecode(info.dli_fname) if info.dli_fname else None
