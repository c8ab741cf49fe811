"""The demo tokenizer of builtin:random: the 9B's special ids, vocab sizes, reproducible builds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from salabatch.demo.tokenizer import (
    HEAD_TOKENS,
    MIN_DEMO_VOCAB,
    TAIL_TOKENS,
    build_byte_tokenizer,
)
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.errors import TokenizerError
from tests.engine.test_tokenizer import demo_tokenizer_dir


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return demo_tokenizer_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def tok(demo_dir):
    return load_tokenizer(demo_dir)


def test_demo_layout_matches_the_real_special_ids(demo_dir, tok):
    assert tok.vocab_size == 1024
    for i, t in enumerate(HEAD_TOKENS):
        assert tok.token_id(t) == i
    for i, t in enumerate(TAIL_TOKENS):
        assert tok.token_id(t) == 1024 - 8 + i  # as 73440..73447 end the 9B's 73448
    assert tok.bos_id == 1
    assert tok.eos_ids == frozenset({2, tok.token_id("<|im_end|>")})
    gen = json.loads((demo_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 1016]
    # bytes sit at 3 + byte value
    assert tok.encode("A") == [3 + ord("A")]
    # real merges were trained: common English words take fewer tokens than bytes
    text = "The question is about the document."
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_demo_vocab_sizes(tmp_path):
    assert build_byte_tokenizer(tmp_path / "a", vocab_size=512) == 512
    t = load_tokenizer(tmp_path / "a")
    assert t.vocab_size == 512 and t.token_id("<|fim_suffix|>") == 511
    with pytest.raises(TokenizerError, match="vocab_size"):
        build_byte_tokenizer(tmp_path / "b", vocab_size=MIN_DEMO_VOCAB - 1)


def test_demo_build_is_deterministic(demo_dir, tmp_path):
    names = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    build_byte_tokenizer(tmp_path / "again")
    # another process too: hash-map iteration order differs between processes
    code = "import sys, salabatch.demo.tokenizer as t; t.build_byte_tokenizer(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "other")], check=True)
    for name in names:
        ref = (demo_dir / name).read_bytes()
        assert (tmp_path / "again" / name).read_bytes() == ref, name
        assert (tmp_path / "other" / name).read_bytes() == ref, name
