import pytest

from tests.tiny import GOLDEN, write_tiny_checkpoint


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
