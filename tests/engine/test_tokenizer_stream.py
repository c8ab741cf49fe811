"""Streaming detokenizer: same text as a full decode, split characters held back."""

from __future__ import annotations

import pytest

from salabatch.engine.tokenizer import load_tokenizer
from tests.engine.test_tokenizer import TEXTS, check_stream, sentencepiece_style_dir


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_matches_decode_without_replacement_chars(tok, text):
    check_stream(tok, tok.encode(text, add_bos=True) + [tok.token_id("<|im_end|>")])


def test_streaming_holds_back_split_characters(tok):
    ids = tok.encode("a你")  # "你" is three byte tokens in the demo vocabulary
    assert len(ids) == 4
    det = tok.detokenizer()
    seen = []
    for i in ids:
        det.add_token(i)
        seen.append(det.last_segment)
    assert seen == ["a", "", "", "你"]


def test_streaming_cut_mid_character_flushes_like_decode(tok):
    ids = tok.encode("ok 你")[:-1]  # generation stopped inside the character
    det = tok.detokenizer()
    for i in ids:
        det.add_token(i)
    assert "\ufffd" not in det.text
    det.finalize()
    assert det.text == tok.decode(ids) and det.text.endswith("\ufffd")


def test_streaming_a_long_sequence_matches_decode(tok):
    ids = tok.encode(" ".join(TEXTS) * 4)
    det = tok.detokenizer()
    for i in ids:
        det.add_token(i)
    det.finalize()
    assert len(ids) > 300
    assert det.text == tok.decode(ids)


def test_streaming_skips_special_tokens_like_decode(tok):
    # the stop token comes last and adds no text: finalize has nothing to flush
    ids = tok.encode("ok 你", add_bos=True) + [tok.token_id("<|im_end|>")]
    det = tok.detokenizer(skip_special=True)
    for i in ids:
        det.add_token(i)
    det.finalize()
    assert det.text == tok.decode(ids, skip_special=True) == "ok 你"


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    """The SentencePiece-style tokenizer (byte fallback, a Strip decoder): MiniCPM's family."""
    return load_tokenizer(sentencepiece_style_dir(tmp_path_factory.mktemp("sp") / "sp"))


def _streamed(det, ids) -> list[str]:
    pieces = []
    for i in ids:
        det.add_token(i)
        pieces.append(det.last_segment)
    det.finalize()
    return [*pieces, det.last_segment]


@pytest.mark.parametrize(
    "pieces",
    [
        ["<0xC3>", "<0xA9>", "<0xE4>", "▁the"],  # "é", then a character cut off, then a word
        ["<0x41>", "<0xA9>", "."],  # a stray continuation byte
        ["▁the", "<0xE4>"],  # the answer ends inside a character
        ["<0xFF>", "<0xFE>", "a"],  # bytes UTF-8 never uses
    ],
)
def test_streaming_bytes_that_make_no_character_give_replacement_characters(sp, pieces):
    """A model may draw byte tokens that are no UTF-8: its answer decodes to U+FFFD there, as a
    whole decode gives it, never an error (one failed the whole batch's rows)."""
    ids = [sp.token_id(p) for p in pieces]
    det = sp.detokenizer()
    streamed = "".join(_streamed(det, ids))
    assert streamed == det.text and "\ufffd" in streamed
    # the characters the bytes make, as a lossy UTF-8 decode reads them
    raw = b"".join(
        bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.replace("▁", " ").encode()
        for p in pieces
    )
    lossy = raw.decode("utf-8", "replace").removeprefix(" ")
    assert streamed.replace("\ufffd", "") == lossy.replace("\ufffd", "")


def test_streaming_after_a_prompt_keeps_the_answers_leading_space(sp):
    """A text completion's answer continues its prompt: what it adds to the prompt's text, its
    first word's space included (a Strip decoder drops it from text decoded alone)."""
    prompt = sp.encode("Hello world and", add_bos=True)
    answer = [sp.token_id(p) for p in ("▁the", "▁a", ".")]
    whole = sp.decode(prompt + answer, skip_special=True)
    det = sp.detokenizer(skip_special=True, after=prompt)
    pieces = _streamed(det, answer)
    assert det.text == " the a." and det.tokens == answer
    assert sp.decode(prompt, skip_special=True) + "".join(pieces) == whole
    assert sp.decode(answer) == "the a."  # alone, as a chat answer is decoded


@pytest.mark.parametrize("prompt", ["日本", "x日本", "ab", "é日"])
def test_streaming_after_a_prompt_cut_inside_a_character_gives_the_answers_text(sp, prompt):
    """A prompt's last tokens may start inside a character spelled in byte tokens: the answer's
    text is still what it adds to the prompt's (its first bytes joined a run of bytes that was
    no UTF-8, and came out as U+FFFD)."""
    ids = sp.encode(prompt, add_bos=True)
    answer = [sp.token_id(f"<0x{b:02X}>") for b in "語".encode()] + [sp.token_id("a")]
    det = sp.detokenizer(skip_special=True, after=ids)
    pieces = _streamed(det, answer)
    whole, before = sp.decode(ids + answer, skip_special=True), sp.decode(ids, skip_special=True)
    assert det.text == whole[len(before) :] == "語a"
    assert "".join(pieces) == "語a"
