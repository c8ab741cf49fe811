"""The synthetic tasks: deterministic, split apart, rendered in the pipeline's chat format."""

import re
from math import prod

import pytest

from salabatch.errors import ConfigError
from salabatch.train import data, pools, symbolic
from salabatch.train.data import ALL_KINDS, EVAL, KINDS, TRAIN, TaskGenerator, encode_sample


def test_samples_are_deterministic_and_vary(tokenizer):
    a = TaskGenerator(tokenizer, seed=3)
    b = TaskGenerator(tokenizer, seed=3)
    assert [a.sample(i, 400) for i in range(6)] == [b.sample(i, 400) for i in range(6)]
    other = TaskGenerator(tokenizer, seed=4)
    assert a.sample(0, 400) != other.sample(0, 400)
    assert len({a.sample(i, 400).document for i in range(6)}) == 6


@pytest.mark.parametrize("kind", KINDS)
def test_answer_is_in_the_document_once_per_value(tokenizer, kind):
    gen = TaskGenerator(tokenizer, kinds=[kind], seed=1)
    for i in range(8):
        s = gen.sample(i, 600)
        assert s.kind == kind and s.answer in s.document and 0 <= s.depth <= 1
        if kind != "contract":  # fact values are distinct: the asked one appears once
            assert s.document.count(s.answer) == 1


def test_length_is_close_to_the_target(tokenizer):
    gen = TaskGenerator(tokenizer)
    for length in (300, 2500):
        n = [len(gen.encode(gen.sample(i, length)).ids) for i in range(4)]
        assert all(length * 0.9 <= x <= length * 1.1 for x in n), n


def test_split_pools_are_disjoint_and_cover_everything():
    for pool in (data.CODENAMES, data.FIRST_NAMES, data.VALUE_FORMATS):
        train, test = data.split_pool(pool, TRAIN), data.split_pool(pool, EVAL)
        assert not set(train) & set(test) and len(train) + len(test) == len(pool) and test
    with pytest.raises(ConfigError):
        data.split_pool(data.CODENAMES, "dev")


@pytest.mark.parametrize("name", ["QUESTIONS", "CONTRACT_QUESTIONS", "FACTS", "COMPANY_STEMS"])
def test_composed_pools_hold_out_whole_strings_but_no_part(name):
    pool = getattr(pools, name)
    train, test = data.split_pool(pool, TRAIN), data.split_pool(pool, EVAL)
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test) and len(train) == 3 * len(test)
    assert len(train) + len(test) == prod(len(part) for part in pool.parts)
    for part in pool.parts:  # every piece is seen in training, and some held-out string uses it
        for item in part:
            piece = item.split("{x}")[0]
            assert any(piece in s for s in train) and any(piece in s for s in test), piece


def _entities(text):
    names = (
        data.CODENAMES
        + data.FIRST_NAMES
        + data.LAST_NAMES
        + pools.CODE_SYLLABLES.split(True)
        + pools.CODE_SYLLABLES.split(False)
        + pools.COMPANY_STEMS.split(True)
        + pools.COMPANY_STEMS.split(False)
    )
    return {n for n in names if re.search(rf"\b{n}\b", text)}


def test_eval_samples_share_no_entity_question_or_format_with_training(tokenizer):
    train = [TaskGenerator(tokenizer, split=TRAIN).sample(i, 300) for i in range(60)]
    test = [TaskGenerator(tokenizer, split=EVAL).sample(i, 300) for i in range(60)]
    assert not {q.question for q in train} & {q.question for q in test}
    assert not set().union(*map(_entities, (s.question for s in train))) & set().union(
        *map(_entities, (s.question for s in test))
    )
    # eval fact values come only from the eval formats: 5 digits or ddd-ddd-ddd
    facts = [s.answer for s in test if s.kind != "contract"]
    assert facts and all(re.fullmatch(r"\d{5}|\d{3}-\d{3}-\d{3}", v) for v in facts)


def test_encoded_sample_is_the_run_prompt_then_answer_and_end_of_turn(tokenizer):
    s = TaskGenerator(tokenizer, seed=2).sample(0, 300)
    e = encode_sample(tokenizer, s)
    doc, suffix = tokenizer.split_chat_prompt(s.document, s.question, system=None, think=False)
    assert e.ids[: e.answer_start] == doc + suffix
    target = e.ids[e.answer_start :]
    assert target[-1] in tokenizer.eos_ids and target[-1] == tokenizer.token_id("<|im_end|>")
    assert tokenizer.decode(target[:-1]) == s.answer


def test_unknown_kind_is_refused(tokenizer):
    with pytest.raises(ConfigError, match="kinds"):
        TaskGenerator(tokenizer, kinds=["poem"])


def test_follow_up_turns_ask_other_facts_of_the_same_document(tokenizer):
    for kind in KINDS:
        gen = TaskGenerator(tokenizer, seed=5, turns=4, kinds=[kind])
        s = gen.sample(0, 500)
        asked = [(s.question, s.answer), *s.more]
        assert len(asked) == 4 and len({q for q, _ in asked}) == 4
        assert all(a in s.document for _, a in asked)
        text = tokenizer.decode(gen.encode(s).ids)
        assert all(q in text for q, _ in s.more)
    with pytest.raises(ConfigError, match="turns"):
        TaskGenerator(tokenizer, turns=7)


def test_recall_asks_every_fact_and_fills_the_length_with_facts(tokenizer):
    gen = TaskGenerator(tokenizer, seed=2, kinds=["recall"])
    for length, most in ((300, 3), (900, 9)):
        for i in range(4):
            s = gen.sample(i, length)
            asked = [(s.question, s.answer), *s.more]
            assert s.kind == "recall" and most - 1 <= len(asked) <= most
            assert all(s.document.count(a) == 1 for _, a in asked)
            e = gen.encode(s)
            assert len(e.targets) == len(asked) and 0.8 * length <= len(e.ids) <= 1.2 * length
            # answers are ≥ 5 % of the tokens (a needle sample of this length: ~2 %)
            assert sum(b - a for a, b in e.targets) >= 0.05 * len(e.ids)


def test_copy_answers_with_the_whole_document(tokenizer):
    for split in (TRAIN, EVAL):
        gen = TaskGenerator(tokenizer, split=split, seed=0, kinds=["copy"])
        s = gen.sample(0, 300)
        assert s.kind == "copy" and s.answer == s.document and len(s.document.split()) >= 16
        e = gen.encode(s)
        assert 0.85 * 300 <= len(e.ids) <= 1.15 * 300
        assert tokenizer.decode(e.ids[e.answer_start : -1]) == s.document
    assert {k for k in ALL_KINDS if k not in KINDS} == {"induction", "lookup", "recall", "copy"}


def test_induction_repeats_a_span_by_content_at_varying_distances(tokenizer):
    gen = TaskGenerator(tokenizer, seed=0, kinds=["induction", "needle"])
    symbols = {tokenizer.token_id(c) for c in symbolic.INDUCTION_SYMBOLS}
    digits = {tokenizer.token_id(c) for c in "0123456789"}
    distances, digits_only, samples = set(), 0, 0
    for i in range(40):
        e = gen.encoded(i, 64)
        if len(e.ids) != 64:  # a needle sample: the same as encode(sample)
            assert e == gen.encode(gen.sample(i, 64))
            continue
        ((start, stop),) = e.targets
        copy, span = start - 1, stop - start + 1
        assert set(e.ids) <= symbols and 8 <= span <= 16 and copy >= 32 and stop <= 64
        digits_only += set(e.ids) <= digits
        samples += 1
        # the repeat is an earlier span of the first half, symbol for symbol
        sources = [s for s in range(33 - span) if e.ids[s : s + span] == e.ids[copy:stop]]
        assert sources
        distances.add(copy - sources[0])
        assert e == gen.encoded(i, 64)  # deterministic
    assert len(distances) >= 10 and 0.25 < digits_only / samples < 0.75
    with pytest.raises(ConfigError, match="token ids"):
        next(gen.sample(i, 64) for i in range(40) if len(gen.encoded(i, 64).ids) == 64)
    with pytest.raises(ConfigError, match="at least 32"):
        TaskGenerator(tokenizer, kinds=["induction"]).encoded(0, 16)


def test_lookup_asks_keys_across_a_chat_turn_and_answers_with_their_values(tokenizer):
    gen = TaskGenerator(tokenizer, seed=0, kinds=["lookup"])
    for i in range(4):
        e = gen.encoded(i, 400)
        assert e == gen.encoded(i, 400) and len(e.ids) <= 400 and len(e.targets) == 6
        text = tokenizer.decode(e.ids)
        pairs = dict(p.split(" ") for p in text.split("\n<|im_start|>")[0].split(";") if p)
        assert len(pairs) >= 20 and all(len(k) == 2 and len(v) == 4 for k, v in pairs.items())
        for start, stop in e.targets:  # the key asked in the turn, then its value and the end
            key = tokenizer.decode(e.ids[:start]).rsplit("user\n", 1)[1].split("<|im_end|>")[0]
            answer = tokenizer.decode(e.ids[start:stop])
            assert answer == pairs[key] + "<|im_end|>"
    with pytest.raises(ConfigError, match="token ids"):
        gen.sample(0, 400)
    with pytest.raises(ConfigError, match="at least 300"):
        gen.encoded(0, 200)


def test_needle_document_puts_each_fact_at_its_depth(tokenizer):
    gen = TaskGenerator(tokenizer, split=EVAL, seed=0)
    depths = [0.1, 0.5, 0.9]
    samples = gen.needle_document(0, 2000, depths)
    doc = samples[0].document
    assert len({s.document for s in samples}) == 1 and [s.depth for s in samples] == depths
    for s in samples:
        assert doc.count(s.answer) == 1 and abs(doc.index(s.answer) / len(doc) - s.depth) < 0.1
    assert 1800 <= len(gen.encode(samples[0]).ids) <= 2300
    with pytest.raises(ConfigError, match="depths"):
        gen.needle_document(0, 2000, [1.5])


def test_held_out_answers_are_spelt_with_tokens_training_answers_use(tokenizer):
    """A held-out name or format is a new string, never a new token: a token that no training
    answer holds is one the model never learned to produce (" March" after a space, "Qu")."""

    def answer_tokens(split: str, n: int) -> set[int]:
        gen = TaskGenerator(tokenizer, split=split, seed=3, kinds=KINDS, turns=3)
        samples = (gen.sample(i, 700) for i in range(n))
        answers = (a for s in samples for _, a in ((s.question, s.answer), *s.more))
        return {t for a in answers for t in tokenizer.encode(a, special=False)}

    unseen = answer_tokens(EVAL, 400) - answer_tokens(TRAIN, 1500)
    assert not unseen, [tokenizer.decode([t]) for t in unseen]
