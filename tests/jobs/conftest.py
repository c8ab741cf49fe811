"""Fixtures of the job tests: builtin:random (an untrained test model), made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from salabatch.models import resolve_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return resolve_model("builtin:random", tmp_path_factory.mktemp("models"))
