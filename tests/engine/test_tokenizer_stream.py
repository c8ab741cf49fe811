"""Streaming detokenizer: same text as a full decode, split characters held back."""

from __future__ import annotations

import pytest

from tests.engine.test_tokenizer import TEXTS, check_stream


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
