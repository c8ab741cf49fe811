"""The HTTP server with the real `openai` client (sync, async, streaming) against a server
started here on 127.0.0.1 (uvicorn in a thread) over a real ServeEngine on builtin:tiny: answers,
streams, usage and cached tokens, concurrent clients, cancellation, auth, 429, bad bodies,
/metrics; and `salabatch serve` itself, as a process."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import uvicorn
from click.testing import CliRunner

from salabatch.cli import main
from salabatch.engine import generate as generate_module
from salabatch.engine import memory
from salabatch.engine.speculative import OFF, Speculation
from salabatch.errors import OutOfMemoryError
from salabatch.serve import app as app_module
from salabatch.serve import engine as engine_module
from salabatch.serve.app import create_app
from salabatch.serve.engine import ServeEngine
from tests import REPO

MODEL = "builtin:tiny"
KEY = "sk-test-key"
DOCS = REPO / "jobs" / "demo" / "docs"
MAX_BODY = 4 << 20
QUESTIONS = [
    "Give the service provider of this agreement.",
    "Tell me the Client in the contract.",
    "What is the total fee under the agreement?",
    "Find the commencement date.",
    "Look up the initial term of this agreement.",
    "Report the governing law in the contract.",
    "I need the payment period stated in the document.",
    "Who is the provider?",
]


class Served:
    """A uvicorn server in a thread over `create_app(engine, ...)`, on a socket bound here."""

    def __init__(self, engine: ServeEngine, tok, **app_settings) -> None:
        self.engine, self.tok = engine, tok
        app = create_app(engine, tok, model_id=MODEL, **app_settings)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=120)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self) -> Served:
        self.engine.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.close()
        self.sock.close()

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def raw(self, method: str, path: str, body=None, key: str | None = KEY):
        """(status, headers, body bytes) of a plain HTTP request (`key`: None sends none)."""
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, dict(response.getheaders()), data

    def metrics(self) -> dict[str, float]:
        status, _, data = self.raw("GET", "/metrics")
        assert status == 200
        return parse_metrics(data.decode())

    def wait_for(self, what, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while not (value := what()):
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.02)
        return value


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    """One server for most tests: batch 8, a prefix store, snapshots every 16 tokens (so the
    short conversations here keep theirs), the API key, a 4 MB body limit."""
    model, tok = tiny
    store = tmp_path_factory.mktemp("store")
    engine = ServeEngine(model, tok, batch_size=8, max_queue=64, store_dir=store, snapshot_min=16)
    with Served(engine, tok, api_key=KEY, max_body=MAX_BODY) as s:
        yield s


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (labels included, as written) → value; every line must be valid."""
    label = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'  # a quoted value holds any text
    sample = re.compile(
        rf"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{{{label}(?:,{label})*\}})?) (-?[0-9.e+-]+|\+Inf)$"
    )
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            assert re.fullmatch(r"# TYPE \S+ (counter|gauge|histogram)", line), line
            continue
        m = sample.match(line)
        assert m, line
        out[m[1]] = float(m[2])
    return out


def document(name: str) -> str:
    return (DOCS / name).read_text()


def system_turn(doc: str, question: str) -> list[dict]:
    return [
        {"role": "system", "content": f"Document: contract\n\n{doc}"},
        {"role": "user", "content": question},
    ]


def user_turn(doc: str, question: str) -> list[dict]:
    """The prompt builtin:tiny was trained on: the document, then the question, one message."""
    return [{"role": "user", "content": f"{doc}\n\n{question}"}]


# ---- answers -------------------------------------------------------------------------------


def test_models_and_health(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client().models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError):
        served.client().models.retrieve("gpt-4o")
    status, _, body = served.raw("GET", "/health", key=None)
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    context = served.engine.model.config.context_length
    assert models.data[0].model_extra["max_model_len"] == context


def test_tokenize_and_detokenize_as_the_completion_endpoints_read_prompts(served):
    """/tokenize gives a prompt's ids as /v1/completions prefills them (BOS where the tokenizer
    adds one; `add_special_tokens: false` without), messages' as chat renders them (with or
    without the generation prompt), the count and the context; /detokenize gives ids' text;
    both need the key, and a bad field is a 400 naming it."""
    tok = served.tok

    def post(path: str, body: dict, key: str | None = KEY):
        status, _, data = served.raw("POST", path, json.dumps(body).encode(), key=key)
        return status, json.loads(data)

    status, got = post("/tokenize", {"model": MODEL, "prompt": "The gate code is"})
    ids = tok.encode("The gate code is", add_bos=tok.add_bos_token)
    assert status == 200 and got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == served.engine.model.config.context_length
    bare = post("/tokenize", {"prompt": "The gate code is", "add_special_tokens": False})[1]
    assert bare["tokens"] == tok.encode("The gate code is")
    messages = [{"role": "user", "content": "Who is the provider?"}]
    chat = post("/tokenize", {"messages": messages})[1]
    assert chat["tokens"] == tok.chat_prompt_ids(messages, think=False)
    plain = post("/tokenize", {"messages": messages, "add_generation_prompt": False})[1]
    assert plain["tokens"] == tok.chat_prompt_ids(
        messages, think=False, add_generation_prompt=False
    )
    status, text = post("/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and text["prompt"] == tok.decode(ids)
    assert post("/tokenize", {"prompt": "x"}, key=None)[0] == 401
    for path, body, param in (
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"model": "gpt-4o", "tokens": [1]}, "model"),
    ):
        status, error = post(path, body)
        assert status in (400, 404) and error["error"]["param"] == param, (path, body, error)


def test_chat_answer_usage_and_a_second_turn_resumes_from_the_first(served):
    client, tok = served.client(), served.tok
    doc = "Second-turn test. " + document("redwater-robotics.txt")
    turn = system_turn(doc, QUESTIONS[0])
    first = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=16)
    assert first.object == "chat.completion" and first.model == MODEL
    assert first.id.startswith("chatcmpl-")
    (choice,) = first.choices
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert first.usage.prompt_tokens == len(tok.chat_prompt_ids(turn, think=False))
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a document never seen
    assert first.usage.completion_tokens >= 1
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens

    following = [
        *turn,
        {"role": "assistant", "content": choice.message.content},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    second = client.chat.completions.create(model=MODEL, messages=following, max_tokens=16)
    first_messages = tok.chat_prompt_ids(turn, think=False, add_generation_prompt=False)
    # the first turn's messages come from its snapshot: only the rest is prefilled
    assert second.usage.prompt_tokens_details.cached_tokens >= len(first_messages)
    assert second.usage.prompt_tokens == len(tok.chat_prompt_ids(following, think=False))

    # another conversation over the same document: the document is not prefilled again
    other = client.chat.completions.create(
        model=MODEL, messages=system_turn(doc, QUESTIONS[2]), max_tokens=4
    )
    system_ids = tok.chat_prompt_ids(turn[:1], think=False, add_generation_prompt=False)
    assert other.usage.prompt_tokens_details.cached_tokens >= len(system_ids)


def test_a_stream_is_the_answer_in_chunks_then_usage_then_done(served):
    client = served.client()
    messages = user_turn(document("redwater-robotics.txt"), QUESTIONS[3])
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == []  # include_usage: one last chunk with the usage
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True})
    status, headers, data = served.raw("POST", "/v1/chat/completions", body.encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = data.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


def test_a_long_prefill_streams_keep_alive_comments_before_the_first_event(served, monkeypatch):
    """Nothing comes while a long document prefills: SSE comments keep the connection (a proxy
    cuts one idle for a minute), which the client skips; the answer is the one not streamed."""
    from salabatch.serve import app

    monkeypatch.setattr(app, "KEEP_ALIVE_S", 0.05)
    long = "\n\n".join([document("redwater-robotics.txt")] * 8)  # ~5K tokens, a new prefix
    messages = user_turn(long + "\n\nAgain:", QUESTIONS[3])
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True})
    status, _, data = served.raw("POST", "/v1/chat/completions", body.encode())
    events = data.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""]
    assert all(e in (": keep-alive", "") or e.startswith("data: ") for e in events)
    # the first chunk (the role) at once, then comments until the first token's
    sent = [i for i, e in enumerate(events) if e.startswith("data: ")]
    assert events[sent[0] + 1 : sent[1]] and set(events[sent[0] + 1 : sent[1]]) == {": keep-alive"}
    client = served.client()
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert text == whole.choices[0].message.content


def test_a_fault_mid_stream_ends_it_with_an_error_event_and_done(served, monkeypatch, caplog):
    """A fault of the server's own after the 200 went out (a bug in a chunk's making) is logged
    and sent as an error event, then [DONE]: the client's SDK raises it, where a cut connection
    left it a connection error; the next request is served."""
    from salabatch.serve.completion import AnswerText

    def boom(self, token, logprob=None):
        raise RuntimeError("a bug")

    messages = user_turn(document("redwater-robotics.txt"), QUESTIONS[3])
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True})
    with monkeypatch.context() as patched:
        patched.setattr(AnswerText, "add", boom)
        status, _, data = served.raw("POST", "/v1/chat/completions", body.encode())
        events = data.decode().split("\n\n")
        assert status == 200 and events[-2:] == ["data: [DONE]", ""]
        error = json.loads(events[-3].removeprefix("data: "))["error"]
        assert error["code"] == "internal_error" and "(RuntimeError)" in error["message"]
        assert "a stream failed" in caplog.text and "a bug" in caplog.text
        with pytest.raises(openai.APIError, match="internal server error"):
            list(
                served.client().chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=4, stream=True
                )
            )
    whole = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert whole.choices[0].finish_reason in ("stop", "length")


def test_stop_strings_end_the_answer_before_them_streamed_or_not(served):
    client = served.client()
    messages = user_turn(document("redwater-robotics.txt"), QUESTIONS[2])
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    text = answer.choices[0].message.content
    assert len(text) >= 6, text
    stop = text[3:6]
    expected = text[: text.find(stop)].strip()
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stop=stop)
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (expected, "stop")
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected


def test_text_completions_streamed_or_not(served):
    client = served.client()
    whole = client.completions.create(model=MODEL, prompt="The gate code is", max_tokens=12)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    prompt_ids = served.tok.encode("The gate code is", add_bos=True)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The gate code is", max_tokens=12, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=12)
    assert by_ids.choices[0].text == whole.choices[0].text


def test_n_choices_are_the_answers_of_seeds_seed_to_seed_plus_n_from_one_prefill(served):
    """n = 3 at temperature 2: choice i is the answer of the same request with seed 7 + i
    alone; the prompt is prefilled once (the other two resume from its snapshot), and usage
    counts it once, the completion tokens of all three."""
    client = served.client()
    messages = user_turn("Three choices. " + document("redwater-robotics.txt"), QUESTIONS[4])
    prompt = len(served.tok.chat_prompt_ids(messages, think=False))
    hot = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 2.0}
    before = served.engine.stats()
    many = client.chat.completions.create(**hot, seed=7, n=3)
    after = served.engine.stats()
    assert after["prefill_tokens_total"] - before["prefill_tokens_total"] == prompt
    assert after["prefix_hits_memory_total"] - before["prefix_hits_memory_total"] == 2
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**hot, seed=7 + i) for i in range(3)]
    texts = [c.message.content for c in many.choices]
    assert texts == [a.choices[0].message.content for a in alone]
    assert len(set(texts)) > 1  # seeds apart: not one answer thrice
    finishes = [a.choices[0].finish_reason for a in alone]
    assert [c.finish_reason for c in many.choices] == finishes
    assert (
        many.usage.prompt_tokens == prompt and many.usage.prompt_tokens_details.cached_tokens == 0
    )
    completion = sum(a.usage.completion_tokens for a in alone)
    assert many.usage.completion_tokens == completion
    assert many.usage.total_tokens == prompt + completion


def test_n_choices_stream_by_index_chat_and_text(served):
    """Streamed, each choice's chunks carry its index: a role chunk first, its text, one
    finish_reason; the usage chunk comes last, after every choice finished. The same for text
    completions."""
    client = served.client()
    messages = user_turn(document("brightgate-systems.md"), QUESTIONS[5])
    hot = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 2.0, "seed": 3}
    whole = client.chat.completions.create(**hot, n=2)
    assert whole.choices[0].message.content != whole.choices[1].message.content
    chunks = list(
        client.chat.completions.create(
            **hot, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    text = {"model": MODEL, "prompt": "The gate code is", "max_tokens": 8, "temperature": 2.0}
    whole = client.completions.create(**text, seed=5, n=2)
    assert [c.index for c in whole.choices] == [0, 1] and whole.choices[0].text != whole.choices[
        1
    ].text
    alone = [client.completions.create(**text, seed=5 + i).choices[0].text for i in range(2)]
    assert [c.text for c in whole.choices] == alone
    streamed = ["", ""]
    chunks = list(
        client.completions.create(
            **text, seed=5, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    for c in chunks[:-1]:
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == alone
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_logprobs_streamed_or_not_with_bytes_and_alternatives(served):
    """Greedy with logprobs and top_logprobs 3: one entry per answer token, its bytes those
    of the answer's text, its token the most likely of its alternatives (sorted, ≤ 0); the
    streamed entries, in order, are the same; without logprobs, none."""
    client = served.client()
    messages = user_turn(document("redwater-robotics.txt"), QUESTIONS[6])
    ask = {"model": MODEL, "messages": messages, "max_tokens": 10}
    whole = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    text = b"".join(bytes(e.bytes) for e in content).decode()
    assert text.strip() == whole.choices[0].message.content
    for e in content:
        top = e.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted(t.logprob for t in top)[::-1]
        assert (e.token, e.logprob) == (top[0].token, top[0].logprob) and e.logprob <= 0
    chunks = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, stream=True)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert client.chat.completions.create(**ask).choices[0].logprobs is None
    bare = client.chat.completions.create(**ask, logprobs=True).choices[0].logprobs.content
    assert [(e.token, e.top_logprobs) for e in bare] == [(e.token, []) for e in content]


def test_text_completion_logprobs_in_openais_legacy_form_streamed_or_not(served):
    """`logprobs: 2`: per token its text, log-probability, the alternatives and itself as
    {text: logprob}, and where its text starts in the completion; streamed, the same lists in
    pieces; the log-probabilities are the chat form's for the same tokens."""
    client = served.client()
    ask = {"model": MODEL, "prompt": "The gate code is", "max_tokens": 12}
    whole = client.completions.create(**ask, logprobs=2)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == whole.usage.completion_tokens == len(lp.token_logprobs)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value == max(top.values()) and 1 <= len(top) <= 3  # greedy
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in client.completions.create(**ask, logprobs=2, stream=True):
        if c.choices[0].logprobs is not None:
            for key, values in streamed.items():
                values.extend(getattr(c.choices[0].logprobs, key))
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert client.completions.create(**ask).choices[0].logprobs is None
    # echoed, each token's text starts at its offset in the text; BOS, which the text leaves
    # out, takes no characters (every offset was 3 past its token: an audit)
    echoed = client.completions.create(**ask, logprobs=1, echo=True).choices[0]
    lp = echoed.logprobs
    assert lp.tokens[0] == "<s>" and echoed.text.startswith(ask["prompt"])
    for token, at in zip(lp.tokens[1:], lp.text_offset[1:], strict=True):
        assert echoed.text[at : at + len(token)] == token, (token, at)
    for bad in (True, -1, 21, 1.5):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**ask, logprobs=bad)
        assert e.value.body["param"] == "logprobs"


def test_echo_scores_the_prompt_as_decoding_scored_the_answer(served):
    """`echo` with `logprobs` and max_tokens 0 (how lm-eval-harness asks for a loglikelihood):
    the text is the prompt, its first token has no log-probability (null) and each later one
    has what decoding gave it as an answer token, alternatives too. With max_tokens the answer
    follows, its logprobs after the prompt's, streamed or not alike; without logprobs, echo
    only puts the prompt before the answer."""
    from dataclasses import replace

    from salabatch.engine.sampling import SamplingParams
    from salabatch.serve.completion import text_job
    from salabatch.serve.engine import Token

    client, tok = served.client(), served.tok
    prompt = tok.encode("The gate code is", add_bos=tok.add_bos_token)
    job = text_job(tok, prompt, params=SamplingParams(), max_tokens=6)
    decoded = [e for e in served.engine.submit(replace(job, logprobs=2)) if isinstance(e, Token)]
    answer = [e.token for e in decoded]
    text = tok.decode(prompt + answer, skip_special=True)
    ask = {"model": MODEL, "prompt": prompt + answer, "max_tokens": 0, "logprobs": 2}
    scored = client.completions.create(**ask, echo=True)
    choice, n = scored.choices[0], len(prompt)
    assert choice.text == text and choice.finish_reason == "length"
    assert scored.usage.prompt_tokens == n + 6 and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == n + 6
    assert lp.token_logprobs[n:] == pytest.approx([e.logprob.logprob for e in decoded], abs=1e-4)
    for i, e in enumerate(decoded):
        alternatives = {tok.token_bytes(t).decode() for t, _ in e.logprob.top}
        assert lp.top_logprobs[n + i].keys() == alternatives | {lp.tokens[n + i]}
    # lm-eval-harness's body: prompts as a list of token lists, max_tokens 1, logprobs 1
    body = {"model": MODEL, "prompt": [prompt + answer], "max_tokens": 1, "logprobs": 1}
    status, _, data = served.raw("POST", "/v1/completions", json.dumps(body | {"echo": True}))
    assert status == 200
    got = json.loads(data)["choices"][0]["logprobs"]
    assert got["token_logprobs"][n:-1] == pytest.approx(lp.token_logprobs[n:], abs=1e-5)
    pairs = zip(got["token_logprobs"][n:-1], got["top_logprobs"][n:-1], strict=True)
    assert all(v == max(top.values()) for v, top in pairs)  # lm-eval's is_greedy: decoding's
    # with an answer: the prompt's entries, then the answer's, streamed or not
    ask = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "logprobs": 1, "echo": True}
    whole = client.completions.create(**ask).choices[0]
    assert whole.text.startswith("The gate code is") and len(whole.logprobs.tokens) == n + 4
    assert whole.logprobs.token_logprobs[n:] == pytest.approx(
        [e.logprob.logprob for e in decoded[:4]], abs=1e-4
    )
    streamed, lps = "", []
    for c in client.completions.create(**ask, stream=True):
        streamed += c.choices[0].text
        if c.choices[0].logprobs is not None:
            lps += c.choices[0].logprobs.token_logprobs
    assert streamed == whole.text and lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
    plain = client.completions.create(**ask | {"logprobs": None}).choices[0]
    assert plain.text == whole.text and plain.logprobs is None
    chunks = [
        c.choices[0].text
        for c in client.completions.create(**ask | {"logprobs": None}, stream=True)
    ]
    assert chunks[0] == tok.decode(prompt, skip_special=True) and "".join(chunks) == whole.text


def test_choices_over_one_context_score_it_once(served):
    """lm-eval-harness's loglikelihood over a long context: one request, a prompt (token ids)
    per choice, context + choice each. The first prompt is scored whole and held with its
    scores before its tail; the others resume there (usage's cached tokens) and score only
    their own tokens; every choice's logprobs are its prompt's scored whole."""
    from salabatch.engine.generate import Prefill
    from salabatch.serve.completion import QUESTION_TAIL

    client, tok = served.client(), served.tok
    context = tok.encode("The Provider is Acme Corp. " * 80 + "Who is the provider?", add_bos=True)
    prompts = [context + tok.encode(f" {name}") for name in ("Acme", "Bolt", "Cobalt")]
    ask = {"model": MODEL, "prompt": prompts, "max_tokens": 0, "logprobs": 1, "echo": True}
    got = client.completions.create(**ask)
    cached = got.usage.prompt_tokens_details.cached_tokens
    assert cached >= 2 * (len(prompts[0]) - QUESTION_TAIL)
    for choice, prompt in zip(got.choices, prompts, strict=True):
        feed = Prefill(served.engine.model, prompt, served.engine.model.make_cache(), score=1)
        while not feed.finished:
            feed.step()
        assert choice.logprobs.token_logprobs[0] is None
        want = [x.logprob for x in feed.scores()]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


def test_logit_bias_forces_a_token_chat_and_text(served):
    """+100 on one token makes a greedy answer all that token, in a completion and a chat
    answer (what -100 does is the engine's test: tests/engine/test_generate.py)."""
    client, tok = served.client(), served.tok
    token = tok.encode("Q")[-1]
    forced = client.completions.create(
        model=MODEL, prompt="The gate code is", max_tokens=5, logit_bias={str(token): 100}
    )
    assert forced.choices[0].text == tok.decode([token] * 5)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Who?"}], "max_tokens": 6}
    chat = client.chat.completions.create(**ask, logit_bias={str(token): 100})
    assert chat.choices[0].message.content == tok.decode([token] * 6).strip()


def test_a_list_of_prompts_answers_each_n_times_in_order(served):
    """`prompt` as a list (strings or token lists) with n 2: choice p·n + j is prompt p's j-th
    answer (seed + j), the same as asking for prompt p alone; usage counts every prompt."""
    client = served.client()
    prompts = ["The gate code is", "Who is the provider?"]
    ask = {"model": MODEL, "max_tokens": 5, "temperature": 1.0, "seed": 7, "n": 2}
    both = client.completions.create(prompt=prompts, **ask)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(prompt=p, **ask) for p in prompts]
    assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = served.tok.encode(prompts[1], add_bos=served.tok.add_bos_token)
    mixed = client.completions.create(prompt=[prompts[0], ids], **ask | {"n": 1})
    assert [c.text for c in mixed.choices] == [a.choices[0].text for a in alone]


def test_response_format_and_guided_fields_constrain_the_answer(served):
    """json_schema: the answer parses and has the required fields, streamed or not alike;
    json_object: a JSON object; vLLM's guided_choice, guided_regex: one of the choices, a
    match (completions too); two at once, an unknown type, a schema outlines-core cannot use:
    400 naming the field."""
    client = served.client()
    messages = user_turn(document("redwater-robotics.txt"), QUESTIONS[0])
    ask = {"model": MODEL, "messages": messages, "max_tokens": 60}
    schema = {
        "type": "object",
        "properties": {"provider": {"type": "string", "maxLength": 40}},
        "required": ["provider"],
    }
    shaped = {"type": "json_schema", "json_schema": {"name": "who", "schema": schema}}
    whole = client.chat.completions.create(**ask, response_format=shaped)
    assert whole.choices[0].finish_reason == "stop"
    assert set(json.loads(whole.choices[0].message.content)) == {"provider"}
    streamed = client.chat.completions.create(**ask, response_format=shaped, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content
    anything = client.chat.completions.create(**ask, response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    choice = ["yes", "no", "not stated"]
    picked = client.chat.completions.create(**ask, extra_body={"guided_choice": choice})
    assert picked.choices[0].message.content in choice
    # a choice's own spaces and newlines are its text: a chat answer was stripped (no choice)
    spaced = [" Ireland ", "\nFrance\n"]
    for stream in (False, True):
        got = client.chat.completions.create(
            **ask, extra_body={"guided_choice": spaced}, stream=stream
        )
        if stream:
            got = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
        else:
            got = got.choices[0].message.content
        assert got in spaced, (stream, got)
    code = client.completions.create(
        model=MODEL,
        prompt="The gate code is",
        max_tokens=12,
        extra_body={"guided_regex": "[0-9]{4}"},
    )
    assert (
        re.fullmatch("[0-9]{4}", code.choices[0].text) and code.choices[0].finish_reason == "stop"
    )
    for extra, param in (
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_json": {"type": "object", "properties": 5}}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**ask, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body


def test_16_concurrent_streaming_clients_each_get_the_answer_they_get_alone(served):
    """Greedy: the same text whatever else is in the batch. Half the clients share a document
    in their system message (forks of one held prefix, one group), half send their own."""
    docs = [document("redwater-robotics.txt"), document("brightgate-systems.md")]
    requests = [system_turn(docs[0], q) for q in QUESTIONS] + [
        user_turn(docs[1], q) for q in QUESTIONS
    ]

    async def ask(client, messages) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> tuple[list[str], list[str], float]:
        async with served.async_client() as client:
            alone = [await ask(client, m) for m in requests]
            rows, done = [], False

            async def watch() -> None:
                while not done:
                    rows.append(served.engine.stats()["running_rows"])
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            together = await asyncio.gather(*(ask(client, m) for m in requests))
            done = True
            await watcher
        return alone, together, max(rows)

    alone, together, most_rows = asyncio.run(main())
    assert together == alone
    assert len(set(alone)) > 1  # the answers differ: no client got another's
    assert most_rows > 1  # they did decode together


def test_concurrent_clients_over_a_held_document_prefill_together_as_alone(tiny, monkeypatch):
    """Snapshots at their default spacing (256 tokens), so no question is held after it is
    answered: 8 streaming clients asking of one held document at once have their questions
    prefilled together (padded calls of several rows), and each gets the answer it gets alone."""
    sizes: list[int] = []
    real = generate_module.prefill_forks

    def counted(model, prefix, prompts):
        sizes.append(len(prompts))
        return real(model, prefix, prompts)

    monkeypatch.setattr(generate_module, "prefill_forks", counted)
    model, tok = tiny
    doc = document("redwater-robotics.txt")
    requests = [system_turn(doc, q) for q in QUESTIONS]

    async def ask(client, messages) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main(s: Served) -> tuple[list[str], list[str], list[int]]:
        async with s.async_client() as client:
            alone = [await ask(client, m) for m in requests]  # the first prefills the document
            apart = list(sizes)
            together = await asyncio.gather(*(ask(client, m) for m in requests))
        return alone, together, apart

    with Served(ServeEngine(model, tok, batch_size=8), tok, api_key=KEY) as s:
        alone, together, apart = asyncio.run(main(s))
    assert together == alone
    assert apart == [1] * 7  # alone: batches of one
    assert sum(sizes[7:]) == 8 and max(sizes[7:]) > 1, sizes


# ---- cancellation --------------------------------------------------------------------------


def test_a_client_that_disconnects_cancels_its_job(served):
    """A stream closed after three chunks, and a non-streamed request whose socket closes,
    both of an answer of 5,000 tokens (the prompt "x" runs to max_tokens): each job ends
    cancelled at once, its row gone, far short of its tokens."""
    before = served.engine.stats()
    stream = served.client().completions.create(
        model=MODEL, prompt="x", max_tokens=5000, stream=True
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    cancelled = before["requests_cancelled_total"] + 1
    served.wait_for(lambda: served.engine.stats()["requests_cancelled_total"] >= cancelled)

    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 5000}).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        served.wait_for(lambda: served.engine.stats()["running_rows"] >= 1)
    served.wait_for(lambda: served.engine.stats()["requests_cancelled_total"] >= cancelled + 1)
    after = served.wait_for(
        lambda: (s := served.engine.stats())["running_rows"] == 0 and s["prefilling"] == 0 and s
    )
    assert after["completion_tokens_total"] - before["completion_tokens_total"] < 2 * 5000


# ---- refusals ------------------------------------------------------------------------------


def test_auth_every_endpoint_but_health_needs_the_key(served):
    with pytest.raises(openai.AuthenticationError) as e:
        served.client("wrong-key").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path in ("/metrics", "/v1/models", "/nowhere"):
        for key in (None, "wrong-key", ""):
            status, _, data = served.raw("GET", path, key=key)
            assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"
    status, _, _ = served.raw("POST", "/v1/chat/completions", b"{}", key=KEY[:-1])
    assert status == 401
    assert served.raw("GET", "/health", key=None)[0] == 200


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"n": 73}, "n"),  # past batch_size 8 + max_queue 64
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"stream": True, "stream_options": {"sideways": True}}, "stream_options.sideways"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"messages": []}, "messages"),
        ({"temperature": 10**400}, "temperature"),  # an integer past float's range: was a 500
        ({"n": 10**400}, "n"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(served, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body |= fields
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(**{"model": MODEL, "messages": []}, extra_body=body)
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and param.split("[")[0] in error["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),  # without echo
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [["a"]]}, "prompt"),
        ({"prompt": ["ok", 3]}, "prompt"),
        ({"prompt": ["ok", "a\ud800"]}, "prompt[1]"),
        ({"prompt": ["a"] * 37, "n": 2}, "prompt"),  # 74 answers: past batch_size 8 + 64
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_a_bad_completion_field_is_a_400_naming_it(served, fields, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2} | fields
    status, _, data = served.raw("POST", "/v1/completions", json.dumps(body).encode())
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == param, error


def test_unknown_model_or_route_is_a_404_body_too_large_a_413(served):
    with pytest.raises(openai.NotFoundError) as e:
        served.client().chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
    assert (e.value.body["code"], e.value.body["param"]) == ("model_not_found", "model")
    status, _, data = served.raw("GET", "/v1/nowhere")
    assert status == 404 and json.loads(data)["error"]["code"] == "not_found"
    status, headers, data = served.raw("GET", "/v1/chat/completions")
    assert status == 405 and "error" in json.loads(data) and headers["allow"] == "POST"

    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY}).encode()
    status, _, data = served.raw("POST", "/v1/completions", big)  # Content-Length says so
    assert status == 413 and json.loads(data)["error"]["code"] == "request_too_large"
    chunked = (big[i : i + 65536] for i in range(0, len(big), 65536))  # no Content-Length
    status, _, data = served.raw("POST", "/v1/completions", chunked)
    assert status == 413 and json.loads(data)["error"]["code"] == "request_too_large"

    status, _, data = served.raw("POST", "/v1/completions", b'{"prompt": "x"}')  # no model
    assert status == 400 and json.loads(data)["error"]["param"] == "model"
    digits = b'{"model": "m", "prompt": "x", "seed": ' + b"9" * 5000 + b"}"  # past 4,300 digits
    for bad in (b"{not json", b"[1, 2]", digits):
        status, _, data = served.raw("POST", "/v1/chat/completions", bad)
        assert status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"


def test_text_utf8_cannot_hold_is_a_400_naming_its_field(served):
    """JSON can carry a lone surrogate (`"\\ud800"`); no tokenizer takes it."""
    user = {"role": "user", "content": "a\ud800b"}
    for path, body, param in (
        ("/v1/chat/completions", {"messages": [user]}, "messages[0].content"),
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": "ab", "stop": ["\udc80"]}, "stop"),
    ):
        body = json.dumps({"model": MODEL, "max_tokens": 2, **body}).encode()
        status, _, data = served.raw("POST", path, body)
        error = json.loads(data)["error"]
        assert (status, error["param"]) == (400, param) and "surrogate" in error["message"], error


def test_a_fault_of_the_server_is_a_500_error_object(served, monkeypatch):
    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(served.engine, "stats", broken)
    status, _, data = served.raw("GET", "/metrics")
    error = json.loads(data)["error"]
    assert (status, error["type"], error["code"]) == (500, "server_error", "internal_error")
    assert "RuntimeError" in error["message"]


def test_a_prompt_longer_than_the_context_is_a_400_before_any_stream(served):
    context = served.engine.model.config.context_length
    body = {"model": MODEL, "prompt": [5] * context, "max_tokens": 1, "stream": True}
    status, _, data = served.raw("POST", "/v1/completions", json.dumps(body).encode())
    error = json.loads(data)["error"]
    assert (status, error["code"], error["param"]) == (400, "context_length_exceeded", "prompt")


def test_a_full_queue_answers_429(tiny):
    """One row decoding, one waiting: of 6 clients at once, those past them get 429 at once."""
    model, tok = tiny
    engine = ServeEngine(model, tok, batch_size=1, max_queue=1)

    async def ask(client) -> str:
        try:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=400)
        except openai.RateLimitError as e:
            assert e.body["code"] == "queue_full" and e.body["type"] == "rate_limit_error"
            return "429"
        return "ok"

    async def main(s: Served) -> list[str]:
        async with s.async_client() as client:
            return await asyncio.gather(*(ask(client) for _ in range(6)))

    with Served(engine, tok) as s:
        outcomes = asyncio.run(main(s))
        metrics = s.metrics()
    assert outcomes.count("ok") >= 1 and outcomes.count("429") >= 1, outcomes
    assert metrics['salabatch_http_requests_total{endpoint="/v1/completions",status="429"}'] == (
        outcomes.count("429")
    )
    assert metrics["salabatch_requests_rejected_total"] == outcomes.count("429")


def test_n_choices_the_queue_cannot_take_are_a_429_and_none_is_left_queued(tiny):
    """One row, one place in the queue, the row busy: n = 2 is refused with 429, none of its
    jobs queued (its first was queued, then cancelled: until the engine thread dropped it, it
    held the place, and an n = 1 request that fits got a 429 too; counted accepted, cancelled
    and rejected); with the row free, n = 2 runs (one job waits)."""
    model, tok = tiny
    with Served(ServeEngine(model, tok, batch_size=1, max_queue=1), tok) as s:
        client = s.client()
        busy = client.completions.create(model=MODEL, prompt="x", max_tokens=5000, stream=True)
        next(iter(busy))  # its row decodes
        before = s.engine.stats()
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="y", max_tokens=2, n=2)
        assert e.value.body["code"] == "queue_full"
        assert e.value.response.headers["retry-after"] == "1"  # when the client tries again
        after = s.engine.stats()
        assert after["queue_depth"] == 0 and after["requests_rejected_total"] == 1
        for counter in ("requests_total", "requests_cancelled_total"):
            assert after[counter] == before[counter], counter
        # the place is free: queued (the stream's 200 is its answer), not a 429
        client.completions.create(model=MODEL, prompt="y", max_tokens=2, stream=True).close()
        busy.close()
        s.wait_for(lambda: s.engine.stats()["running_rows"] == 0)
        both = client.completions.create(model=MODEL, prompt="y", max_tokens=2, n=2)
    assert [c.index for c in both.choices] == [0, 1] and both.usage.completion_tokens >= 2


def test_one_choice_that_fails_fails_the_request_and_stops_the_others(tiny, monkeypatch):
    """The second of three choices cannot be given its memory: the whole answer is that 503,
    streamed too (the engine checks a stream's jobs before its status goes: it was a 200
    and an error event), and the other choices' rows stop. Found after that wait, a stream's
    failure is its error event, then [DONE]."""
    model, tok = tiny
    engine = ServeEngine(model, tok, batch_size=4)
    real = engine._check_memory

    def second_fails(job, *args):
        if job.params.seed == 101:
            raise OutOfMemoryError("needs 1 GB more than is free")
        return real(job, *args)

    monkeypatch.setattr(engine, "_check_memory", second_fails)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "seed": 100, "n": 3}
    with Served(engine, tok) as s:
        status, _, data = s.raw("POST", "/v1/completions", json.dumps(body).encode())
        error = json.loads(data)["error"]
        assert (status, error["code"]) == (503, "out_of_memory") and "1 GB" in error["message"]
        streamed = json.dumps(body | {"stream": True}).encode()
        status, _, data = s.raw("POST", "/v1/completions", streamed)
        error = json.loads(data)["error"]
        assert (status, error["code"]) == (503, "out_of_memory") and "1 GB" in error["message"]
        monkeypatch.setattr(app_module, "CHECK_WAIT_S", 0.0)
        status, _, data = s.raw("POST", "/v1/completions", streamed)
        events = data.decode().split("\n\n")
        assert status == 200 and events[-2:] == ["data: [DONE]", ""]
        assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == "out_of_memory"
        # every choice's job has ended (a cancelled one still queued or prefilling decodes no
        # row, so running_rows alone can read 0 before it is counted)
        ended = ("requests_finished_total", "requests_cancelled_total", "requests_failed_total")
        stats = s.wait_for(
            lambda: (
                (x := s.engine.stats())["requests_total"] == sum(x[k] for k in ended)
                and x["running_rows"] == x["prefilling"] == 0
                and x
            )
        )
    assert stats["requests_failed_total"] == 3 and stats["requests_cancelled_total"] == 6
    assert stats["completion_tokens_total"] < 3000


def test_a_stream_that_does_not_fit_is_refused_with_its_status(tiny, monkeypatch):
    """A streamed chat whose prefill cannot have its memory: 503 `out_of_memory` before any
    event, its advice what a client or `serve` can change (no job-file keys)."""
    model, tok = tiny
    monkeypatch.setattr(memory, "available_bytes", lambda gpu: 1 << 10)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with Served(ServeEngine(model, tok, batch_size=2), tok) as s:
        status, _, data = s.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    error = json.loads(data)["error"]
    assert (status, error["code"]) == (503, "out_of_memory"), data
    assert "max_tokens" in error["message"] and "engine." not in error["message"]


def test_a_choice_waiting_for_a_row_does_not_hold_back_the_tokens_of_one_decoding(tiny):
    """n = 2 streamed on one row: choice 0 decodes at once, choice 1 waits for the row. The
    stream's check of its jobs (`refused`) ends as choice 0 has a token to send: it held the
    first text back for CHECK_WAIT_S (5 s)."""
    model, tok = tiny
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "n": 2, "stream": True}
    with Served(ServeEngine(model, tok, batch_size=1), tok) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        t0 = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps(body))
        response = conn.getresponse()
        first_text = None
        while first_text is None and (line := response.fp.readline()):
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                first_text = time.monotonic() - t0
        conn.close()
    assert response.status == 200 and first_text is not None
    assert first_text < 2.0, f"choice 0's first text held back {first_text:.2f} s"


def test_a_client_that_leaves_while_its_stream_waits_frees_its_place_at_once(tiny):
    """A stream queued behind a busy row (max_queue 1) whose client leaves while its jobs are
    checked: its job is cancelled at once (it kept its queue place, others getting 429, until
    the check's wait ended)."""
    model, tok = tiny
    with Served(ServeEngine(model, tok, batch_size=1, max_queue=1), tok) as s:
        client = s.client()
        busy = client.completions.create(model=MODEL, prompt="x", max_tokens=20000, stream=True)
        next(iter(busy))
        body = json.dumps({"model": MODEL, "prompt": "y", "max_tokens": 50, "stream": True})
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        s.wait_for(lambda: s.engine.stats()["queue_depth"] == 1)
        sock.close()
        time.sleep(1.0)
        depth = s.engine.stats()["queue_depth"]
        busy.close()
    assert depth == 0, "the gone client's job still holds its queue place 1 s after it left"


def test_max_queue_0_queues_no_request_beyond_the_batch_rows(tiny):
    """Rows are free: a request takes one, whatever max_queue says."""
    model, tok = tiny
    engine = ServeEngine(model, tok, batch_size=2, max_queue=0)
    with Served(engine, tok) as s:
        answer = s.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_metrics_count_requests_by_endpoint_and_status_and_show_the_engine(served):
    ok = 'salabatch_http_requests_total{endpoint="/v1/chat/completions",status="200"}'
    bad = 'salabatch_http_requests_total{endpoint="/v1/chat/completions",status="400"}'
    before = served.metrics()
    client = served.client()
    for _ in range(2):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    served.client().models.retrieve(MODEL)
    after = served.metrics()
    assert after[ok] - before.get(ok, 0) == 2 and after[bad] - before.get(bad, 0) == 1
    assert after['salabatch_http_requests_total{endpoint="/v1/models/{model_id}",status="200"}']
    assert after["salabatch_requests_total"] - before["salabatch_requests_total"] == 2
    assert (
        after['salabatch_ttft_seconds_bucket{le="+Inf"}'] == after["salabatch_ttft_seconds_count"]
    )
    for name in (
        "salabatch_queue_depth",
        "salabatch_prefix_hits_memory_total",
        "salabatch_cached_tokens_total",
        "salabatch_queue_seconds_count",
    ):
        assert name in after


# ---- the command ---------------------------------------------------------------------------


@contextmanager
def serve_process(
    tmp_path: Path,
    *args: str,
    state: Path | None = None,
    env: dict | None = None,
):
    """`salabatch serve` on builtin:tiny in a process, on a port the system picks (`--port 0`:
    no port chosen here can be taken by another process before the server binds it), its state
    dir `state` (default tmp_path/state); yields (the port, from the server's log, the process,
    its stderr file)."""
    state = state or tmp_path / "state"
    log = tmp_path / f"serve-{state.name}.log"
    command = [sys.executable, "-m", "salabatch.cli", "serve", "--model", MODEL, "--port", "0"]
    with log.open("w") as err:
        process = subprocess.Popen(
            [*command, "--state-dir", str(state), *args],
            stderr=err,
            stdout=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    try:
        yield _bound_port(log, process), process, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _bound_port(log: Path, process) -> int:
    """The port uvicorn says it runs on ("Uvicorn running on http://HOST:PORT")."""
    deadline = time.monotonic() + 60
    while True:
        found = re.search(r"Uvicorn running on http://[^\s]+:(\d+)", log.read_text())
        if found:
            return int(found.group(1))
        assert process.poll() is None, f"salabatch serve exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "salabatch serve did not start listening"
        time.sleep(0.1)


def process_metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200
    return parse_metrics(response.read().decode())


def wait_healthy(port: int, process) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, "salabatch serve exited"
        assert time.monotonic() < deadline, "salabatch serve did not answer /health"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.1)


def get(port: int, path: str, key: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    return conn.getresponse().status


def test_salabatch_serve_warns_when_open_to_others_and_stops_on_ctrl_c_or_sigterm(tmp_path):
    """Either stop is clean: exit 0, the prefixes held written to the prefix store. (And
    `--responses-gb` bounds the stored responses: ~4 KB keeps the last of two 2-3 KB ones.)"""
    opened_at = {"state": tmp_path / "open"}
    keyed_at = {"state": tmp_path / "keyed", "env": {"SALABATCH_API_KEY": KEY}}
    small = ("--responses-gb", str(4096 / 2**30))
    with (
        serve_process(tmp_path, "--host", "0.0.0.0", **opened_at) as (open_port, opened, open_log),
        serve_process(tmp_path, *small, **keyed_at) as (port, keyed, keyed_log),
    ):
        wait_healthy(open_port, opened)
        wait_healthy(port, keyed)
        assert get(open_port, "/v1/models") == 200  # no key set: open
        assert (get(port, "/v1/models"), get(port, "/v1/models", KEY)) == (401, 200)
        for at in (open_port, port):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{at}/v1", api_key=KEY)
            client.chat.completions.create(
                model=MODEL,
                messages=system_turn(document("redwater-robotics.txt"), QUESTIONS[0]),
                max_tokens=2,
            )
            # the Responses API is served too (tests/serve/test_responses.py)
            asked = [
                client.responses.create(model=MODEL, input="word " * 300, max_output_tokens=2)
                for _ in range(2)
            ]
            assert client.responses.retrieve(asked[1].id).output
            if at == port:  # past --responses-gb: the least recently used went
                with pytest.raises(openai.NotFoundError):
                    client.responses.retrieve(asked[0].id)
            else:
                assert client.responses.retrieve(asked[0].id).output
        for process, stop in ((opened, signal.SIGINT), (keyed, signal.SIGTERM)):
            process.send_signal(stop)
            assert process.wait(30) == 0, stop
    for state in (opened_at["state"], keyed_at["state"]):
        assert any((state / "prefixes").iterdir()), state
    warnings = [line for line in open_log.read_text().splitlines() if "warning" in line]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "API key" in warnings[0]
    assert "warning" not in keyed_log.read_text()


def test_requests_still_running_when_the_grace_ends_get_their_end(tmp_path):
    """SIGTERM with answers that outlast the 5 s grace: uvicorn cut them off (a stream without
    an end, a plain-text 500). The engine now ends them first: the stream's error event and
    [DONE], the whole answer's 503 OpenAI error; the server exits 0. A background response
    ended so runs again at the next start (it was stored failed: "the engine is closed")."""
    import threading

    body = {"model": MODEL, "prompt": "The provider", "max_tokens": 20000}
    got: dict[str, object] = {}

    def ask(port: int, stream: bool) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", json.dumps(body | {"stream": stream}), headers)
        response = conn.getresponse()
        got[f"stream={stream}"] = (response.status, response.read().decode())

    with serve_process(tmp_path) as (port, process, _):
        wait_healthy(port, process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        long = "The provider shall deliver. " * 4000  # seconds of prefill here
        background = client.responses.create(
            model=MODEL, input=long, max_output_tokens=4, background=True
        )
        asks = [threading.Thread(target=ask, args=(port, s)) for s in (True, False)]
        for thread in asks:
            thread.start()
        # both asks decode (a fixed sleep was too short on a loaded machine)
        deadline = time.monotonic() + 60
        while process_metrics(port)["salabatch_running_rows"] < 2:
            assert time.monotonic() < deadline, "the two asks did not start decoding"
            time.sleep(0.05)
        time.sleep(0.5)  # some of their tokens streamed
        process.send_signal(signal.SIGTERM)
        for thread in asks:
            thread.join(60)
        assert process.wait(30) == 0
    status, text = got["stream=True"]
    events = [line for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "data: [DONE]", text[-500:]
    assert "error" in json.loads(events[-2].removeprefix("data: ")), events[-2]
    status, text = got["stream=False"]
    assert status == 503 and json.loads(text)["error"]["type"] == "service_unavailable", text
    # the background response the closing engine ended is no failure: the next server runs it
    with serve_process(tmp_path) as (port, process, _):
        wait_healthy(port, process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        deadline = time.monotonic() + 120
        while (again := client.responses.retrieve(background.id)).status == "in_progress":
            assert time.monotonic() < deadline, "the background response did not run again"
            time.sleep(0.2)
        assert again.status in ("completed", "incomplete") and again.output_text, again


def test_a_port_in_use_or_a_state_dir_under_a_file_is_a_usage_error_before_the_model(
    tmp_path, monkeypatch
):
    """uvicorn's exit 3 (the code of error rows) after the model loaded, and a raw
    NotADirectoryError (exit 1): now exit 2 naming the option, before anything loads."""
    import importlib
    import socket

    serve_cli = importlib.import_module("salabatch.cli.serve")  # the module, not the command
    monkeypatch.setattr(serve_cli, "_engine", lambda *a, **k: pytest.fail("the model loaded"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = str(taken.getsockname()[1])
        state = ["--state-dir", str(tmp_path / "state")]
        used = CliRunner().invoke(main, ["serve", MODEL, "--port", port, *state])
        assert used.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in used.output
    finally:
        taken.close()
    (tmp_path / "afile").write_text("x")
    under = CliRunner().invoke(main, ["serve", MODEL, "--state-dir", str(tmp_path / "afile" / "s")])
    assert under.exit_code == 2 and "--state-dir" in under.output, under.output
    assert "cannot keep the server's state" in under.output


def test_ctrl_c_while_the_model_loads_stops_cleanly_and_frees_the_port(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) before the server is up: click's "Aborted!" and exit 1 before; a
    stop as any other now (exit 0), with the port and the state dir let go."""
    import importlib
    import socket

    serve_cli = importlib.import_module("salabatch.cli.serve")

    def loading(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_cli, "_engine", loading)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    state = ["--state-dir", str(tmp_path / "state")]
    result = CliRunner().invoke(main, ["serve", MODEL, "--port", port, *state])
    assert result.exit_code == 0 and "stopped before the server started" in result.output
    with socket.socket() as again:
        again.bind(("127.0.0.1", int(port)))  # let go


def test_a_body_nested_too_deeply_or_a_bad_guided_regex_is_a_400_naming_it(served):
    """A body of 100,000 nested arrays was a 500 (RecursionError, a traceback in the log); an
    unusable guided_regex was reported against response_format."""
    deep = b"[" * 100_000 + b"]" * 100_000
    status, _, data = served.raw("POST", "/v1/chat/completions", deep)
    assert status == 400 and "nested too deeply" in json.loads(data)["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"guided_regex": "(?<=a)b"},  # look-behind: outlines-core refuses it
        )
    assert e.value.body["param"] == "guided_regex", e.value.body
    assert e.value.body["message"].startswith("guided_regex: "), e.value.body


def served_nothing(server, sockets=None) -> None:
    """uvicorn.Server.run, serving nothing: started, then stopped at once."""
    server.started = True


def test_serve_draft_flags_reach_the_engine(tmp_path, monkeypatch):
    made: list[ServeEngine] = []

    class Recording(ServeEngine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(engine_module, "ServeEngine", Recording)
    monkeypatch.setattr(uvicorn.Server, "run", served_nothing)

    def serve(*args: str):
        command = ["serve", "--model", MODEL, "--port", "0", "--state-dir", str(tmp_path / "state")]
        command += args
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 0, result.output
        return made[-1].speculation

    assert serve() == OFF
    assert serve("--draft", "auto", "--num-draft-tokens", "6") == Speculation("auto", 6, 8)
    assert serve("--draft", "layers", "--draft-layers", "2") == Speculation("layers", 4, 2)
    refused = CliRunner().invoke(main, ["serve", "--model", MODEL, "--draft", "medusa"])
    assert refused.exit_code == 2 and "'medusa' is not one of" in refused.output


def test_serve_takes_the_model_as_an_argument_or_an_option(tmp_path, monkeypatch):
    """`salabatch serve M` (vLLM's spelling) and `serve --model M` (mlx-lm's) serve M; neither,
    or both, is a usage error before anything loads."""
    served: list[str] = []

    def recording(*args, **kwargs):
        served.append(kwargs["model_id"])
        return create_app(*args, **kwargs)

    monkeypatch.setattr(app_module, "create_app", recording)
    monkeypatch.setattr(uvicorn.Server, "run", served_nothing)
    state = ["--state-dir", str(tmp_path / "state"), "--port", "0"]
    for command in (["serve", MODEL, *state], ["serve", "--model", MODEL, *state]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 0, result.output
    assert served == [MODEL, MODEL]
    missing = CliRunner().invoke(main, ["serve", *state])
    assert missing.exit_code == 2 and "give MODEL, as an argument or with --model" in missing.output
    both = CliRunner().invoke(main, ["serve", MODEL, "--model", MODEL, *state])
    assert both.exit_code == 2 and f"unexpected argument {MODEL!r}" in both.output
    assert len(served) == 2


def test_a_thought_answer_splits_off_its_reasoning_and_counts_its_tokens(served):
    """With enable_thinking, a leading <think> block (forced here by a pattern: the toy model
    writes none of its own) is `reasoning_content`, streamed as reasoning deltas, and its
    generated tokens, the one that closes it included, are
    `completion_tokens_details.reasoning_tokens`."""
    client = served.client()
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Who is the provider?"}],
        "max_tokens": 80,  # the pattern's text, however the model spells it in tokens
        "extra_body": {
            "chat_template_kwargs": {"enable_thinking": True},
            "guided_regex": "<think>\nplan the answer\n</think>\n\nAcme",
        },
    }
    whole = client.chat.completions.create(**ask, logprobs=True)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("plan the answer", "Acme")
    spelled = [lp.token for lp in whole.choices[0].logprobs.content]  # as the model spelled it
    closed = next(i for i in range(len(spelled)) if "</think>" in "".join(spelled[: i + 1]))
    details = whole.usage.completion_tokens_details
    assert details.reasoning_tokens == closed + 1 < whole.usage.completion_tokens
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = list(client.chat.completions.create(**ask, **streamed))
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("plan the answer", "Acme")
    # the streamed usage counts them too (it had no completion_tokens_details)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == closed + 1
