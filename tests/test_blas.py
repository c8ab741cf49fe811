"""The BLAS swap (engine/blas.py), the runtime helpers and `salabatch doctor`.

Which BLAS a process uses is fixed when `mlx.core` is first imported, so each case that needs a
fresh choice runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from salabatch.cli import main
from salabatch.engine import blas
from salabatch.engine.runtime import memory_cache, resolve_dtype
from salabatch.errors import ConfigError
from tests.conftest import ON_GPU

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or ON_GPU,
    reason="the BLAS swap is for MLX's Linux CPU backend (this platform or device is another)",
)

# Prints what the fresh process chose, every warning raised while choosing, and how `a @ b`
# (odd shapes, one side transposed) compares with numpy under that BLAS.
PROBE = textwrap.dedent(
    """
    import json, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from salabatch.engine import blas
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


def probe(tmp_path, env: dict[str, str], prelude: str = "") -> dict:
    full_env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env}
    if "SALABATCH_BLAS" not in env:
        full_env.pop("SALABATCH_BLAS", None)
    done = subprocess.run(
        [sys.executable, "-c", prelude + PROBE],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@linux_only
def test_this_process_uses_an_optimized_blas():
    # conftest imports salabatch.engine before mlx; the reference BLAS here means a broken setup
    assert blas.active().kind != "reference", blas.active().reason


@linux_only
def test_fresh_process_picks_an_optimized_blas(tmp_path):
    out = probe(tmp_path, {})
    assert out["info"]["kind"] != "reference", out["info"]["reason"]
    assert out["provider"] == out["info"]["path"]
    assert out["warnings"] == []
    assert out["max_err"] < 1e-3


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
    cached = blas.patch_scipy_openblas(Path(src), tmp_path / "salabatch" / "blas")
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
    assert blas.activate() is blas.activate() is blas.active()


def test_memory_cache_restores_previous_limit():
    before = 48 << 20
    original = mx.set_cache_limit(before)
    try:
        with memory_cache(96 << 20) as limit:
            assert limit == 96 << 20
            assert mx.set_cache_limit(limit) == 96 << 20
        assert mx.set_cache_limit(before) == before
        with pytest.raises(RuntimeError), memory_cache():
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


def test_doctor_json_reports_speed():
    result = CliRunner().invoke(main, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["gemm_gflops"] > 0 and report["decode_gbps"] > 0
    assert report["blas"]["kind"] == blas.active().kind
    assert report["mlx"] == mx.__version__
