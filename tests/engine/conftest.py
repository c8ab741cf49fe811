"""Fixtures of the engine tests: the demo tokenizer, loaded once per module."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from salabatch.engine.tokenizer import load_tokenizer
from tests.engine.test_tokenizer import demo_tokenizer_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(demo_tokenizer_dir(tmp_path_factory))


@pytest.fixture
def demo_copy(tok, tmp_path):
    """A private copy of the demo tokenizer dir, for tests that edit its files."""
    return Path(shutil.copytree(tok.model_dir, tmp_path / "tok"))


@pytest.fixture(params=["native-path", "gpu-path"])
def engine_path(request, monkeypatch):
    """The path a test runs on: the one the device takes (on the CPU, its native kernels), or
    the GPU path's graphs, forced on any device by SALABATCH_GPU_PATH=1. As a fixture it runs
    the test on both; `indirect` parametrization picks."""
    if request.param == "gpu-path":
        monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    else:
        monkeypatch.delenv("SALABATCH_GPU_PATH", raising=False)
    return request.param
