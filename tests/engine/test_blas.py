"""The BLAS swap (engine/blas.py), its thread counts, the runtime helpers and `salabatch doctor`.

Which BLAS a process uses is fixed when `mlx.core` is first imported, so each case that needs a
fresh choice runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from salabatch.engine import blas, blas_patch
from salabatch.engine.runtime import memory_cache, resolve_dtype
from salabatch.errors import ConfigError
from tests.conftest import ON_GPU

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or ON_GPU,
    reason="the BLAS swap is for MLX's Linux CPU backend (this platform or device is another)",
)

# Prints what the fresh process chose, every warning raised while choosing, and how `a @ b`
# (odd shapes, one side transposed) compares with numpy under that BLAS. ACTIVATE is replaced.
PROBE = textwrap.dedent(
    """
    import json, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from salabatch.engine import blas
        ACTIVATE
        from salabatch.engine import load_model  # the model code, which imports mlx.core
    import mlx.core as mx, numpy as np
    a, b = np.random.rand(65, 127).astype("f4"), np.random.rand(33, 127).astype("f4")
    got = np.array(mx.array(a) @ mx.array(b).T)
    print(json.dumps({
        "info": blas.active().__dict__,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "max_err": float(np.abs(got - a @ b.T).max()),
        "provider": blas._global_provider("cblas_sgemm"),
    }))
    """
)


def probe(
    tmp_path, env: dict[str, str], prelude: str = "", activate: bool = True, code: str = PROBE
) -> dict:
    """What `code` (PROBE by default) prints as JSON in a fresh process with `env` (the BLAS
    choice and OpenBLAS's timeout only as `env` sets them)."""
    full_env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env}
    for name in ("SALABATCH_BLAS", blas.SPIN[0]):
        if name not in env:
            full_env.pop(name, None)
    code = code.replace("ACTIVATE", "blas.activate_blas()" if activate else "pass")
    done = subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@linux_only
def test_this_process_uses_an_optimized_blas():
    # conftest calls activate_blas() before mlx; the reference BLAS here means a broken setup
    assert blas.active().kind != "reference", blas.active().reason


@linux_only
def test_fresh_process_picks_an_optimized_blas(tmp_path):
    out = probe(tmp_path, {})
    assert out["info"]["kind"] != "reference", out["info"]["reason"]
    assert out["provider"] == out["info"]["path"]
    assert out["warnings"] == []
    assert out["max_err"] < 1e-3


@linux_only
def test_importing_the_engine_swaps_nothing(tmp_path):
    out = probe(tmp_path, {}, activate=False)
    assert out["provider"] is None  # MLX's cblas_sgemm is its own
    assert out["info"]["kind"] == "reference"
    assert out["info"]["reason"] == "activate_blas() was not called"
    assert out["warnings"] == []


@linux_only
def test_patched_scipy_openblas_exports_cblas_and_computes(tmp_path):
    src = blas._scipy_openblas_path()
    if src is None:
        pytest.skip("scipy-openblas32 is not installed")
    out = probe(tmp_path, {"SALABATCH_BLAS": "scipy"})
    assert out["info"]["kind"] == "scipy-openblas32"
    assert out["info"]["path"].startswith(str(tmp_path / "salabatch" / "blas"))
    assert out["provider"] == out["info"]["path"]  # MLX's cblas_sgemm resolves to the copy
    assert out["max_err"] < 1e-3
    # the copy is cached: a second patch returns the same file without rewriting it
    cached = blas_patch.patch_scipy_openblas(Path(src), tmp_path / "salabatch" / "blas")
    assert str(cached) == out["info"]["path"]


@linux_only
def test_off_keeps_the_reference_blas(tmp_path):
    out = probe(tmp_path, {"SALABATCH_BLAS": "off"})
    assert out["info"]["kind"] == "reference"
    assert out["provider"] is None
    assert out["warnings"] == []


@linux_only
def test_bogus_path_warns_once_and_falls_back(tmp_path):
    out = probe(tmp_path, {"SALABATCH_BLAS": str(tmp_path / "nope.so")})
    assert out["info"]["kind"] == "reference"
    assert len(out["warnings"]) == 1 and "\n" not in out["warnings"][0]
    assert out["warnings"][0].startswith("BlasWarning:") and "nope.so" in out["warnings"][0]
    assert out["max_err"] < 1e-3


@linux_only
def test_mlx_imported_first_is_reported(tmp_path):
    out = probe(tmp_path, {}, prelude="import mlx.core\n")
    assert out["info"]["kind"] == "reference"
    assert "mlx.core was imported before" in out["info"]["reason"]
    assert len(out["warnings"]) == 1


def test_activate_is_idempotent():
    assert blas.activate_blas() is blas.activate_blas() is blas.active()


@linux_only
def test_threads_sets_and_restores_the_count(monkeypatch):
    path = blas.active().path
    before = blas._threads(path)
    if before is None:
        pytest.skip(f"threadpoolctl has no thread setting for {path}")
    for variable in blas._THREAD_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    seen = []

    def run_block():
        with blas.threads(before + 1):
            seen.append(blas._threads(path))
        seen.append(blas._threads(path))

    worker = threading.Thread(target=run_block)  # not only the thread that activated
    worker.start()
    worker.join()
    run_block()
    assert seen == [before + 1, before] * 2
    # the user's own variable wins
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", str(before))
    with blas.threads(before + 1):
        assert blas._threads(path) == before


def test_cli_help_imports_no_mlx_nor_blas():
    code = textwrap.dedent(
        """
        import sys
        from salabatch.cli import main
        try:
            main(["--help"])
        except SystemExit:
            pass
        print(sorted(m for m in sys.modules if m.startswith(("mlx", "salabatch.engine"))))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_memory_cache_restores_previous_limit():
    before = 48 << 20
    original = mx.set_cache_limit(before)
    try:
        with memory_cache(96 << 20) as limit:
            assert limit == 96 << 20
            assert mx.set_cache_limit(limit) == 96 << 20
        assert mx.set_cache_limit(before) == before
        with pytest.raises(RuntimeError), memory_cache(64 << 20):
            raise RuntimeError
        assert mx.set_cache_limit(before) == before
    finally:
        mx.set_cache_limit(original)


def test_resolve_dtype():
    assert resolve_dtype(None) == resolve_dtype("auto")
    assert resolve_dtype("bf16") == mx.bfloat16
    assert resolve_dtype("float32") == mx.float32
    assert resolve_dtype("FP16") == mx.float16
    with pytest.raises(ConfigError, match="dtype") as e:
        resolve_dtype("int8")
    assert e.value.field == "dtype" and e.value.got == "int8"


def test_doctor_in_a_fresh_process_reports_the_activated_blas():
    # the command activates the BLAS itself: a fresh process chooses as this one did
    done = subprocess.run(
        [sys.executable, "-c", "from salabatch.cli import main; main()", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["gemm_gflops"] > 0 and report["decode_gbps"] > 0
    assert report["blas"]["kind"] == blas.active().kind
    assert report["mlx"] == mx.__version__


IDLE = textwrap.dedent(
    """
    import json, os, time
    from salabatch.engine import blas
    ACTIVATE
    info = blas.active()
    import mlx.core as mx
    a = mx.random.normal((1024, 1024))
    mx.eval(a @ a)  # threaded: the workers poll after it, or sleep
    start = time.process_time()
    time.sleep(0.3)
    print(json.dumps({"kind": info.kind, "threads": info.threads,
                      "idle_cpu": time.process_time() - start,
                      "timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}))
    """
)


@linux_only
def test_openblas_threads_sleep_once_idle_instead_of_polling(tmp_path):
    """Idle OpenBLAS workers would poll for ~0.1 s after each threaded call, on the cores the
    decode loop needs: they sleep at once (`blas.SPIN`), unless the user set the timeout."""
    out = probe(tmp_path, {}, code=IDLE)
    if not out["kind"].endswith("openblas") or not out["threads"] or out["threads"] < 2:
        pytest.skip(f"needs a threaded OpenBLAS: {out['kind']} on {out['threads']} threads")
    # What it spares (~0.1 s of CPU a threaded call, measured) is a benchmark's figure
    # (benchmarks/HISTORY.md, "OpenBLAS's idle threads sleep at once"), not a test's.
    assert out["timeout"] == blas.SPIN[1]
    chosen = probe(tmp_path, {"OPENBLAS_THREAD_TIMEOUT": "28"}, code=IDLE)
    assert chosen["timeout"] == "28"
