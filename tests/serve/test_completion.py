"""A completion's Job (prompt, boundaries at message ends) and its answer's text as it streams
(stop strings held back, the <think> block split off), on builtin:tiny's tokenizer."""

from __future__ import annotations

import pytest

from salabatch.engine.chat import split_thinking
from salabatch.engine.sampling import SamplingParams
from salabatch.openai_api import BodyError
from salabatch.serve.completion import (
    QUESTION_TAIL,
    AnswerText,
    LeadingIds,
    chat_job,
    text_job,
)
from salabatch.serve.engine import Finished


@pytest.fixture(scope="module")
def tok():
    import salabatch

    return salabatch.load("builtin:tiny")[1]


def finished(text: str | None = None) -> Finished:
    return Finished("stop", 1, 1, 0, text, 0.0, 0.0, 0.0, 0.0)


def stream(
    tok, text: str, *, stops=(), think=True, split=True, strip=True, engine_text=None
) -> dict:
    """What AnswerText sends for `text` fed a token at a time, per channel; every piece is
    checked to come only once its text is certain (no piece is ever taken back)."""
    answer = AnswerText(tok, stop_strings=stops, split_think=split, strip=strip, think=think)
    sent = {"reasoning": "", "content": ""}
    for token in tok.encode(text):
        for piece in answer.add(token):
            sent[piece.channel] += piece.text
    for piece in answer.finish(finished(engine_text)):
        sent[piece.channel] += piece.text
    assert (answer.content, answer.reasoning if think else "") == (
        sent["content"],
        sent["reasoning"],
    )
    return sent


@pytest.mark.parametrize(
    "text",
    [
        "  <think> hmm, let me see </think>\n\n The answer is 42.  ",
        "Acme Corp  ",
        "<thi",  # looked like a think block, was not
        "<think> cut at max_tokens  ",
        " plain <think> x</think>",  # not leading: all content
        "<think></think>",
        "",
    ],
)
def test_streamed_reasoning_and_content_are_split_thinking_of_the_whole(tok, text):
    reasoning, content = split_thinking(text)
    assert stream(tok, text) == {"reasoning": reasoning, "content": content}
    # without think the reasoning is dropped, as the Batch path drops it
    assert stream(tok, text, think=False) == {"reasoning": "", "content": content}
    # an answer held to a pattern keeps its own spaces (" Ireland " was sent as "Ireland")
    reasoning, content = split_thinking(text, strip=False)
    assert stream(tok, text, strip=False) == {"reasoning": reasoning, "content": content}
    assert content.strip() == split_thinking(text)[1]
    if not text.lstrip().startswith("<think>"):
        assert content == text


def test_nothing_of_a_think_block_is_sent_as_content_before_it_closes(tok):
    answer = AnswerText(tok, think=False)
    sent = [p for t in tok.encode("<think>secret plan") for p in answer.add(t)]
    assert sent == []


def test_stop_strings_are_held_back_until_they_cannot_start(tok):
    answer = AnswerText(tok, stop_strings=("END",), split_think=False)
    shown = ""
    for token in tok.encode("The answer EN"):
        shown += "".join(p.text for p in answer.add(token))
    assert shown == "The answer "  # "EN" may start "END": held
    for token in tok.encode("D and more"):
        shown += "".join(p.text for p in answer.add(token))
    assert shown == "The answer "  # it did: nothing from the stop string on
    shown += "".join(p.text for p in answer.finish(finished("The answer ")))
    assert shown == "The answer "


def test_held_text_that_was_no_stop_string_comes_at_the_end(tok):
    got = stream(tok, "The answer EN", stops=("END",), split=False)
    assert got["content"] == "The answer EN"


def test_chat_job_ends_prefixes_at_the_system_message_and_the_last_message(tok):
    system = {"role": "system", "content": "Document: a.txt\n\nThe Provider is Acme Corp."}
    turn = [system, {"role": "user", "content": "Who is the provider?"}]
    job = chat_job(tok, turn, think=False, params=SamplingParams(), max_tokens=8)
    assert list(job.prompt) == tok.chat_prompt_ids(turn, think=False)
    ends = [tok.chat_prompt_ids(turn[:k], think=False, add_generation_prompt=False) for k in (1, 2)]
    assert job.boundaries == (len(ends[0]), len(ends[1]))
    assert all(list(job.prompt[: len(e)]) == e for e in ends)
    assert job.stop == frozenset(tok.eos_ids) and job.max_tokens == 8
    # the next turn's prompt starts with this turn's messages: it can resume at their end
    later = [*turn, {"role": "assistant", "content": "Acme"}, {"role": "user", "content": "And?"}]
    following = chat_job(tok, later, think=False, params=SamplingParams(), max_tokens=8)
    assert following.prompt[: len(ends[1])] == tuple(ends[1])
    # no system message: only the end of the last message
    alone = chat_job(tok, turn[1:], think=False, params=SamplingParams(), max_tokens=8)
    assert len(alone.boundaries) == 1


def test_a_prompt_with_no_document_marked_off_has_a_boundary_before_its_tail(tok):
    """A raw prompt, or chat messages whose document is in the user message, has a boundary
    QUESTION_TAIL tokens before its end (where a question after the document is most often
    what the next prompt changes); chat messages with the document in a leading system message
    have that message's end instead; a prompt as short as the tail has none."""
    params = SamplingParams()
    document = "The Provider is Acme Corp. " * 60
    raw = text_job(tok, document + "Q: who is the provider? A:", params=params, max_tokens=4)
    assert raw.boundaries == (len(raw.prompt) - QUESTION_TAIL,)
    assert (
        text_job(tok, list(range(3, 3 + QUESTION_TAIL)), params=params, max_tokens=4).boundaries
        == ()
    )
    user = [{"role": "user", "content": document + "\n\nWho is the provider?"}]
    job = chat_job(tok, user, think=False, params=params, max_tokens=4)
    last = len(tok.chat_prompt_ids(user, think=False, add_generation_prompt=False))
    assert job.boundaries == (len(job.prompt) - QUESTION_TAIL, last)
    system = [{"role": "system", "content": document}, {"role": "user", "content": "Who?"}]
    job = chat_job(tok, system, think=False, params=params, max_tokens=4)
    ends = [
        tok.chat_prompt_ids(system[:k], think=False, add_generation_prompt=False) for k in (1, 2)
    ]
    assert job.boundaries == (len(ends[0]), len(ends[1]))


def test_leading_ids_give_the_same_jobs_and_tokenize_a_document_once(tok, monkeypatch):
    """Jobs made with a LeadingIds are those made without (prompt, boundaries), and their
    prompts those of the whole conversation tokenized at once, whatever the layout; across
    requests over one document its system message is tokenized once, and a document evicted
    past the cap is tokenized again."""
    doc = {"role": "system", "content": "Document: a.txt\n\n" + "The Provider is Acme Corp. " * 40}
    other = {"role": "system", "content": "Document: b.txt\n\n" + "The Client is Bolt Ltd. " * 40}
    user = {"role": "user", "content": "Who is the provider?"}
    layouts = [
        [doc, user],
        [doc, {"role": "system", "content": "Answer briefly."}, user],
        [user],
        [doc],
        [doc, user, {"role": "assistant", "content": "Acme"}, {"role": "user", "content": "And?"}],
    ]
    leading = LeadingIds(tok)
    for messages in layouts:
        for think in (False, True):
            want = chat_job(tok, messages, think=think, params=SamplingParams(), max_tokens=8)
            got = chat_job(
                tok,
                messages,
                think=think,
                params=SamplingParams(),
                max_tokens=8,
                leading_ids=leading,
            )
            assert (got.prompt, got.boundaries) == (want.prompt, want.boundaries), messages
            assert list(got.prompt) == tok.chat_prompt_ids(messages, think=think)

    encoded: list[str] = []  # which document each text the backend encodes holds
    real = tok.encode

    def counted(text, *args, **kw):
        encoded.extend(name for name in ("a.txt", "b.txt") if f"Document: {name}" in text)
        return real(text, *args, **kw)

    sizes = [
        len(tok.chat_prompt_ids([d], think=False, add_generation_prompt=False))
        for d in (doc, other)
    ]
    monkeypatch.setattr(tok, "encode", counted)
    leading = LeadingIds(tok, tokens=max(sizes))  # room for one document
    for system, question in [(doc, "Who?"), (doc, "When?"), (other, "Who?"), (doc, "Why?")]:
        messages = [system, {"role": "user", "content": question}]
        chat_job(
            tok, messages, think=False, params=SamplingParams(), max_tokens=8, leading_ids=leading
        )
    # a request encodes its own messages only, and its document when that is not held: a.txt
    # the first time and after b.txt took its place
    assert encoded == ["a.txt", "b.txt", "a.txt"]
    # without LeadingIds, once per request
    encoded.clear()
    chat_job(tok, [doc, user], think=False, params=SamplingParams(), max_tokens=8)
    assert encoded == ["a.txt"]


def test_text_job_takes_text_or_token_ids(tok):
    job = text_job(tok, "hello", params=SamplingParams(), max_tokens=4)
    assert list(job.prompt) == tok.encode("hello", add_bos=tok.add_bos_token)
    assert text_job(tok, [5, 6], params=SamplingParams(), max_tokens=4).prompt == (5, 6)
    with pytest.raises(BodyError) as e:
        text_job(tok, [5, tok.vocab_size], params=SamplingParams(), max_tokens=4)
    assert e.value.param == "prompt"


def test_a_text_completions_answer_continues_its_prompts_text(tmp_path):
    """With a SentencePiece-style tokenizer (MiniCPM's family; its decoder strips the text's
    first space) a text completion's answer keeps its first word's space: prompt + answer is
    the text of prompt + answer tokens. A chat answer is decoded alone."""
    from salabatch.engine.tokenizer import load_tokenizer
    from salabatch.serve.app import TextRequest
    from tests.engine.test_tokenizer import sentencepiece_style_dir

    sp = load_tokenizer(sentencepiece_style_dir(tmp_path / "sp"))
    job = text_job(sp, "Hello world and", params=SamplingParams(), max_tokens=4)
    assert job.continues
    answer = [sp.token_id(p) for p in ("▁the", "▁a", ".")]
    (text,) = TextRequest([job], 1, False, None, (), [""]).answers(sp)
    sent = "".join(p.text for t in answer for p in text.add(t))
    sent += "".join(p.text for p in text.finish(finished()))
    assert sent == text.content == " the a."
    assert sp.decode([*job.prompt, *answer], skip_special=True) == "Hello world and the a."
    chat = AnswerText(sp)
    for t in answer:
        chat.add(t)
    chat.finish(finished())
    assert chat.content == "the a."
