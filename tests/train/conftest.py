"""Training tests' fixtures: the builtin model's folder (for its tokenizer), once a session."""

import pytest

from salabatch.models import resolve_model


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models")
    resolve_model("builtin:random", path)
    return path


@pytest.fixture(scope="session")
def tokenizer(models_dir):
    from salabatch.engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("builtin:random", models_dir))
