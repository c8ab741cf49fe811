"""Fixtures of the command tests: builtin:random (an untrained test model) in a cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from salabatch.models import resolve_model


@pytest.fixture(scope="session")
def xdg_cache(tmp_path_factory) -> Path:
    """A cache folder ($XDG_CACHE_HOME) holding builtin:random (an untrained test model)."""
    root = tmp_path_factory.mktemp("xdg")
    resolve_model("builtin:random", root / "salabatch")
    return root


@pytest.fixture
def tiny(xdg_cache, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg_cache))
    return resolve_model("builtin:random")
