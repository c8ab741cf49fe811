import os

# On a CUDA GPU, MLX runs float32 matmuls in TF32 unless told not to; the float32 exactness tests
# (golden vectors, references at 1e-5) need full float32. Set before MLX is first imported.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import pytest  # noqa: E402

from salabatch.engine import activate_blas  # noqa: E402

# The suite runs on the optimized BLAS, as every `salabatch` command does: loaded before anything
# imports mlx.core (tests.tiny does).
activate_blas()

from tests.tiny import GOLDEN, write_tiny_checkpoint  # noqa: E402


def pytest_sessionstart(session):
    """Under SALABATCH_STRICT_TESTS=1 (set by .ci/run: CI has ../shared beside the repo) a
    missing golden set or sample PDFs fail the run at once, where elsewhere their tests skip
    saying why: a skip there would hide the only tests that catch some engine bugs."""
    if os.environ.get("SALABATCH_STRICT_TESTS") != "1":
        return
    from tests import SHARED

    missing = []
    if not (GOLDEN / "golden_manifest.json").is_file():
        missing.append(f"the golden vectors ({GOLDEN})")
    if not any((SHARED / "pdfs").glob("*.pdf")):
        missing.append(f"the sample PDFs ({SHARED / 'pdfs'})")
    if missing:
        raise pytest.UsageError(
            "SALABATCH_STRICT_TESTS=1 and missing: " + "; ".join(missing) + " (unset it to "
            "skip their tests instead)"
        )


def _mlx():
    import mlx.core as mx

    return mx


ON_GPU = _mlx().default_device().type == _mlx().DeviceType.gpu
# Tests of MLX's CPU backend itself (the BLAS it calls, CPU-only speed paths).
cpu_backend = pytest.mark.skipif(
    ON_GPU, reason="tests MLX's CPU backend; this run's default device is the GPU"
)


@pytest.fixture
def cpu_device():
    """Runs the test on the CPU whatever the default device, and restores it."""
    mx = _mlx()
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture(scope="session")
def golden_dir():
    if not (GOLDEN / "golden_manifest.json").is_file():
        pytest.skip(
            f"golden vectors not found at {GOLDEN} (they live in ../shared beside the repo)"
        )
    return GOLDEN


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 4-layer checkpoint [sparse, lightning, lightning, sparse] with random weights."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $HOME, so `~` in job files resolves inside the test's folder."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home
