"""The Responses API (`/v1/responses`) with the real `openai` client against a server started
here over a real ServeEngine on builtin:tiny: a response is the chat completion of the same
messages (answer and usage), streamed or not alike; previous_response_id continues a stored
conversation from the prefix the engine holds; instructions, text.format, reasoning,
max_output_tokens; GET and DELETE; refused fields and items are 400s naming them."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from salabatch.serve.app import ServeDefaults
from salabatch.serve.engine import ServeEngine
from salabatch.serve.responses import Responses
from tests import REPO
from tests.serve.test_http import KEY, MODEL, Served

DOCUMENT = (REPO / "jobs" / "demo" / "docs" / "redwater-robotics.txt").read_text()
QUESTION = "Give the service provider of this agreement."


@pytest.fixture(scope="module")
def served(tiny):
    model, tok = tiny
    engine = ServeEngine(model, tok, batch_size=4, max_queue=16, snapshot_min=16)
    answers = Responses(engine, tok, model_id=MODEL, defaults=ServeDefaults())
    with Served(engine, tok, api_key=KEY, routes=answers.routes, starting=[answers.resume]) as s:
        yield s


def test_a_response_is_the_chat_completion_of_its_messages(served):
    """`instructions` + `input` (a string) answer as the chat completion of a system and a
    user message: the same text and usage; streamed, the events build the same response,
    whose id GET returns."""
    client = served.client()
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": DOCUMENT},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=12,
    )
    response = client.responses.create(
        model=MODEL, instructions=DOCUMENT, input=QUESTION, max_output_tokens=12
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    done = chat.choices[0].finish_reason == "stop"
    assert response.status == ("completed" if done else "incomplete")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens_details.cached_tokens > 0  # the document was held
    assert response.usage.output_tokens_details.reasoning_tokens == 0

    events = list(
        client.responses.create(
            model=MODEL, instructions=DOCUMENT, input=QUESTION, max_output_tokens=12, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if done else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    (text_done,) = [e for e in events if e.type == "response.output_text.done"]
    assert text_done.text == response.output_text
    # the message opens empty, then its one part is added (a part in both: the client's
    # snapshot of the response held it twice)
    (added,) = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "message" and added.item.content == []
    assert kinds.count("response.content_part.added") == 1
    last = events[-1].response
    assert last.output_text == response.output_text and last.usage.output_tokens > 0
    assert client.responses.retrieve(last.id).output_text == response.output_text


def test_previous_response_id_continues_the_conversation(served):
    """A second request with previous_response_id is the chat completion of the first's input,
    its answer and the new input (its instructions not carried over), resuming from the
    prefix the first left held; an unknown id is a 400 naming the field; a deleted response
    is gone (404), and one made with store false was never kept."""
    client = served.client()
    user = [{"role": "user", "content": f"{DOCUMENT}\n\n{QUESTION}"}]
    first = client.responses.create(model=MODEL, input=user, max_output_tokens=8)
    second = client.responses.create(
        model=MODEL, input="And the client?", previous_response_id=first.id, max_output_tokens=8
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            *user,
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And the client?"},
        ],
        max_tokens=8,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 256
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_are_a_responses_own_input_paged_as_openai_pages_them(served):
    """GET .../input_items lists what a response was given as input (not the conversation it
    continued), newest first unless `order=asc`, in pages the client walks (`limit`, `after`,
    `before`, `has_more`); every item validates as the client's ResponseItem."""
    from openai.types.responses import ResponseItem
    from pydantic import TypeAdapter

    client = served.client()
    first = client.responses.create(model=MODEL, input="Who signs?", max_output_tokens=4)
    given = [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Three"}]},
    ]
    second = client.responses.create(
        model=MODEL, input=given, previous_response_id=first.id, max_output_tokens=4
    )

    def texts(items) -> list[str]:
        return [item.content[0].text for item in items]

    newest = client.responses.input_items.list(second.id)
    assert texts(newest.data) == ["Three", "Two", "One"] and not newest.has_more
    # a developer message as the model read it: the system role
    assert [item.role for item in newest.data] == ["system", "assistant", "user"]
    assert [item.content[0].type for item in newest.data] == [
        "input_text",
        "output_text",
        "input_text",
    ]
    assert len({item.id for item in newest.data}) == 3
    raw = served.raw("GET", f"/v1/responses/{second.id}/input_items")[2]
    for item in json.loads(raw)["data"]:
        TypeAdapter(ResponseItem).validate_python(item)
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert texts(page.data) == ["One", "Two"] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.last_id)
    assert texts(rest.data) == ["Three"] and not rest.has_more
    before = client.responses.input_items.list(  # the client no longer names it; Azure's does
        second.id, order="asc", extra_query={"before": rest.first_id}
    )
    assert texts(before.data) == ["One", "Two"]
    back = client.responses.input_items.list(  # the page just before it, not the first one
        second.id, order="asc", limit=1, extra_query={"before": rest.first_id}
    )
    assert texts(back.data) == ["Two"] and back.has_more
    walked = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert texts(walked) == ["One", "Two", "Three"]  # the client's own paging, page by page
    assert texts(client.responses.input_items.list(first.id)) == ["Who signs?"]
    for query, param in [
        ("limit=0", "limit"),
        ("limit=%C2%B2", "limit"),  # "²": a digit to str.isdigit, not to int
        ("order=up", "order"),
        ("after=msg_x", "after"),
    ]:
        status, _, body = served.raw("GET", f"/v1/responses/{second.id}/input_items?{query}")
        assert status == 400 and json.loads(body)["error"]["param"] == param
    assert served.raw("GET", "/v1/responses/resp_nope/input_items")[0] == 404


def test_a_background_response_is_in_progress_then_as_a_foreground_one(served):
    """`background: true` returns at once, in progress; GET shows it so until it ends, then as
    the same request answered in the foreground (greedy: the same text)."""
    client = served.client()
    ask = {"model": MODEL, "instructions": DOCUMENT, "input": QUESTION, "max_output_tokens": 12}
    started = client.responses.create(**ask, background=True)
    assert started.status == "in_progress" and started.background and started.output == []
    done = served.wait_for(
        lambda: (r := client.responses.retrieve(started.id)).status != "in_progress" and r
    )
    foreground = client.responses.create(**ask)
    assert done.status == foreground.status and done.output_text == foreground.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens and done.background
    # continued as the foreground one is: the same question and answer before "And?"
    after, after_foreground = (
        client.responses.create(
            model=MODEL, input="And?", previous_response_id=r.id, max_output_tokens=2
        )
        for r in (done, foreground)
    )
    assert after.usage.input_tokens == after_foreground.usage.input_tokens


def test_a_background_stream_goes_on_without_its_client_and_a_get_streams_it_again(
    served, monkeypatch
):
    """`background` with `stream`: the events a foreground stream sends; GET `stream=true`
    sends them again after `starting_after` (all of them without), while it runs or once it
    ended; a client that leaves mid-stream does not stop it."""
    client = served.client()
    ask = {"model": MODEL, "instructions": DOCUMENT, "input": QUESTION, "max_output_tokens": 16}
    foreground = list(client.responses.create(**ask, stream=True))
    background = list(client.responses.create(**ask, stream=True, background=True))
    kinds = [e.type for e in background]
    assert kinds == [e.type for e in foreground] and kinds[-1] == "response.completed"
    assert background[-1].response.output_text == foreground[-1].response.output_text
    response_id = background[0].response.id
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in background]
    tail = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [e.sequence_number for e in tail] == list(range(4, len(background)))
    # a client that leaves after the first event: the response goes on to its end
    body = {"model": MODEL, "input": "\n\n".join([DOCUMENT] * 6), "max_output_tokens": 8}
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request(
        "POST", "/v1/responses", json.dumps(body | {"stream": True, "background": True}), headers
    )
    reply = conn.getresponse()
    assert reply.readline().startswith(b"event: response.created")
    created = json.loads(reply.readline().decode().removeprefix("data: "))
    conn.close()
    left = created["response"]["id"]
    ended = served.wait_for(
        lambda: (r := client.responses.retrieve(left)).status != "in_progress" and r, timeout=60
    )
    assert ended.status in ("completed", "incomplete") and ended.usage.output_tokens > 0
    status, _, data = served.raw("GET", f"/v1/responses/{left}?stream=true&starting_after=x")
    assert status == 400 and json.loads(data)["error"]["param"] == "starting_after"
    foreground_id = foreground[0].response.id
    status, _, data = served.raw("GET", f"/v1/responses/{foreground_id}?stream=true")
    assert status == 400 and json.loads(data)["error"]["param"] == "stream"
    # the events of those that ended are kept within a byte budget: the last one always
    from salabatch.serve import responses

    monkeypatch.setattr(responses, "KEPT_LOG_BYTES", 1)
    last = list(client.responses.create(**ask, stream=True, background=True))
    last_id = last[0].response.id
    served.wait_for(lambda: client.responses.retrieve(last_id).status != "in_progress")
    assert len(list(client.responses.retrieve(last_id, stream=True))) == len(last)
    status, _, _ = served.raw("GET", f"/v1/responses/{response_id}?stream=true")
    assert status == 400  # dropped for the later one


def test_a_background_response_cancelled_mid_prefill(served):
    """A long document's background response is cancelled while it prefills: status cancelled
    (again: the same), and no later request continues it meanwhile; deleting one that runs
    cancels it first; background without store and cancelling a foreground response are 400s
    naming why."""
    client = served.client()
    long = "\n\n".join([DOCUMENT] * 40)  # ~25K tokens: seconds of prefill here
    started = client.responses.create(
        model=MODEL, input=f"{long}\n\n{QUESTION}", max_output_tokens=8, background=True
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=started.id)
    assert e.value.body["param"] == "previous_response_id" and "in_progress" in str(e.value)
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and cancelled.output_text == ""
    assert client.responses.cancel(started.id).status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"
    running = client.responses.create(model=MODEL, input=long, max_output_tokens=8, background=True)
    cancelled_before = served.engine.stats()["requests_cancelled_total"]
    client.responses.delete(running.id)  # cancelled first: its job does not store it again
    assert served.engine.stats()["requests_cancelled_total"] == cancelled_before + 1
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for call, param in [
        (lambda: client.responses.cancel(foreground.id), "response_id"),
        (
            lambda: client.responses.create(model=MODEL, input="x", background=True, store=False),
            "store",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param


def test_a_background_response_a_stopped_server_left_runs_again_at_the_next_start(tiny, tmp_path):
    """A server stopped mid-prefill of a background response (a sampled one, continuing a
    conversation): the next server on the same store runs it again under its id, as it was
    asked, its seed kept: the answer the same request with that seed gets in the foreground.
    One an older server left (no run recorded) or one killed under MAX_STARTS runs is failed,
    saying why; what ended is left as it is."""
    from salabatch.serve.response_store import ResponseStore
    from salabatch.serve.responses import MAX_STARTS

    model, tok = tiny
    path = tmp_path / "responses.sqlite"

    def server(store: ResponseStore) -> Served:
        engine = ServeEngine(model, tok, batch_size=4, max_queue=16, snapshot_min=16)
        answers = Responses(engine, tok, model_id=MODEL, defaults=ServeDefaults(), store=store)
        return Served(engine, tok, api_key=KEY, routes=answers.routes, starting=[answers.resume])

    long = "\n\n".join([DOCUMENT] * 40)  # ~25K tokens: seconds of prefill here
    ask = {"model": MODEL, "input": f"{long}\n\n{QUESTION}", "max_output_tokens": 8}
    ask |= {"temperature": 1.0}
    store = ResponseStore(path)
    with server(store) as first_server:
        client = first_server.client()
        first = client.responses.create(model=MODEL, input="Who signs?", max_output_tokens=4)
        started = client.responses.create(**ask, previous_response_id=first.id, background=True)
    (left,) = store.unfinished()  # stopped cleanly: its start not counted
    assert left.stored.response["id"] == started.id and left.starts == 0
    seed = left.body["seed"]
    assert isinstance(seed, int) and left.body["previous_response_id"] == first.id
    shell = {"object": "response", "background": True, "output": [], "created_at": 1}
    conversation = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]
    store.put(shell | {"id": "resp_older", "status": "in_progress"}, conversation, 1)
    store.put(shell | {"id": "resp_crashing", "status": "in_progress"}, conversation, 1)
    for _ in range(MAX_STARTS):
        store.started("resp_crashing", {"model": MODEL, "input": "Q"})
    store.put(shell | {"id": "resp_done", "status": "completed"}, conversation, 1)
    store.put(shell | {"id": "resp_broken", "status": "in_progress"}, conversation, 1)
    store.started("resp_broken", {"model": MODEL, "input": 5})  # damaged: the server starts
    store.close()

    with server(ResponseStore(path)) as second_server:
        client = second_server.client()
        for response_id, why in (
            ("resp_older", "server stopped"),
            ("resp_crashing", "3 times"),
            ("resp_broken", "cannot run again: input must be a string"),
        ):
            failed = client.responses.retrieve(response_id)
            assert failed.status == "failed" and why in failed.error.message, failed
        assert client.responses.retrieve("resp_done").status == "completed"
        done = second_server.wait_for(
            lambda: (r := client.responses.retrieve(started.id)).status != "in_progress" and r,
            timeout=120,
        )
        assert done.status in ("completed", "incomplete") and done.output_text
        assert done.created_at == started.created_at and done.previous_response_id == first.id
        again = client.responses.create(
            **ask, previous_response_id=first.id, extra_body={"seed": seed}
        )
        assert done.output_text == again.output_text
        assert done.usage.input_tokens == again.usage.input_tokens
        assert second_server.engine.stats()["requests_total"] >= 2
    assert ResponseStore(path).unfinished() == []


def test_an_answer_the_store_cannot_take_still_goes_to_its_client(served, monkeypatch):
    """A full disk under the stored responses costs the later GET, not the answer computed."""
    import sqlite3

    from salabatch.serve.response_store import ResponseStore

    def full(self, *args):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ResponseStore, "put", full)
    client = served.client()
    answered = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4)
    assert answered.status in ("completed", "incomplete") and answered.usage.output_tokens > 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answered.id)


def test_truncation_auto_drops_the_oldest_messages_until_the_prompt_fits(tiny):
    """Of a conversation the context cannot hold, `truncation: "auto"` drops the fewest oldest
    messages (never the instructions, never the last) that make it fit; "disabled" drops
    none; an input that cannot fit alone stays whole, for the context check's 400."""
    from salabatch.serve.responses import response_request

    _, tok = tiny
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 40}
        for i in range(6)
    ]
    body = {"model": MODEL, "instructions": "Be brief.", "input": "Last question?"}

    def asked(context=None, **extra):
        return response_request(body | extra, tok, ServeDefaults(), MODEL, history, context=context)

    whole = asked()
    context = len(whole.job.prompt) - 60  # about one message too long
    fitted = asked(context, truncation="auto")
    assert len(fitted.job.prompt) < context and fitted.shell["truncation"] == "auto"
    kept = len(fitted.conversation)
    assert fitted.conversation == whole.conversation[-kept:] and 1 <= kept < 7
    one_more = asked(context, truncation="auto")  # the same again: deterministic
    assert one_more.conversation == fitted.conversation
    # one message fewer dropped would not fit
    again = response_request(
        body | {"truncation": "disabled"},
        tok,
        ServeDefaults(),
        MODEL,
        history[-(kept - 1) - 1 :],
    )
    assert len(again.job.prompt) >= context
    assert "Be brief." in tok.decode(fitted.job.prompt[:32])  # the instructions stay first
    assert len(asked(context, truncation="disabled").job.prompt) == len(whole.job.prompt)
    alone = asked(8, truncation="auto")  # nothing fits: the last message stays, too long
    assert alone.conversation == whole.conversation[-1:] and alone.inputs == 1


def test_input_tokens_counts_the_prompt_a_request_would_have(served):
    """`responses.input_tokens.count` gives the prompt's tokens a response to the same body
    reports, without running it: instructions, the conversation continued, the input."""
    client = served.client()
    ask = {"model": MODEL, "instructions": DOCUMENT, "input": QUESTION}
    counted = client.responses.input_tokens.count(**ask)
    answered = client.responses.create(**ask, max_output_tokens=2)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == answered.usage.input_tokens
    chained = {"model": MODEL, "input": "And?", "previous_response_id": answered.id}
    later = client.responses.create(**chained, max_output_tokens=2)
    assert client.responses.input_tokens.count(**chained).input_tokens == later.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools"


def test_truncation_auto_is_taken_and_echoed(served):
    response = served.client().responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, truncation="auto"
    )
    assert response.truncation == "auto"


def test_text_format_reasoning_and_length(served):
    """text.format json_schema gives JSON its schema validates; reasoning.effort thinks, its
    text a reasoning item before the message (streamed as reasoning deltas); a short
    max_output_tokens leaves the response incomplete, saying why."""
    client = served.client()
    schema = {
        "type": "object",
        "properties": {"provider": {"type": "string", "maxLength": 40}},
        "required": ["provider"],
    }
    shaped = client.responses.create(
        model=MODEL,
        instructions=DOCUMENT,
        input=QUESTION,
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "who", "schema": schema}},
    )
    assert set(json.loads(shaped.output_text)) == {"provider"}
    thought = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=40, reasoning={"effort": "low"}
    )
    kinds = [item.type for item in thought.output]
    assert kinds[-1] == "message" and set(kinds) <= {"reasoning", "message"}
    if kinds[0] == "reasoning":
        assert thought.usage.output_tokens_details.reasoning_tokens > 0
    events = list(
        client.responses.create(
            model=MODEL,
            input=QUESTION,
            max_output_tokens=40,
            reasoning={"effort": "low"},
            stream=True,
        )
    )
    streamed = events[-1].response
    assert [item.type for item in streamed.output] == kinds
    assert streamed.output_text == thought.output_text
    short = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1)
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"store": "yes"}, "store"),
        ({"metadata": {"a": 1}}, "metadata"),  # echoed in the response: a fuzzer's 500 (NaN)
        ({"input": []}, "input"),
        ({"truncation": "middle"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),  # not chat's max_tokens, a field unknown
        # accepted before, and ignored or coerced:
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),  # OpenAI's 16 at most
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "input[0].content[0].text",
        ),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "junk": 1}}},
            "text.format.junk",
        ),
    ],
)
def test_refused_fields_and_items_are_400s_naming_them(served, extra, param):
    client = served.client()
    ask = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4} | extra
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**ask)
    assert e.value.body["param"] == param, e.value.body


def test_null_fields_of_an_item_are_unset_and_a_client_that_left_leaves_nothing(served):
    """The SDK's dump of an output item holds nulls (`phase: None`): feeding it back was a 400.
    A foreground stream whose client left was stored `cancelled`, an id no one has."""
    client = served.client()
    first = client.responses.create(model=MODEL, input="Who signs?", max_output_tokens=4)
    items = [{"role": "user", "content": "Who signs?"}, *(o.model_dump() for o in first.output)]
    items.append({"role": "user", "content": "And who pays?", "phase": None})
    assert client.responses.create(model=MODEL, input=items, max_output_tokens=4).output_text


def test_a_foreground_answer_whose_client_left_is_not_stored(tiny):
    """It was stored `cancelled`: an id no one has, counted against --responses-gb."""
    model, tok = tiny
    engine = ServeEngine(model, tok, batch_size=4, max_queue=16)
    answers = Responses(engine, tok, model_id=MODEL, defaults=ServeDefaults())
    kept: list[str] = []
    keep = answers._keep
    answers._keep = lambda response, *rest: (kept.append(response["status"]), keep(response, *rest))
    with Served(engine, tok, api_key=KEY, routes=answers.routes) as s:
        impatient = s.client().with_options(timeout=1.0, max_retries=0)
        long = "The provider shall deliver. " * 4000  # seconds of prefill here
        with pytest.raises(openai.APITimeoutError):
            impatient.responses.create(model=MODEL, input=long, max_output_tokens=4)
        s.wait_for(lambda: s.engine.stats()["requests_cancelled_total"] == 1, timeout=60)
        s.client().responses.create(model=MODEL, input="Who signs?", max_output_tokens=2)
    assert kept == ["incomplete"]  # the later one only (2 tokens: cut)


class _Fed:
    """A ticket that puts the given events (what the engine puts for a job), as the server
    reads a ticket: async iteration, cancel."""

    def __init__(self, events) -> None:
        self.events = events

    def __aiter__(self):
        return self._events()

    async def _events(self):
        for event in self.events:
            yield event

    def cancel(self) -> None:
        pass


def test_a_thought_answer_is_a_reasoning_item_then_the_message(tiny):
    """An answer that opens with a <think> block (its tokens put as the engine puts them) is a
    reasoning item with the block's text, then the message: streamed, every event is one the
    `openai` client's types accept, in order, numbered, the items' indices and ids consistent;
    the last event's response is the whole response's, with its reasoning tokens counted."""
    import asyncio

    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from salabatch.serve.completion import AnswerText
    from salabatch.serve.engine import Finished, Token
    from salabatch.serve.responses import ResponseRequest, Responses

    _, tok = tiny
    ids = tok.encode("<think> first the plan </think>\n\nAcme Corp")
    finished = Finished("stop", 30, len(ids), 0, None, 0.0, 0.0, 0.0, 0.0)
    responses = Responses(None, tok, model_id=MODEL, defaults=ServeDefaults())
    shell = {
        "id": "resp_" + "ab" * 16,
        "object": "response",
        "created_at": 0,
        "model": MODEL,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
    }

    async def streamed() -> bytes:
        answer = AnswerText(tok, think=True)
        ticket = _Fed([*(Token(t) for t in ids), finished])
        asked = ResponseRequest(None, answer, shell, [], 0, False)

        async def done(finished):
            return asked.response(finished)

        return b"".join([c async for c in responses._events(ticket, answer, shell, done)])

    raw = asyncio.run(streamed()).decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e.type for e in parsed]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    reasoning = "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta")
    content = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    assert (reasoning, content) == ("first the plan", "Acme Corp")
    added = [e for e in parsed if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]
    deltas = [e for e in parsed if e.type.endswith(".delta")]
    assert {e.item_id for e in deltas} == {added[0].item.id, added[1].item.id}
    assert kinds.index("response.output_item.done") < kinds.index("response.content_part.added")
    whole = Response.model_validate(events[-1]["response"])
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "first the plan"
    assert whole.output_text == "Acme Corp"
    # the tokens fed up to the one that closes the block
    closed = next(i for i in range(len(ids)) if "</think>" in tok.decode(ids[: i + 1]))
    assert whole.usage.output_tokens_details.reasoning_tokens == closed + 1


def test_a_job_that_fails_mid_stream_ends_it_with_an_error_event(tiny):
    import asyncio

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from salabatch.errors import GenerationError
    from salabatch.serve.completion import AnswerText
    from salabatch.serve.engine import Failed, Token
    from salabatch.serve.responses import Responses

    _, tok = tiny
    responses = Responses(None, tok, model_id=MODEL, defaults=ServeDefaults())
    shell = {"id": "resp_" + "cd" * 16, "object": "response", "created_at": 0, "model": MODEL}

    async def streamed() -> bytes:
        answer = AnswerText(tok)
        ticket = _Fed([Token(tok.encode("Acme")[0]), Failed(GenerationError("the row broke"))])

        async def done(finished):
            raise AssertionError("the job failed: no response to finish")

        chunks = responses._events(ticket, answer, shell, done)
        return b"".join([c async for c in chunks])

    lines = asyncio.run(streamed()).decode().splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    last = TypeAdapter(ResponseStreamEvent).validate_python(events[-1])
    assert last.type == "error" and "the row broke" in last.message
    assert "response.completed" not in [e["type"] for e in events]


def test_text_utf8_cannot_hold_is_a_400_naming_its_field(served):
    """JSON can carry a lone surrogate that no tokenizer takes (found by a fuzzer: it was a
    500 in `instructions`, and in `previous_response_id`, which no stored id can be)."""
    for field in ("instructions", "input", "previous_response_id"):
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, field: "\ud800"}
        status, _, data = served.raw("POST", "/v1/responses", json.dumps(body))
        assert status == 400 and json.loads(data)["error"]["param"] == field, data
    # echoed in the response, never tokenized (an audit: a 500 once the answer was made)
    for key in ("name", "description"):
        fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, key: "\ud800"}
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "text": {"format": fmt}}
        status, _, data = served.raw("POST", "/v1/responses", json.dumps(body))
        assert status == 400 and json.loads(data)["error"]["param"] == f"text.format.{key}", data


def test_a_background_response_that_cannot_be_stored_stops_its_job(served, monkeypatch):
    """Where storing a background response as started fails (a fault: a 500), its job is
    cancelled: no task would ever read it, and it decoded to its end for no one (an audit)."""
    tickets = []
    submit = served.engine.submit

    def spy(*args, **kwargs):
        tickets.append(submit(*args, **kwargs))
        return tickets[-1]

    def broken(*args):
        raise RuntimeError("the store broke")

    monkeypatch.setattr(served.engine, "submit", spy)
    monkeypatch.setattr(Responses, "_started", broken)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 64, "background": True}
    status, _, data = served.raw("POST", "/v1/responses", json.dumps(body))
    assert status == 500 and "RuntimeError" in json.loads(data)["error"]["message"], data
    assert len(tickets) == 1 and tickets[0].cancelled


def test_a_path_with_several_methods_allows_them_all_in_a_405(served):
    """`Allow` listed the methods of the first route of a path only (GET, not DELETE)."""
    status, headers, _ = served.raw("PUT", "/v1/responses/resp_x")
    assert status == 405 and set(headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}
