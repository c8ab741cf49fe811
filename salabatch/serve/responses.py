"""OpenAI's Responses API over the server's engine (routes for `create_app(..., routes=...)`):

    POST   /v1/responses        a response to `input` (a string, or messages), streamed with
                                `stream: true` as Responses events
    POST   /v1/responses/input_tokens
                                the tokens a body's prompt would have, nothing run
    GET    /v1/responses/{id}   a stored response
    GET    /v1/responses/{id}/input_items
                                its input's messages as items, paged (`limit`, `order`,
                                `after`, `before`)
    DELETE /v1/responses/{id}   forgets it
    POST   /v1/responses/{id}/cancel
                                stops a background response

A request is a chat completion underneath: `instructions` is the system message, then the
conversation of `previous_response_id` (its input and its answer, without its instructions,
as OpenAI chains them), then `input`; the same Job (`completion.chat_job`: boundaries, prefix
reuse, a document tokenized once), the same sampling fields (`max_output_tokens` for the
answer's length; temperature, top_p, and the vLLM-style top_k, min_p, seed and penalties),
`text.format` (json_object, json_schema) as `response_format`, and `reasoning.effort` (any
but "none") for thinking, whose text comes as a reasoning item before the message. Tools,
images, files and any other input item are refused, naming where they are.

Responses are kept (`store`, true unless false) in a ResponseStore (the server's state dir:
a restarted server still has them), the most recently used first, within its limit: a later
request continues one with `previous_response_id` (an id no longer kept is a 400 naming it),
and GET returns it. A background response (`background: true`) is stored in progress at once
and again when its job ends, by a task on the event loop (`_background`); its events are kept
(`EventLog`) for its own stream and for GETs that stream them, from any sequence number. A
server that stops first (Ctrl-C, SIGTERM, or killed) leaves it in progress with its request,
and the next one runs it again from the start when it starts (`resume`; its seed kept, so the
same answer comes), under the same id: up to MAX_STARTS runs the server was killed under (one
that kills the server must not kill every restart), then it is failed, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import sqlite3
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from salabatch import openai_api
from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import TokenizerError
from salabatch.openai_api import BodyError
from salabatch.serve.app import (
    MAX_BODY,
    APIError,
    EventStream,
    ServeDefaults,
    StreamFailed,
    check_context,
    collect,
    engine_error,
    grammar_of,
    methods_route,
    query_int,
    read_body,
    refused,
    sampling,
    stream_events,
)
from salabatch.serve.completion import AnswerText, LeadingIds, Piece, chat_job
from salabatch.serve.engine import (
    EngineClosed,
    Finished,
    Job,
    QueueFull,
    ServeEngine,
    Ticket,
    Token,
)
from salabatch.serve.response_store import ResponseStore, Stored, Unfinished

FIELDS = (
    "model",
    "previous_response_id",
    "store",
    "stream",
    "background",
    "truncation",
    *openai_api.RESPONSE_HONOURED,
)
NO_OP = {k: v for k, v in openai_api.RESPONSE_NO_OP.items() if k not in FIELDS}
STOPPED = "the server stopped before this background response finished"
MAX_STARTS = 3  # runs of a background response the server may be killed under
KEPT_LOG_BYTES = 64 << 20  # the events kept of background responses that ended, at most
log = logging.getLogger(__name__)


class Responses:
    """The Responses endpoints (`routes`) over `engine` (which the app's other endpoints
    share), keeping responses in `store` (None: a store in memory). `resume`, once the event
    loop runs (`create_app(starting=...)`), runs again the background responses a server
    before this one stopped under; opening, it fails those it will not run again."""

    def __init__(
        self,
        engine: ServeEngine,
        tok: Tokenizer,
        *,
        model_id: str,
        defaults: ServeDefaults,
        store: ResponseStore | None = None,
        max_body: int = MAX_BODY,
    ) -> None:
        self.engine, self.tok, self.model_id = engine, tok, model_id
        self.defaults, self.max_body = defaults, max_body
        self.store = store = ResponseStore() if store is None else store
        self.leading_ids = LeadingIds(tok)
        # the background responses running: id → (their ticket, the task that finishes them,
        # their events), and the events of those that ended last, within KEPT_LOG_BYTES
        self.running: dict[str, tuple[Ticket, asyncio.Task, EventLog]] = {}
        self.logs: OrderedDict[str, EventLog] = OrderedDict()
        self.left: list[Unfinished] = []  # to run again (`resume`)
        for left in store.unfinished():  # a server before this one stopped with them running
            if left.body is not None and left.starts < MAX_STARTS:
                self.left.append(left)
                continue
            message = STOPPED
            if left.body is not None:
                message = f"the server stopped {left.starts} times while running this response"
            self._fail(left.stored, message)
        self.routes = [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
            methods_route("/v1/responses/{response_id}", GET=self.get, DELETE=self.delete),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
        ]

    async def resume(self) -> None:
        """Runs again, oldest first, the background responses a stopped server left in
        progress: each as its request asked (the conversation it continued as it was stored
        with it), from the start, under its id; one that can no longer run (a model whose
        context cannot hold it, a full queue) is failed, saying why."""
        left, self.left = self.left, []
        for unfinished in left:
            stored = unfinished.stored
            try:
                asked = await run_in_threadpool(
                    response_request,
                    unfinished.body,
                    self.tok,
                    self.defaults,
                    self.model_id,
                    stored.history,
                    self.leading_ids,
                    self.engine.model.config.context_length,
                    stored.response["id"],
                    stored.response["created_at"],
                )
                check_context(asked.job, self.engine.model.config.context_length, "input")
                ticket = self.engine.submit(asked.job, asyncio.get_running_loop())
            except Exception as e:  # whatever it is, the server starts, the others run
                why = str(e)
                if not isinstance(e, APIError | BodyError | QueueFull | EngineClosed):
                    log.exception("background response %s", stored.response["id"])
                    why = f"internal server error ({type(e).__name__}); the server's log has it"
                await run_in_threadpool(
                    self._fail, stored, f"{STOPPED}, and cannot run again: {why}"
                )
                continue
            await self._start(ticket, asked, unfinished.body)
            log.info("background response %s runs again", stored.response["id"])

    def _fail(self, stored: Stored, message: str) -> None:
        failed = {"code": "server_error", "message": message}
        self._put(stored.response | {"status": "failed", "error": failed}, *stored[1:])

    async def create(self, request: Request) -> Response:
        body = await read_body(request, self.max_body, FIELDS, NO_OP, self.model_id)
        stream = openai_api.flag(body, "stream", False)
        background = openai_api.flag(body, "background", False)
        if background and not openai_api.flag(body, "store", True):
            raise APIError(400, "a background response must be stored", param="store")
        asked = await self._asked(body)
        check_context(asked.job, self.engine.model.config.context_length, "input")
        try:
            ticket = self.engine.submit(asked.job, asyncio.get_running_loop())
        except (QueueFull, EngineClosed) as e:
            raise engine_error(e) from None

        if background:
            try:
                running, log = await self._start(ticket, asked, body)
            except BaseException:
                ticket.cancel()  # no task will read it: it would decode to its end for no one
                raise
            return EventStream(log.follow(0), []) if stream else JSONResponse(running)
        # in the foreground, a job cancelled is a client that left: it never had the id
        done = functools.partial(self._done, asked, keep_cancelled=False)
        if stream:
            await refused([ticket], request)
            return EventStream(self._events(ticket, asked.answer, asked.shell, done), [ticket])
        (finished,) = await collect([ticket], [asked.answer], request)
        return JSONResponse(await done(finished))

    async def _done(
        self, asked: ResponseRequest, finished: Finished, keep_cancelled: bool = True
    ) -> dict:
        """The whole response of a job that finished, stored where it is to be (a cancelled
        one only where `keep_cancelled`)."""
        out = asked.response(finished)
        if asked.store and (keep_cancelled or out["status"] != "cancelled"):
            await run_in_threadpool(self._keep, out, asked.conversation, asked.inputs)
        return out

    async def input_tokens(self, request: Request) -> Response:
        """How many tokens the prompt of a request with this body would have (its instructions,
        the conversation it continues, its input; after `truncation: "auto"`), nothing run."""
        body = await read_body(request, self.max_body, FIELDS, NO_OP, self.model_id)
        count = len((await self._asked(body)).job.prompt)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    async def get(self, request: Request) -> Response:
        """A stored response; with `stream=true`, a background response's events after
        sequence number `starting_after` (all without), then those to come until it ends."""
        response_id = request.path_params["response_id"]
        stored = await self._stored(response_id, "response_id")
        query = request.query_params
        if query.get("stream", "false") not in ("true", "1"):
            return JSONResponse(stored.response)
        after = query_int(query, "starting_after", -1, -1, None)
        found = self.running.get(response_id)
        log = found[2] if found else self.logs.get(response_id)
        if log is None:
            message = f"the events of response {response_id!r} are not kept (not a background "
            message += "response of this server's, or one long finished): GET it without stream"
            raise APIError(400, message, param="stream")
        return EventStream(log.follow(after + 1), [])

    async def input_items(self, request: Request) -> Response:
        """A page of a stored response's input items: `limit` (1-100, 20) of them in `order`
        (`asc`, or `desc` as OpenAI's default), after or before the item ids given."""
        response_id = request.path_params["response_id"]
        stored = await self._stored(response_id, "response_id")
        query = request.query_params
        limit = query_int(query, "limit", 20, 1, 100)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be asc or desc", param="order")
        items = [
            openai_api.input_item(response_id, i, m) for i, m in enumerate(stored.input_messages)
        ]
        items = items if order == "asc" else items[::-1]
        ids = [item["id"] for item in items]
        start, end = 0, len(items)
        for param in ("after", "before"):
            if (at := query.get(param)) is not None:
                if at not in ids:
                    message = f"no input item {at!r} in response {response_id!r}"
                    raise APIError(400, message, param=param, code="not_found")
                start, end = (
                    (ids.index(at) + 1, end) if param == "after" else (start, ids.index(at))
                )
        between = items[start:end]
        # `before` alone pages back: the items just before it (the first page, before)
        back = query.get("before") is not None and query.get("after") is None
        page = between[-limit:] if back else between[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(page) < len(between),
            }
        )

    async def cancel(self, request: Request) -> Response:
        """Stops a background response (status `cancelled`, its answer so far); one already
        cancelled is returned as it is; any other is a 400."""
        response_id = request.path_params["response_id"]
        await self._stop(response_id)
        stored = (await self._stored(response_id, "response_id")).response
        if not stored.get("background"):
            raise APIError(400, "only a background response can be cancelled", param="response_id")
        if stored["status"] != "cancelled":
            message = f"response {response_id!r} is {stored['status']}: it cannot be cancelled"
            raise APIError(400, message, param="response_id")
        return JSONResponse(stored)

    async def delete(self, request: Request) -> Response:
        """Forgets a stored response (a background one running is cancelled first)."""
        response_id = request.path_params["response_id"]
        await self._stop(response_id)
        if not await run_in_threadpool(self.store.delete, response_id):
            raise _missing(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def _asked(self, body: dict) -> ResponseRequest:
        """The ResponseRequest of a body read (`read_body`): its truncation checked, the
        conversation it continues read from the store, tokenized in a worker thread."""
        if body.get("truncation") not in (None, "auto", "disabled"):
            raise APIError(400, "truncation must be auto or disabled", param="truncation")
        history = await self._history(body.get("previous_response_id"))
        return await run_in_threadpool(
            response_request,
            body,
            self.tok,
            self.defaults,
            self.model_id,
            history,
            self.leading_ids,
            self.engine.model.config.context_length,
        )

    # ---- the stored responses ----------------------------------------------------------------

    async def _stored(self, response_id, param: str) -> Stored:
        found = None
        if isinstance(response_id, str):
            found = await run_in_threadpool(self.store.get, response_id)
        if found is None:
            raise _missing(response_id, param)
        return found

    async def _history(self, previous_id) -> list[dict]:
        """The conversation a request continues: its previous response's input and answer (a
        response that has one: completed, or cut at its max_output_tokens)."""
        if previous_id is None:
            return []
        stored = await self._stored(previous_id, "previous_response_id")
        status = stored.response["status"]
        if status not in ("completed", "incomplete"):
            message = f"response {previous_id!r} is {status}: it has no answer to continue"
            raise APIError(400, message, param="previous_response_id")
        return stored.conversation

    # ---- background responses ----------------------------------------------------------------

    async def _start(
        self, ticket: Ticket, asked: ResponseRequest, body: dict
    ) -> tuple[dict, EventLog]:
        """Stores background response `asked` as in progress (from now until it ends: waiting
        in line and its prefill included), its run with its request's `body` (its seed as
        drawn, so that a run again after a restart answers the same), and starts the task that
        finishes it (`_background`); → the response in progress and the log its events go to."""
        response_id = asked.shell["id"]
        running = asked.shell | {"status": "in_progress", "output": [], "usage": None}
        await run_in_threadpool(self._keep_unanswered, running, asked)
        await run_in_threadpool(self._started, response_id, body | {"seed": asked.job.params.seed})
        events = EventLog()
        task = asyncio.create_task(self._background(ticket, asked, events))
        self.running[response_id] = (ticket, task, events)

        def ended(_) -> None:
            self.running.pop(response_id, None)
            self.logs[response_id] = events
            while len(self.logs) > 1 and sum(g.bytes for g in self.logs.values()) > KEPT_LOG_BYTES:
                self.logs.popitem(last=False)  # the last one stays, however long

        task.add_done_callback(ended)
        return running, events

    async def _stop(self, response_id: str) -> None:
        """Cancels background response `response_id` where it runs, and waits for its task to
        store it (the engine's next step)."""
        if response_id in self.running:
            ticket, task, _ = self.running[response_id]
            ticket.cancel()
            await asyncio.shield(task)

    def _keep_unanswered(self, response: dict, asked: ResponseRequest) -> None:
        """Stores a response with no answer (yet, or none: failed)."""
        conversation = [*asked.conversation, {"role": "assistant", "content": ""}]
        self._put(response, conversation, asked.inputs)

    async def _background(self, ticket: Ticket, asked: ResponseRequest, events) -> None:
        """Runs a background response's events (`_events`) into `events` (an EventLog) to their
        end: `_done` stores it completed, incomplete or cancelled (the answer so far); a failed
        job or a fault of the server's own stores it failed. The server stopping (the event
        loop cancels the task, or the engine closes first, ending its job) leaves it in
        progress, to run again at the next start."""
        shell = asked.shell
        done = functools.partial(self._done, asked)

        async def failed(message: str, code: str = "server_error") -> None:
            if code == "engine_closed":  # the server is stopping: the next one runs it again
                with contextlib.suppress(sqlite3.Error):
                    await run_in_threadpool(self.store.stopped, shell["id"])
                return
            error = {"code": "server_error", "message": message}
            out = shell | {"status": "failed", "error": error, "output": [], "usage": None}
            await run_in_threadpool(self._keep_unanswered, out, asked)

        try:
            async for chunk in self._events(ticket, asked.answer, shell, done, failed):
                events.add(chunk)
        except asyncio.CancelledError:
            with contextlib.suppress(sqlite3.Error):  # a clean stop: the next server runs it
                self.store.stopped(shell["id"])
            raise
        except Exception as e:
            log.exception("background response %s", shell["id"])
            await failed(f"internal server error ({type(e).__name__}); the server's log has it")
        finally:
            events.end()

    def _keep(self, response: dict, asked: list[dict], inputs: int) -> None:
        """Stores a finished response with its conversation (what it continued, its `inputs`
        messages of input, its answer)."""
        text = "".join(
            part["text"]
            for item in response["output"]
            if item["type"] == "message"
            for part in item["content"]
        )
        self._put(response, [*asked, {"role": "assistant", "content": text}], inputs)

    def _started(self, response_id: str, body: dict) -> None:
        """`store.started`; one that cannot be recorded (a full disk) is logged: the response
        runs, but not again after a restart."""
        try:
            self.store.started(response_id, body)
        except sqlite3.Error as e:
            log.warning("background response %s not recorded to run again: %s", response_id, e)

    def _put(self, response: dict, conversation: list[dict], inputs: int) -> None:
        """`store.put`; a store that cannot take it (a full disk) is logged, and the answer
        still goes to its client (it cannot be retrieved or continued later)."""
        try:
            self.store.put(response, conversation, inputs)
        except sqlite3.Error as e:
            log.warning("response %s not stored: %s", response["id"], e)

    # ---- the response ------------------------------------------------------------------------

    async def _events(
        self, ticket, answer: AnswerText, shell: dict, done, failed=None
    ) -> AsyncIterator[bytes]:
        """The Responses stream: created, in progress; the reasoning item (with `think`) and
        the message item, each added, its text in deltas, done; then completed (or incomplete),
        with the whole response (`done`'s; a cancelled one ends without). A job that fails ends
        it with an error event, after `failed(message, code)` where given."""
        number = 0
        order: list[str] = []  # the kinds of the items opened, by output index
        sent = {"reasoning": "", "content": ""}
        ids = {
            kind: openai_api.item_id(shell["id"], "rs" if kind == "reasoning" else "msg")
            for kind in sent
        }

        def event(kind: str, **data) -> bytes:
            nonlocal number
            payload = {"type": kind, "sequence_number": number, **data}
            number += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

        def where(kind: str) -> dict:
            return {"item_id": ids[kind], "output_index": order.index(kind), "content_index": 0}

        def opened(kind: str) -> list[bytes]:
            """The events that open the item of `kind` (the reasoning item closed first)."""
            out = closed("reasoning") if kind == "content" else []
            order.append(kind)
            at = len(order) - 1
            if kind == "reasoning":
                item = openai_api.reasoning_item(shell["id"], "", "in_progress")
                return [*out, event("response.output_item.added", output_index=at, item=item)]
            # empty: its part comes in the next event (OpenAI's order)
            item = openai_api.message_item(shell["id"], "", "in_progress") | {"content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            return [
                *out,
                event("response.output_item.added", output_index=at, item=item),
                event("response.content_part.added", **where(kind), part=part),
            ]

        def closed(kind: str) -> list[bytes]:
            """The events that close the item of `kind`, where it is the one open."""
            if not order or order[-1] != kind or kind in finished_items:
                return []
            finished_items.add(kind)
            at, text = order.index(kind), sent[kind]
            if kind == "reasoning":
                item = openai_api.reasoning_item(shell["id"], text, "completed")
                return [
                    event("response.reasoning_text.done", **where(kind), text=text),
                    event("response.output_item.done", output_index=at, item=item),
                ]
            item = openai_api.message_item(shell["id"], text, "completed")
            return [
                event("response.output_text.done", **where(kind), text=text, logprobs=[]),
                event("response.content_part.done", **where(kind), part=item["content"][0]),
                event("response.output_item.done", output_index=at, item=item),
            ]

        def delta(piece: Piece) -> list[bytes]:
            out = [] if piece.channel in order else opened(piece.channel)
            sent[piece.channel] += piece.text
            if piece.channel == "reasoning":
                kind, extra = "response.reasoning_text.delta", {}
            else:
                kind, extra = "response.output_text.delta", {"logprobs": []}
            return [*out, event(kind, **where(piece.channel), delta=piece.text, **extra)]

        finished_items: set[str] = set()
        starting = shell | {"status": "in_progress", "output": [], "usage": None}
        yield event("response.created", response=starting)
        yield event("response.in_progress", response=starting)
        async for _, got in stream_events([ticket]):
            if isinstance(got, Token):
                for piece in answer.add(got.token):
                    for chunk in delta(piece):
                        yield chunk
            elif isinstance(got, Finished):
                for piece in answer.finish(got):
                    for chunk in delta(piece):
                        yield chunk
                ending = [] if "content" in order else opened("content")  # an empty answer
                for chunk in [*ending, *closed("content")]:
                    yield chunk
                whole = await done(got)
                if whole["status"] != "cancelled":
                    kind = whole["status"]  # completed or incomplete
                    yield event(f"response.{kind}", response=whole)
            elif isinstance(got, StreamFailed):
                error = got.body["error"]
                if failed is not None:
                    await failed(error["message"], error["code"])
                yield event(
                    "error", code=error["code"], message=error["message"], param=error["param"]
                )


@dataclass
class ResponseRequest:
    """A Responses body, read (`response_request`): its job, the AnswerText its tokens go
    into, the response object but its output and usage (`shell`), what it was asked (the
    conversation it continues and its input: what a stored response keeps; `inputs`, its
    input's messages), `store`."""

    job: Job
    answer: AnswerText
    shell: dict
    conversation: list[dict]
    inputs: int
    store: bool

    def response(self, finished: Finished) -> dict:
        """The whole response once its job finished (its answer in `answer`); a cancelled
        job's is `cancelled`, with the answer so far."""
        out = openai_api.response_body(
            self.shell,
            content=self.answer.content,
            reasoning=self.answer.reasoning,
            reasoning_tokens=self.answer.thinking.count,
            finish_reason=finished.finish_reason,
            prompt_tokens=finished.prompt_tokens,
            cached_tokens=finished.cached_tokens,
            completion_tokens=finished.completion_tokens,
            completed_at=int(time.time()),
        )
        if finished.finish_reason == "cancelled":
            out |= {"status": "cancelled", "incomplete_details": None, "completed_at": None}
        return out


class EventLog:
    """A background response's stream events (SSE chunks), numbered as their sequence numbers,
    for any number of readers to follow (`follow`), from its start or later, until it ends."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.bytes = 0
        self.ended = False
        self._changed = asyncio.Event()

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.bytes += len(chunk)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()  # the readers waiting go on; later ones wait on a new one
        self._changed = asyncio.Event()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        """The events from number `start` on, as they come, until the log ends."""
        at = start
        while True:
            while at < len(self.chunks):
                yield self.chunks[at]
                at += 1
            if self.ended:
                return
            await self._changed.wait()


def response_request(
    body: dict,
    tok: Tokenizer,
    defaults: ServeDefaults,
    model_id: str,
    history: list[dict] | None,
    leading_ids: LeadingIds | None = None,
    context: int | None = None,
    response_id: str | None = None,
    created: int | None = None,
) -> ResponseRequest:
    """The ResponseRequest of a body whose fields were checked (`FIELDS`): `history`, the
    conversation of its previous_response_id (None where none can be continued, as in a
    batch's line: then giving one is a BodyError); its id and creation time new unless given
    (a background response run again). With `truncation: "auto"`, a prompt that
    `context` tokens cannot hold drops the conversation's oldest messages (not the
    instructions, not the last message) until it fits, as OpenAI's does; the response keeps
    what the model read. Tokenizes and compiles the body's pattern: call it off the event
    loop."""
    if body.get("previous_response_id") is not None and history is None:
        message = "previous_response_id continues a stored response; a batch's line stores none"
        raise BodyError(message, "previous_response_id")
    messages = openai_api.response_messages(body)
    system = messages[:1] if body.get("instructions") is not None else []
    conversation = [*(history or []), *messages[len(system) :]]
    think = openai_api.response_think(body.get("reasoning"), defaults.think)
    chat = openai_api.response_sampling_fields(body)
    params, max_tokens = sampling(chat, defaults, tok.vocab_size)  # a fresh seed where unset
    pattern = openai_api.response_structure(body.get("text"))

    def job_of(kept: list[dict]) -> Job:
        try:
            return chat_job(
                tok,
                [*system, *kept],
                think=think,
                params=params,
                max_tokens=max_tokens,
                leading_ids=leading_ids,
            )
        except TokenizerError as e:  # the chat template refused the messages
            raise APIError(400, str(e), param="input") from None

    job = job_of(conversation)
    inputs = len(messages) - len(system)
    if body.get("truncation") == "auto" and context is not None and len(job.prompt) >= context:
        # the fewest oldest messages to drop (a bisection: the prompt shrinks as more go)
        low, high = 1, len(conversation) - 1
        while low < high:
            mid = (low + high) // 2
            low, high = (
                (low, mid) if len(job_of(conversation[mid:]).prompt) < context else (mid + 1, high)
            )
        dropped = high
        conversation = conversation[dropped:]
        inputs = min(inputs, len(conversation))
        job = job_of(conversation)
    if pattern is not None:
        job = replace(job, grammar=grammar_of(tok, pattern, "text.format"))
    response_id = response_id or "resp_" + uuid.uuid4().hex
    created = int(time.time()) if created is None else created
    shell = openai_api.response_echo(body, params, response_id, created, model_id)
    answer = AnswerText(tok, think=think, strip=pattern is None)
    return ResponseRequest(job, answer, shell, conversation, inputs, shell["store"])


def _missing(response_id, param: str) -> APIError:
    """A response id the store does not hold: 404 where the path names it, 400 in a body."""
    status = 404 if param == "response_id" else 400
    message = f"no stored response with id {response_id!r}"
    return APIError(status, message, param=param, code="not_found")
