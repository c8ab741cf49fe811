"""Choices scored by likelihood (`engine.choose`): each choice's tokens get the log-probabilities
one call over the whole prompt and choice gives them, dense and sparse, on both paths; a choice
is spelled as the tokenizer writes it mid-text; the pick is the most likely, or drawn by seed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine import memory
from salabatch.engine.choose import (
    choice_ids,
    choice_scores,
    pick,
    probabilities,
    spelled_choices,
)
from salabatch.engine.generate import prefill
from salabatch.engine.load import load_model
from salabatch.engine.tokenizer import load_tokenizer
from tests.engine.test_tokenizer import sentencepiece_style_dir
from tests.tiny import SPARSE_AT_256, SPARSE_AT_512, tiny_config_dict, write_tiny_checkpoint


def reference_logprobs(model, tok, prompt: list[int], choices: list[str]) -> list[float]:
    """Each choice's log-probability as the whole answer after `prompt`, from one float32 call
    over prompt, choice and end token: what choosing is checked against."""
    out = []
    for spelled in spelled_choices(tok, choices):
        logits = model(mx.array([prompt + spelled]), model.make_cache())[0].astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        out.append(sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(spelled)))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("c"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=n).tolist()


@pytest.mark.parametrize("doc_len", [100, 600], ids=["dense", "sparse"])
def test_choice_scores_are_one_calls_log_softmax(model, doc_len, engine_path):
    """Each choice's tokens, after a document prefix and its question's head, score what one
    call over document, head and choice gives them (float32), alternatives too, whatever the
    rows to a call (heads and choices of different lengths padded together, or each alone);
    the prefix is left as it was (a second scoring gives the same)."""
    doc = ids(doc_len, 1)
    asks = [(ids(7, 2), [ids(1, 3), ids(4, 4), ids(2, 5)]), (ids(3, 6), [ids(2, 7), ids(5, 8)])]
    base = model.make_cache()
    prefill(model, doc, base, 128)
    got = choice_scores(model, base, asks, top=3, rows=3)
    for (head, choices), per_choice in zip(asks, got, strict=True):
        for c, scores in zip(choices, per_choice, strict=True):
            whole = model(mx.array([doc + head + c]), model.make_cache())[0].astype(mx.float32)
            lp = np.array(whole - mx.logsumexp(whole, axis=-1, keepdims=True))
            at = len(doc) + len(head) - 1
            assert [x.token for x in scores] == c
            for i, x in enumerate(scores):
                assert x.logprob == pytest.approx(lp[at + i, c[i]], abs=2e-4)
                best = np.argsort(-lp[at + i], kind="stable")[:3].tolist()
                assert [t for t, _ in x.top] == best
    for rows in (1, 8):
        again = choice_scores(model, base, asks, rows=rows)
        flat = [x.logprob for q in again for s in q for x in s]
        assert flat == pytest.approx([x.logprob for q in got for s in q for x in s], abs=1e-5)
    with pytest.raises(ValueError, match="needs a head"):
        choice_scores(model, base, [([], asks[0][1])])


def test_no_call_feeds_more_than_a_chunk(model, monkeypatch):
    """`chunk` bounds each call's rows times its padded length (what a memory plan counts a
    call to take; 8 heads in one call took 1.26x the plan at the 9B's tiles): the calls split,
    the scores stay; a head or a choice longer than the chunk goes alone, chunk by chunk (a
    choice was fed whole). The head runs over `score_rows` positions at a time."""
    doc = ids(100, 1)
    asks = [(ids(n, 10 + n), [ids(1, 3), ids(6, 4), ids(2, 5)]) for n in (5, 9, 12, 30, 7)]
    asks[1][1].append(ids(45, 6))
    base = model.make_cache()
    prefill(model, doc, base, 128)
    whole = choice_scores(model, base, asks, rows=8, top=2)
    fed, hidden = [], model.hidden

    def counted(x, cache, *args, **kwargs):
        fed.append(x.shape[:2])
        return hidden(x, cache, *args, **kwargs)

    monkeypatch.setattr(model, "hidden", counted)
    monkeypatch.setattr(memory, "score_rows", lambda cfg: 4)
    split = choice_scores(model, base, asks, rows=8, top=2, chunk=20)
    assert max(n * T for n, T in fed) <= 20, fed
    assert (1, 10) in fed  # the 30-token head's last chunk
    assert (1, 4) in fed  # the 45-token choice's last: 44 tokens in chunks of 20
    assert len(fed) > 2  # without the bound: one call for the heads, one for the tails
    flat = [(x.token, x.logprob, x.top) for q in split for s in q for x in s]
    want = [(x.token, x.logprob, x.top) for q in whole for s in q for x in s]
    assert [x[0] for x in flat] == [x[0] for x in want]
    assert [x[1] for x in flat] == pytest.approx([x[1] for x in want], abs=1e-5)
    assert [[t for t, _ in x[2]] for x in flat] == [[t for t, _ in x[2]] for x in want]


def test_a_choice_below_dense_len_scores_as_one_dense_call_whatever_it_is_padded_with(
    tmp_path,
):
    """Choices padded to a longer one in a call: a row whose own tokens end below dense_len
    must run dense even where the padding reaches it (the mode is decided per row from its
    padded end: a short choice ran InfLLM-v2, 1.8e-2 off). Sparse from 512 tokens, where a
    query sees more blocks than it attends."""
    raw = tiny_config_dict(**SPARSE_AT_512)
    model = load_model(write_tiny_checkpoint(tmp_path / "m", raw), dtype="float32")
    doc = ids(502, 1)
    # heads end at 509 and 505; tails: (509, 3) crosses 512, (509, 1), (505, 1), (505, 4) not
    asks = [(ids(7, 2), [ids(1, 3), ids(4, 4), ids(2, 5)]), (ids(3, 6), [ids(2, 7), ids(5, 8)])]
    base = model.make_cache()
    prefill(model, doc, base, 128)
    got = choice_scores(model, base, asks, rows=3)
    alone = choice_scores(model, base, asks, rows=1)
    flat = [x.logprob for q in got for s in q for x in s]
    assert flat == pytest.approx([x.logprob for q in alone for s in q for x in s], abs=1e-5)
    for (head, choices), per_choice in zip(asks, got, strict=True):
        for c, scores in zip(choices, per_choice, strict=True):
            if len(doc + head + c) >= 512:
                continue  # one call would run the prefix sparse too: the rows=1 check above
            whole = model(mx.array([doc + head + c]), model.make_cache())[0].astype(mx.float32)
            lp = np.array(whole - mx.logsumexp(whole, axis=-1, keepdims=True))
            at = len(doc) + len(head) - 1
            want = [lp[at + i, t] for i, t in enumerate(c)]
            assert [x.logprob for x in scores] == pytest.approx(want, abs=2e-4)


def test_choice_ids_spell_the_choice_mid_text(tmp_path, tok):
    """The demo tokenizer (byte-level) spells a choice as it is; a SentencePiece one would put
    a space before a text's first word, so the choice is taken as spelled after a line break;
    a choice the vocabulary cannot spell alone gives None."""
    for tokenizer in (tok, load_tokenizer(sentencepiece_style_dir(tmp_path / "sp"))):
        for choice in ("yes", "not stated", "Doc."):
            got = choice_ids(tokenizer, choice)
            assert got and b"".join(tokenizer.token_bytes(t) for t in got) == choice.encode()
    sp = load_tokenizer(tmp_path / "sp")
    assert sp.encode("yes", special=False) != choice_ids(sp, "yes")  # "▁yes" alone


def test_pick_and_probabilities():
    """Temperature 0 picks the most likely (the first of equals); sampling draws by seed, the
    same each time, never a choice with no probability; probabilities sum to 1."""
    assert pick([-2.0, -0.5, -0.5], 0.0, 1) == 1
    assert sum(probabilities([-1.0, -2.0, -30.0])) == pytest.approx(1.0)
    draws = [pick([-0.7, -0.7, -1e9], 1.0, seed) for seed in range(200)]
    assert set(draws) == {0, 1} and draws == [pick([-0.7, -0.7, -1e9], 1.0, s) for s in range(200)]
    assert 60 < draws.count(0) < 140
    # any integer seeds a draw (a job's seed may be negative: NumPy refused it)
    assert {pick([-0.7, -0.7], 1.0, seed) for seed in range(-40, 0)} == {0, 1}


def test_a_head_fed_in_chunks_past_dense_len_scores_as_its_one_call(tmp_path):
    """A lone head longer than the chunk, crossing dense_len (512, where a chunk's mode
    shows): its chunks run sparse as its one call does (0.004 off, unplanned)."""
    raw = tiny_config_dict(**SPARSE_AT_512)
    model = load_model(write_tiny_checkpoint(tmp_path / "m", raw), dtype="float32")
    base = model.make_cache()
    prefill(model, ids(400, 1), base, 128)
    asks = [(ids(150, 2), [ids(1, 3), ids(3, 4)])]
    whole = choice_scores(model, base, asks)
    chunked = choice_scores(model, base, asks, chunk=16)
    flat = [x.logprob for q in chunked for s in q for x in s]
    assert flat == pytest.approx([x.logprob for q in whole for s in q for x in s], abs=1e-5)
