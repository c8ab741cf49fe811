"""Tokenizer: encode/decode, BOS, loading; and the data and helpers the other files share.

The other files: test_chat.py (chat prompts, document prompt split, templates, thinking),
test_chat_transformers.py (templates rendered by transformers and by us, compared),
test_tokenizer_stream.py (streaming) and tests/demo/test_tokenizer.py (the demo tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as Backend

from salabatch.demo.tokenizer import HEAD_TOKENS, TAIL_TOKENS, build_byte_tokenizer
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.errors import TokenizerError

TEXTS = [
    "",
    "The archive opened at nine.",
    "你好，世界！今天的天气很好。",  # CJK: 3-byte characters, unseen by the demo merges
    "مرحبا بالعالم",  # Arabic
    "emoji 🎉👩‍👩‍👧 and flags 🇫🇷",  # 4-byte characters, ZWJ sequence, regional indicators
    "e\u0301 a\u0308 n\u0303 \u1e9b\u0323",  # combining marks
    "line one\nline two\r\n\tpage\fbreak\x00nul",
    "  leading and trailing spaces  ",
    "mixed: The river 河 runs past النهر to the sea 🌊.",
]

SYSTEM, USER = "Be brief.", "Who signed?"

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] | upper }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def demo_tokenizer_dir(tmp_path_factory) -> Path:
    """A fresh build of the demo tokenizer (module-scoped `tok` fixtures start here)."""
    d = tmp_path_factory.mktemp("demo_tok")
    assert build_byte_tokenizer(d) == 1024
    return d


def messages(user=USER, system=SYSTEM):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def check_stream(tok, ids):
    det = tok.detokenizer()
    pieces = []
    for i in ids:
        det.add_token(i)
        pieces.append(det.last_segment)
    det.finalize()
    pieces.append(det.last_segment)
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) == det.text == tok.decode(ids)
    return pieces


# ---- encode / decode ----------------------------------------------------------------------


def sentencepiece_style_dir(dest: Path) -> Path:
    """A tiny legacy Llama-style tokenizer: Prepend("▁") normalizer, byte fallback, Strip decoder.

    MiniCPM's real tokenizer is of this family (SPEC §6); each backend split starts with "▁".
    """
    vocab = {t: i for i, t in enumerate(HEAD_TOKENS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,?!":
        vocab[ch] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("o", "c"), ("▁", "D")]
    merges += [("▁D", "oc"), ("u", "s"), ("▁", "u"), ("▁u", "s"), ("e", "r")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = [*HEAD_TOKENS, "<|im_end|>", "<|im_start|>"]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    dest.mkdir()
    backend.save(str(dest / "tokenizer.json"))
    im_end = backend.token_to_id("<|im_end|>")
    edit_json(dest / "tokenizer_config.json", add_bos_token=True, bos_token="<s>")
    edit_json(dest / "config.json", bos_token_id=1, eos_token_id=[2, im_end])
    return dest


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=True), skip_special=True) == text


def test_special_tokens_are_single_ids_and_optional(tok):
    for t in TAIL_TOKENS + HEAD_TOKENS:
        assert tok.encode(t) == [tok.token_id(t)]
    ids = tok.encode("a<|im_start|>user\nhi<|im_end|>")
    assert ids.count(tok.token_id("<|im_start|>")) == 1
    assert ids[-1] == tok.token_id("<|im_end|>")
    plain = tok.encode("a<|im_end|>b", special=False)
    assert tok.token_id("<|im_end|>") not in plain
    assert tok.decode(plain) == "a<|im_end|>b"


def test_bos_added_exactly_once(tok):
    # the backend's own post-processor would add <s>; we never let it run
    assert tok.backend.encode("hi").ids[0] == 1
    assert tok.encode("hi") == tok.backend.encode("hi", add_special_tokens=False).ids
    with_bos = tok.encode("hi", add_bos=True)
    assert with_bos == [1, *tok.encode("hi")]
    assert tok.encode("<s>hi", add_bos=True).count(1) == 1
    assert tok.encode("", add_bos=True) == [1]


def test_bad_ids_and_tokens_are_typed_errors(tok):
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        tok.token_id("<|no_such_token|>")


# ---- loading ------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_file_and_dir(tmp_path):
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    assert "missing tokenizer.json" in err.value.message and err.value.path == str(tmp_path)
    assert str(err.value).startswith(f"{tmp_path}: missing tokenizer.json")
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TokenizerError, match="tokenizer.model.*convert"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")


def test_eos_ids_union_of_generation_config_and_config(demo_copy):
    edit_json(demo_copy / "generation_config.json", eos_token_id=7)
    edit_json(demo_copy / "config.json", eos_token_id=[2, 1016], bos_token_id=1)
    (demo_copy / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    t = load_tokenizer(demo_copy)
    assert t.eos_ids == frozenset({2, 7, 1016})
    edit_json(demo_copy / "config.json", eos_token_id=[2, 99999])
    with pytest.raises(TokenizerError, match="eos_token_id"):
        load_tokenizer(demo_copy)
    for name in ("generation_config.json", "config.json"):
        (demo_copy / name).unlink()
    with pytest.raises(TokenizerError, match="no stop token"):
        load_tokenizer(demo_copy)
    edit_json(demo_copy / "tokenizer_config.json", eos_token="</s>")  # the last resort
    assert load_tokenizer(demo_copy).eos_ids == frozenset({2})


def test_added_token_disagreement_is_an_error(demo_copy):
    edit_json(
        demo_copy / "tokenizer_config.json",
        added_tokens_decoder={"1015": {"content": "<|im_end|>", "special": True}},
    )
    with pytest.raises(TokenizerError, match="disagrees"):
        load_tokenizer(demo_copy)


def test_added_tokens_decoder_of_another_type_is_an_error_naming_it(demo_copy):
    edit_json(demo_copy / "tokenizer_config.json", added_tokens_decoder=[{"content": "<x>"}])
    with pytest.raises(TokenizerError, match="bad value") as e:
        load_tokenizer(demo_copy)
    assert e.value.field == "added_tokens_decoder"
    assert e.value.path == str(demo_copy / "tokenizer_config.json")


def test_a_special_token_outside_the_vocabulary_names_the_file_that_gives_it(demo_copy):
    config = json.loads((demo_copy / "tokenizer_config.json").read_text())
    config.pop("bos_token", None)
    (demo_copy / "tokenizer_config.json").write_text(json.dumps(config))
    (demo_copy / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<bos>"}))
    with pytest.raises(TokenizerError, match="bos_token '<bos>' is not in the vocabulary") as e:
        load_tokenizer(demo_copy)
    assert e.value.path == str(demo_copy / "special_tokens_map.json")


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(demo_copy):
    """Ids past config.json's vocab_size would index past the embedding: loading refuses such a
    tokenizer (so `salabatch.load`, `generate` and `validate` all do); an equal or smaller
    tokenizer (a padded embedding) loads."""
    edit_json(demo_copy / "config.json", vocab_size=256)
    with pytest.raises(TokenizerError, match="1024 tokens, more than vocab_size 256") as e:
        load_tokenizer(demo_copy)
    assert e.value.path == str(demo_copy)
    for fits in (1024, 2048):
        edit_json(demo_copy / "config.json", vocab_size=fits)
        assert load_tokenizer(demo_copy).vocab_size == 1024


def test_fingerprint_tracks_tokenizer_files_only(demo_copy, tok):
    assert load_tokenizer(demo_copy).fingerprint == tok.fingerprint
    edit_json(demo_copy / "config.json", hidden_size=64)  # not a tokenizer field
    assert load_tokenizer(demo_copy).fingerprint == tok.fingerprint
    edit_json(demo_copy / "config.json", eos_token_id=[2])
    assert load_tokenizer(demo_copy).fingerprint != tok.fingerprint
    edit_json(demo_copy / "tokenizer_config.json", chat_template=TEMPLATE)
    assert len({load_tokenizer(demo_copy).fingerprint, tok.fingerprint}) == 2


def test_named_special_tokens_reach_the_chat_template(demo_copy):
    # as transformers passes them: standard names, other `*_token` entries, a mapping of extra
    # special tokens (not a list). A BOS named only by id (generation_config) is passed too, as
    # transformers' Llama tokenizer (MiniCPM's class) does with its default "<s>".
    edit_json(
        demo_copy / "tokenizer_config.json",
        bos_token=None,
        image_token={"content": "<|fim_middle|>", "special": True},
        extra_special_tokens={"audio_token": "<|fim_suffix|>"},
        additional_special_tokens=["<|tool_call|>"],
        chat_template="x{{ bos_token }}|{{ eos_token }}|{{ image_token }}|{{ audio_token }}"
        "|{{ additional_special_tokens is defined }}|{{ sep_token is defined }}",
    )
    t = load_tokenizer(demo_copy)
    assert t.bos_id == 1  # from generation_config.json
    text = t.chat_prompt([], think=True, add_generation_prompt=False)
    assert text == "x<s>|</s>|<|fim_middle|>|<|fim_suffix|>|False|False"


def test_a_template_that_writes_bos_keeps_it_whatever_add_bos_token_says(demo_copy):
    """transformers renders the template and encodes it without adding special tokens: a
    template writing `{{ bos_token }}` first gives BOS even with add_bos_token false; one that
    does not, none. Never twice."""
    plain = TEMPLATE.removeprefix("{{ bos_token }}")
    cases = [(TEMPLATE, True, True), (TEMPLATE, False, True), (plain, True, True)]
    cases += [(plain, False, False)]
    for template, add_bos, bos in cases:
        config = demo_copy / "tokenizer_config.json"
        edit_json(config, chat_template=template, add_bos_token=add_bos)
        t = load_tokenizer(demo_copy)
        ids = t.chat_prompt_ids(messages(), think=False)
        assert (ids[0] == t.bos_id, ids.count(t.bos_id)) == (bos, int(bos)), (template, add_bos)
        doc, suffix = t.split_chat_prompt("The doc.", "Who?", system=None, think=False)
        assert (doc[0] == t.bos_id) == bos
        assert not t.chat_prompt(messages(), think=False).startswith("<s>")


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_of_a_texts_ids_are_its_bytes(tok, text):
    """Byte-level vocabulary: a token cut inside a multi-byte character is its own bytes."""
    assert b"".join(tok.token_bytes(t) for t in tok.encode(text)) == text.encode()


def test_token_bytes_of_a_sentencepiece_vocabulary(tmp_path):
    """`▁` is a space, a byte-fallback token its byte, an added token its text."""
    tok = load_tokenizer(sentencepiece_style_dir(tmp_path / "sp"))
    text = "the Docs use ünïcode ✓ here"
    ids = tok.encode(text)
    assert any(tok.backend.id_to_token(t).startswith("<0x") for t in ids)  # byte fallback used
    assert b"".join(tok.token_bytes(t) for t in ids) == b" " + text.encode()  # Prepend("▁")
    assert tok.token_bytes(tok.token_id("<0x0A>")) == b"\n"
    assert tok.token_bytes(tok.token_id("<|im_end|>")) == b"<|im_end|>"
    with pytest.raises(TokenizerError):
        tok.token_bytes(tok.vocab_size + 5)
