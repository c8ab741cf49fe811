"""builtin:random (an untrained test model) is built offline, deterministically, and runs; and
`salabatch generate` streams an answer with timings."""

from __future__ import annotations

import hashlib

import pytest
from click.testing import CliRunner

from salabatch.api import load
from salabatch.cli import main
from salabatch.demo import builtin
from salabatch.engine.config import LIGHTNING, SPARSE, ModelConfig
from salabatch.engine.session import AnswerStream
from salabatch.errors import ConfigError
from salabatch.models import model_note, resolve_model


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):  # builtin:random, built
    return resolve_model("builtin:random", tmp_path_factory.mktemp("cache"))


def test_builds_the_same_bytes_everywhere(tiny_dir, tmp_path):
    again = resolve_model("builtin:random", tmp_path)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert digest(tiny_dir / name) == digest(again / name), name
    assert resolve_model("builtin:random", tmp_path) == again  # second call reuses the build


def test_config_has_both_layer_kinds_and_reaches_sparse_mode(tiny_dir):
    cfg = ModelConfig.from_file(tiny_dir)
    assert {SPARSE, LIGHTNING} == set(cfg.layer_kinds)
    assert cfg.sparse.dense_len == 2048
    assert "untrained" in cfg.extra["salabatch_note"]


def test_loads_with_its_tokenizer(tiny_dir):
    model, tok = load(tiny_dir)
    assert model.config.vocab_size == tok.vocab_size
    assert tok.eos_ids == frozenset(model.config.eos_token_ids)


def test_unknown_builtin_and_plain_paths():
    with pytest.raises(ConfigError, match="builtin:random"):
        resolve_model("builtin:huge")
    assert str(resolve_model("~/x")).endswith("/x") and "~" not in str(resolve_model("~/x"))


@pytest.mark.parametrize(
    ("pieces", "think", "shown"),
    [
        (["Hello", " world"], False, "Hello world"),
        (["<thi", "nk>plan", "ning</th", "ink>\n\nThe answer"], False, "The answer"),
        (["<think>never closed"], False, ""),
        (["<think>plan</think>", "Answer"], True, "<think>plan</think>Answer"),
        (["  <", "b>bold</b>"], False, "<b>bold</b>"),
    ],
)
def test_answer_stream_hides_a_leading_think_block(pieces, think, shown):
    stream = AnswerStream(think)
    assert "".join(stream.feed(p) for p in pieces) == shown


def test_generate_command_streams_and_reports(tiny_dir, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tiny_dir.parents[2]))
    result = CliRunner().invoke(
        main, ["generate", "builtin:random", "Say hi.", "--max-tokens", "5"]
    )
    assert result.exit_code == 0, result.output
    assert "untrained test model" in result.output
    assert "prompt " in result.output and "tok/s" in result.output and "(length)" in result.output


# -- builtin:tiny: the trained model, shipped ------------------------------------------------
def test_tiny_is_shipped_small_with_the_builtin_tokenizer(tiny_dir):
    shipped = resolve_model("builtin:tiny", "/nonexistent/cache")  # no build, no cache
    assert shipped == builtin.SHIPPED and (shipped / "MODEL_CARD.md").is_file()
    assert sum(f.stat().st_size for f in shipped.iterdir()) <= 20 * 2**20
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert digest(shipped / name) == digest(tiny_dir / name), name
    cfg = ModelConfig.from_file(shipped)
    assert cfg.extra["salabatch_note"] == model_note("builtin:tiny")
    assert {SPARSE, LIGHTNING} == set(cfg.layer_kinds)


def test_notes_say_which_builtin_is_trained():
    assert "untrained" in model_note("builtin:random")
    assert "trained on synthetic" in model_note("builtin:tiny")
    assert model_note("/some/folder") is None


def test_tiny_answers_a_held_out_needle_in_a_4k_document_through_sparse_attention():
    """A fixed held-out needle (entity, value format and phrasing never trained on) in the
    middle of a ~4K-token document: past dense_len, so the sparse layer selects blocks."""
    import salabatch
    from salabatch.train.data import EVAL, TaskGenerator

    model, tok = salabatch.load("builtin:tiny")
    (sample,) = TaskGenerator(tok, split=EVAL, seed=0).needle_document(0, 4096, [0.5])
    prompt = tok.document_prompt(sample.document, system=None, think=False)
    assert len(prompt) > model.config.sparse.dense_len
    (answer,) = salabatch.batch_generate(model, tok, sample.document, [sample.question], 16)
    assert answer.strip() == sample.answer, (sample.question, sample.answer, answer)
