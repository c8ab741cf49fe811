"""Fixtures of the serving tests."""

from __future__ import annotations

import pytest

MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer) of the builtin demo model, loaded once per test module."""
    import salabatch

    return salabatch.load(MODEL)
