"""The OpenAI-compatible HTTP server: a Starlette app over one ServeEngine (`create_app`).

    GET  /health                 {"status": "ok"}; never needs the API key
    GET  /v1/models              the one model served (and /v1/models/{id}: it alone)
    POST /v1/chat/completions    messages → a chat.completion, or SSE chunks with `stream: true`
    POST /v1/completions         a text prompt → a text_completion, or SSE chunks
    POST /tokenize, /detokenize  a prompt's or messages' token ids (and the context), ids' text
    GET  /metrics                Prometheus text: the engine's stats, requests by endpoint/status

Bodies are read by `salabatch.openai_api`, as the Batch path reads request lines: the same
fields honoured and refused, and here `stream`, `stream_options.include_usage` honoured too. With
`n`, one request is n jobs of one prompt, seeds `seed`, `seed + 1`, ...: the first prefills it,
the others resume from its last snapshot (the engine begins interactive jobs one after another;
at the prompt's end, or 128 tokens before it where no message boundary marks a document off;
a stretch under `snapshot_min` is not snapshotted, and each prefills it again, together), and
their rows decode as one group; choice i is what a request with seed `seed + i` answers.
With `logprobs: true` (chat), each token of a choice comes with its log-probability, bytes and
`top_logprobs` most likely alternatives (`choices[i].logprobs.content`, streamed with the delta
that shows its text, or a later one where its text is held back); a completion's `logprobs: k`
gives OpenAI's legacy object (`TextLogprobs`); its `prompt` may be a list (of strings or token
lists: n choices each, in order), and `echo` puts each prompt before its answer, with `logprobs`
its tokens' scores first (a job with `prompt_logprobs`, scored as it goes, resuming only from
a prefix held with its scores; `max_tokens` 0 scores only). `response_format` (json_object,
json_schema) and vLLM's guided_json, guided_regex and guided_choice constrain the answer
(`engine.grammar`, compiled once per pattern, in a worker thread).

Errors are OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`): 400 a bad
or refused field (named in `param`), 401 a missing or wrong API key, 404 an unknown model or
route, 405 a method the route does not take (with `Allow`), 413 a body over `max_body` bytes,
429 the engine's queue is full (or cannot take all n jobs), 503 the engine is closed, 500 a
fault of the server's own (its traceback in the log). A client that goes away, mid-stream or
while waiting for a whole answer, cancels its jobs: their rows leave the batch at the engine's
next step.

The event loop never runs the model: the engine has its own thread, and rendering and tokenizing
a prompt (a long document) run in a worker thread.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import logging
import math
import re
import secrets
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Match, Route

from salabatch import openai_api
from salabatch.engine.grammar import Grammar
from salabatch.engine.sampling import TokenLogprob
from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import GenerationError, OutOfMemoryError, SalabatchError, TokenizerError
from salabatch.openai_api import BodyError
from salabatch.serve.completion import AnswerText, LeadingIds, Piece, chat_job, text_job
from salabatch.serve.engine import (
    EngineClosed,
    Event,
    Failed,
    Finished,
    Job,
    PromptLogprobs,
    QueueFull,
    ServeEngine,
    Ticket,
    Token,
    first_failure,
)

T = TypeVar("T")

MAX_BODY = 32 << 20  # bytes of a request body: a long document fits, a runaway upload does not
CHAT_FIELDS = (*openai_api.HONOURED, "stream", "stream_options")
COMPLETION_FIELDS = (*openai_api.TEXT_HONOURED, "stream", "stream_options")
TOKENIZE_FIELDS = (
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "chat_template_kwargs",
)
OPEN_PATHS = ("/health",)  # served without the API key
# an SSE comment sent after this many seconds without an event (a long prefill before the first
# token), so that proxies and clients that cut an idle connection keep it; clients ignore it
KEEP_ALIVE_S = 15.0
# a stream's status goes out with its first byte: first, up to this long for the engine to
# check its jobs, so that one it refuses (out of memory) gets its status (503), not a 200
# and an error event (`refused`)
CHECK_WAIT_S = 5.0
KEEP_ALIVE = b": keep-alive\n\n"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeDefaults:
    """What a request's unset sampling fields take (a job's `generation:` defaults)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request (OpenAI's way)
    think: bool = False


class APIError(Exception):
    """An OpenAI error response: its HTTP status and error object."""

    TYPES = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict:
        kind = self.TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        # a full queue frees as rows finish: the OpenAI client waits this long, not its backoff
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def create_app(
    engine: ServeEngine,
    tokenizer: Tokenizer,
    *,
    model_id: str,
    api_key: str | None = None,
    defaults: ServeDefaults = ServeDefaults(),
    max_body: int = MAX_BODY,
    routes: Sequence[Route] = (),
    starting: Sequence[Callable[[], Awaitable[None]]] = (),
) -> Starlette:
    """The ASGI app serving `engine` (started and closed by the caller) as the model
    `model_id`. With `api_key`, every endpoint but /health needs `Authorization: Bearer KEY`.
    `routes`: more endpoints (the Batch API's, `salabatch.serve.batches.routes`); `starting`:
    what to await once the event loop runs, before the first request (`Responses.resume`)."""
    server = _Server(engine, tokenizer, model_id, defaults, max_body)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for start in starting:
            await start()
        yield

    app = Starlette(
        lifespan=lifespan,
        routes=[
            Route("/health", server.health, methods=["GET"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/tokenize", server.tokenize, methods=["POST"]),
            Route("/detokenize", server.detokenize, methods=["POST"]),
            Route("/metrics", server.metrics, methods=["GET"]),
            *routes,
        ],
        exception_handlers={
            HTTPException: _http_error,
            APIError: _api_error,
            BodyError: _body_error,
            Exception: _server_error,
        },
    )
    # The last added runs first: every response is counted, the key check's 401s too.
    app.add_middleware(_KeyCheck, api_key=api_key)
    app.add_middleware(_Counting, counts=server.requests, routes=app.routes)
    return app


class _Server:
    """The endpoints, over one engine and its tokenizer."""

    def __init__(
        self,
        engine: ServeEngine,
        tok: Tokenizer,
        model_id: str,
        defaults: ServeDefaults,
        max_body: int,
    ) -> None:
        self.engine, self.tok, self.model_id = engine, tok, model_id
        self.defaults, self.max_body = defaults, max_body
        self.created = int(time.time())
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) → responses
        self.leading_ids = LeadingIds(tok)  # documents in system messages, tokenized once

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> Response:
        check_model(request.path_params["model_id"], self.model_id)
        return JSONResponse(self._model())

    def _model(self) -> dict:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "salabatch",
            "max_model_len": self.engine.model.config.context_length,  # as vLLM's model card
        }

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            prometheus(self.engine.stats(), self.requests),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    # ---- tokens (vLLM's /tokenize and /detokenize) ---------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """A prompt's token ids as /v1/completions takes it (`prompt`; BOS where the tokenizer
        adds one, unless `add_special_tokens` is false), or chat messages' as
        /v1/chat/completions renders them (`add_generation_prompt`, default true), with the
        context they must fit: a client checks a long document before it sends it."""
        body = await read_json(request, self.max_body)
        openai_api.check_fields(body, TOKENIZE_FIELDS, {})
        self._check_model(body)
        if ("prompt" in body) == ("messages" in body):
            raise BodyError("give prompt or messages, one of them", "prompt")
        flags = {}
        for name in ("add_special_tokens", "add_generation_prompt"):
            value = body.get(name, True)
            if not isinstance(value, bool):
                raise BodyError(f"{name} must be true or false", name)
            flags[name] = value
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise BodyError("prompt must be a string", "prompt")
            openai_api.text(prompt, "prompt")
            bos = self.tok.add_bos_token and flags["add_special_tokens"]
            ids = await run_in_threadpool(self.tok.encode, prompt, bos)
        else:
            messages = openai_api.messages(body["messages"])
            think = openai_api.think(body.get("chat_template_kwargs"), self.defaults.think)
            try:
                ids = await run_in_threadpool(
                    self.tok.chat_prompt_ids,
                    messages,
                    think=think,
                    add_generation_prompt=flags["add_generation_prompt"],
                )
            except TokenizerError as e:  # the chat template refused the messages
                raise APIError(400, str(e), param="messages") from None
        context = self.engine.model.config.context_length
        return JSONResponse({"count": len(ids), "max_model_len": context, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids (`tokens`), special tokens' text included."""
        body = await read_json(request, self.max_body)
        openai_api.check_fields(body, ("tokens",), {})
        self._check_model(body)
        tokens = body.get("tokens")
        vocab = self.tok.vocab_size
        if not (
            isinstance(tokens, list)
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
            )
        ):
            raise BodyError(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": await run_in_threadpool(self.tok.decode, tokens)})

    def _check_model(self, body: dict) -> None:
        """404 unless the body's `model`, where it names one, is the one served."""
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise BodyError("model must be a string", "model")
            check_model(model, self.model_id)

    # ---- completions -------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request, CHAT_FIELDS, {})
        stream, include_usage = _streaming(body)
        n, logprobs = choices(body, self.engine), openai_api.logprobs(body)
        messages = openai_api.messages(body.get("messages"))
        params, max_tokens = self._sampling(body)
        think = openai_api.think(body.get("chat_template_kwargs"), self.defaults.think)
        stops = openai_api.stop(body.get("stop"))
        try:  # a long document: tokenized off the event loop
            job = await run_in_threadpool(
                chat_job,
                self.tok,
                messages,
                think=think,
                params=params,
                max_tokens=max_tokens,
                stop_strings=stops,
                leading_ids=self.leading_ids,
            )
        except TokenizerError as e:  # the chat template refused the messages
            raise APIError(400, str(e), param="messages") from None
        grammar = await self._grammar(body)
        strip = grammar is None  # an answer held to a pattern keeps its spaces: its text
        answers = [
            AnswerText(self.tok, stop_strings=stops, think=think, strip=strip) for _ in range(n)
        ]
        job = replace(job, logprobs=logprobs, grammar=grammar)
        tickets = self._submit([job], n, "messages")
        reply = Reply(job.id, "chat.completion", self.model_id, int(time.time()))
        if stream:
            await refused(tickets, request)
            chunks = self._chat_chunks(tickets, answers, reply, include_usage, think)
            return EventStream(chunks, tickets)
        finished = await collect(tickets, answers, request)
        return JSONResponse(chat_completion(reply, answers, think, finished, self.tok))

    async def completions(self, request: Request) -> Response:
        body = await self._body(request, COMPLETION_FIELDS, {"best_of": 1})
        stream, include_usage = _streaming(body)
        # prompts tokenized, a pattern compiled: off the event loop
        text = await run_in_threadpool(text_request, body, self.tok, self.engine, self.defaults)
        tickets = self._submit(text.jobs, text.n, "prompt")
        answers = text.answers(self.tok)
        reply = Reply(text.jobs[0].id, "text_completion", self.model_id, int(time.time()))
        if stream:
            await refused(tickets, request)
            chunks = self._text_chunks(tickets, answers, text, reply, include_usage)
            return EventStream(chunks, tickets)
        finished = await collect(tickets, answers, request)
        return JSONResponse(text_completion(reply, text, answers, finished, self.tok))

    def _sampling(self, body: dict):
        return sampling(body, self.defaults, self.tok.vocab_size)

    async def _grammar(self, body: dict) -> Grammar | None:
        """The grammar of the body's response_format (or guided_*), compiled off the loop."""
        pattern = openai_api.structure(body)
        if pattern is None:
            return None
        field = openai_api.structure_field(body)
        return await run_in_threadpool(grammar_of, self.tok, pattern, field)

    async def _body(self, request: Request, fields: tuple[str, ...], no_op: dict) -> dict:
        return await read_body(request, self.max_body, fields, no_op, self.model_id)

    def _submit(self, jobs: Sequence[Job], n: int, param: str) -> list[Ticket]:
        """The tickets of each job's n choices (`seeded`), job by job; 400 for a prompt the
        model's context cannot hold (the engine would fail it, but a stream's status is sent
        before its first event), 429 when the queue cannot take them all (none is then
        submitted)."""
        for job in jobs:
            check_context(job, self.engine.model.config.context_length, param)
        choices = [one for job in jobs for one in seeded(job, n)]
        try:
            return self.engine.submit_all(choices, asyncio.get_running_loop())
        except (QueueFull, EngineClosed) as e:
            raise engine_error(e) from None

    # ---- streams -------------------------------------------------------------------------

    async def _chat_chunks(
        self,
        tickets: list[Ticket],
        answers: list[AnswerText],
        reply: Reply,
        include_usage: bool,
        think: bool,
    ) -> AsyncIterator[bytes]:
        extra = {"usage": None} if include_usage else {}

        held: dict[int, list[dict]] = {}  # logprobs of tokens whose text is not sent yet

        def chunk(i: int, delta: dict, finish_reason: str | None = None) -> bytes:
            lp = {"content": held.pop(i), "refusal": None} if held.get(i) else None
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            return sse(reply.chunk([choice], **extra))

        def delta(i: int, piece: Piece) -> bytes:
            channel = "reasoning_content" if piece.channel == "reasoning" else "content"
            return chunk(i, {channel: piece.text})

        for i in range(len(tickets)):
            yield chunk(i, {"role": "assistant", "content": ""})
        finished: dict[int, Finished] = {}
        async for i, event in stream_events(tickets):
            if isinstance(event, Token):
                if event.logprob is not None:
                    held.setdefault(i, []).append(openai_api.logprob_entry(self.tok, event.logprob))
                for piece in answers[i].add(event.token):
                    yield delta(i, piece)
            elif isinstance(event, Finished):
                for piece in answers[i].finish(event):
                    yield delta(i, piece)
                yield chunk(i, {}, event.finish_reason)
                finished[i] = event
                if include_usage and len(finished) == len(tickets):
                    counted = chat_usage(_in_order(finished), answers, think)
                    yield sse(reply.chunk([], usage=counted))
            else:
                yield sse(event.body)
        yield b"data: [DONE]\n\n"

    async def _text_chunks(
        self,
        tickets: list[Ticket],
        answers: list[AnswerText],
        text: TextRequest,
        reply: Reply,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The chunks of a text completion: with `echo`, each choice's prompt first (with its
        scores, where they were asked for, once the prefill has made them)."""
        extra = {"usage": None} if include_usage else {}
        held: dict[int, list[TokenLogprob]] = {}  # of tokens whose text is not sent yet
        offsets = [TextLogprobs(self.tok) for _ in tickets]

        def chunk(i: int, text: str, finish_reason: str | None = None, lp=None) -> bytes:
            if lp is None and held.get(i):
                lp = offsets[i].of(held.pop(i))
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            return sse(reply.chunk([choice], **extra))

        echoed = [text.echoed[i // text.n] for i in range(len(tickets))]
        for i, ticket in enumerate(tickets):
            if echoed[i] and ticket.job.prompt_logprobs is None:
                yield chunk(i, echoed[i])
        finished: dict[int, Finished] = {}
        async for i, event in stream_events(tickets):
            if isinstance(event, Token):
                if event.logprob is not None:
                    held.setdefault(i, []).append(event.logprob)
                for piece in answers[i].add(event.token):
                    yield chunk(i, piece.text)
            elif isinstance(event, PromptLogprobs):
                lp = offsets[i].of_prompt(tickets[i].job.prompt, event.logprobs)
                yield chunk(i, echoed[i], lp=lp if tickets[i].job.logprobs is not None else None)
            elif isinstance(event, Finished):
                rest = "".join(p.text for p in answers[i].finish(event))
                yield chunk(i, rest, event.finish_reason)
                finished[i] = event
                if include_usage and len(finished) == len(tickets):
                    yield sse(reply.chunk([], usage=usage(_in_order(finished), text.n)))
            else:
                yield sse(event.body)
        yield b"data: [DONE]\n\n"


@dataclass(frozen=True)
class TextRequest:
    """A text completion's body, read (`text_request`): a job per prompt (each of its `n`
    choices a seed of it, `seeded`), and what its choices show: `echoed`, each prompt's text
    where `echo` puts it before its answers (else ""), `logprobs` where they are asked for."""

    jobs: list[Job]
    n: int
    echo: bool
    logprobs: int | None
    stops: tuple[str, ...]
    echoed: list[str]

    def answers(self, tok: Tokenizer) -> list[AnswerText]:
        """An AnswerText for each choice, in order (choice p·n + j: prompt p's j-th)."""
        return [
            AnswerText(tok, stop_strings=self.stops, split_think=False, after=job.prompt)
            for job in self.jobs
            for _ in range(self.n)
        ]


def text_request(body: dict, tok: Tokenizer, engine: ServeEngine, defaults) -> TextRequest:
    """The jobs of a text completion's body (its fields checked already): each prompt
    tokenized (BodyError naming a bad one), its pattern compiled; at most as many choices in
    all as the engine's rows and queue hold. Echo with logprobs scores each prompt (a job with
    `prompt_logprobs`), and with max_tokens 0 that is all it does. Tokenizes: call it off the
    event loop."""
    n, logprobs = choices(body, engine), openai_api.text_logprobs(body)
    prompts, echo = openai_api.prompts(body.get("prompt")), openai_api.echo(body)
    if len(prompts) * n > (most := engine.batch_size + engine.max_queue):
        raise BodyError(
            f"{len(prompts)} prompts × n {n} are {len(prompts) * n} answers; the engine's rows "
            f"and queue hold {most} (batch_size + max_queue)",
            "prompt",
        )
    params, max_tokens = sampling(body, defaults, tok.vocab_size, least_tokens=0 if echo else 1)
    stops = openai_api.stop(body.get("stop"))
    scored = None
    if echo and (logprobs is not None or max_tokens == 0):
        scored = logprobs or 0
    pattern = openai_api.structure(body)
    grammar = (
        None if pattern is None else grammar_of(tok, pattern, openai_api.structure_field(body))
    )
    jobs = []
    for prompt in prompts:
        job = text_job(tok, prompt, params=params, max_tokens=max_tokens, stop_strings=stops)
        jobs.append(replace(job, logprobs=logprobs, grammar=grammar, prompt_logprobs=scored))
    echoed = [_prompt_text(tok, p) if echo else "" for p in prompts]
    return TextRequest(jobs, n, echo, logprobs, stops, echoed)


def text_completion(
    reply: Reply,
    text: TextRequest,
    answers: Sequence[AnswerText],
    finished: Sequence[Finished],
    tok: Tokenizer,
) -> dict:
    """The text_completion object of finished answers, one choice each: with `echo` its
    prompt first, in its text and its logprobs."""
    out = []
    for i, (answer, last) in enumerate(zip(answers, finished, strict=True)):
        prompt = text.jobs[i // text.n].prompt
        lp = None
        if text.logprobs is not None:
            lp = _choice_logprobs(tok, prompt if text.echo else None, answer)
        out.append(
            {
                "index": i,
                "text": text.echoed[i // text.n] + answer.content,
                "logprobs": lp,
                "finish_reason": last.finish_reason,
            }
        )
    return reply.body(out, usage(finished, text.n))


@dataclass(frozen=True)
class Reply:
    """What every object of one response shares: its id, kind and model."""

    id: str
    object: str  # "chat.completion" or "text_completion"
    model: str
    created: int  # seconds since the epoch, as OpenAI's

    def body(self, choices: list, usage: dict) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": None,
        }

    def chunk(self, choices: list, **extra: Any) -> dict:
        kind = "chat.completion.chunk" if self.object == "chat.completion" else self.object
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
            **extra,
        }


def chat_completion(
    reply: Reply,
    answers: Sequence[AnswerText],
    think: bool,
    finished: Sequence[Finished],
    tok: Tokenizer,
) -> dict:
    """The chat.completion object of finished answers, one choice each (the reasoning apart
    with `think`; the log-probabilities of its tokens where its job asked for them)."""
    out = []
    for i, (answer, last) in enumerate(zip(answers, finished, strict=True)):
        message = {"role": "assistant", "content": answer.content, "refusal": None}
        if think:
            message["reasoning_content"] = answer.reasoning
        lp = None
        if answer.logprobs is not None:
            content = [openai_api.logprob_entry(tok, x) for x in answer.logprobs]
            lp = {"content": content, "refusal": None}
        out.append(
            {"index": i, "message": message, "logprobs": lp, "finish_reason": last.finish_reason}
        )
    return reply.body(out, chat_usage(finished, answers, think))


def chat_usage(finished: Sequence[Finished], answers: Sequence[AnswerText], think: bool) -> dict:
    """`usage` of a chat completion, streamed or whole: with `think`, the think blocks'
    generated tokens as `completion_tokens_details.reasoning_tokens` (a run's export counts
    them alike)."""
    counted = usage(finished)
    if think:
        thought = sum(a.thinking.count for a in answers)
        counted.setdefault("completion_tokens_details", {})["reasoning_tokens"] = thought
    return counted


class TextLogprobs:
    """A text completion's `logprobs` (OpenAI's legacy object) for its tokens, in order across
    calls (a stream's chunks): `tokens` (each one's text), `token_logprobs`, `top_logprobs`
    ({text: logprob} of its alternatives and itself) and `text_offset` (where its text starts in
    the completion, in characters of the answer's decoded bytes; a special token, which the
    text leaves out, as BOS, takes none of them)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0  # characters of the tokens so far
        added = tok.backend.get_added_tokens_decoder()
        self._special = frozenset(i for i, t in added.items() if t.special)

    def of_prompt(self, prompt: Sequence[int], scores: Sequence[TokenLogprob]) -> dict:
        """The entries of an echoed prompt: its first token's with no log-probability (nothing
        comes before it: null, as OpenAI's), then those of `scores`, the tokens after it."""
        first = self.of([TokenLogprob(prompt[0], 0.0)])
        first["token_logprobs"], first["top_logprobs"] = [None], [None]
        return _joined(first, self.of(scores))

    def of(self, logprobs: Sequence[TokenLogprob]) -> dict:
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for lp in logprobs:
            raw = self.tok.token_bytes(lp.token)
            text = raw.decode(errors="replace")
            top = {self.tok.token_bytes(t).decode(errors="replace"): v for t, v in lp.top}
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top | {text: lp.logprob})
            out["text_offset"].append(self._chars)
            if lp.token not in self._special:
                self._chars += len(self._text.decode(raw))
        return out


def _choice_logprobs(tok: Tokenizer, prompt: Sequence[int] | None, answer: AnswerText) -> dict:
    """A text choice's legacy logprobs object: its echoed `prompt`'s tokens first, where it was
    echoed, then its answer's."""
    offsets = TextLogprobs(tok)
    head = None if prompt is None else offsets.of_prompt(prompt, answer.prompt_logprobs)
    own = offsets.of(answer.logprobs or ())
    return own if head is None else _joined(head, own)


def _joined(a: dict, b: dict) -> dict:
    """Two legacy logprobs objects of consecutive tokens as one."""
    return {key: a[key] + b[key] for key in a}


def choices(body: dict, engine: ServeEngine) -> int:
    """The body's `n`, at most what the engine's rows and queue hold at once."""
    most = engine.batch_size + engine.max_queue
    why = f"batch_size {engine.batch_size} + max_queue {engine.max_queue}: the rows and queue"
    return openai_api.choices(body, most, why)


def grammar_of(tok: Tokenizer, pattern: str, field: str) -> Grammar:
    """`pattern` compiled against `tok`'s vocabulary (`Tokenizer.grammars`); one outlines-core
    cannot compile a BodyError naming `field`, the body's field it came from."""
    try:
        return tok.grammars.regex(pattern, field)
    except GenerationError as e:
        raise BodyError(str(e), field) from None


def seeded(job: Job, n: int) -> list[Job]:
    """The jobs of `job`'s n choices: the same prompt, seeds seed, seed + 1, ..."""
    seed = job.params.seed
    return [replace(job, params=replace(job.params, seed=seed + i)) for i in range(n)]


def sampling(body: dict, defaults: ServeDefaults, vocab: int, least_tokens: int = 1):
    """The body's sampling settings and max tokens (at least `least_tokens`; a logit_bias
    token under `vocab`); a request without a seed gets a fresh one unless the server has a
    default (a seed matters only with temperature > 0)."""
    if defaults.seed is None:
        defaults = replace(defaults, seed=secrets.randbits(31))
    return openai_api.sampling(body, defaults, least_tokens, vocab)


async def read_body(
    request: Request, max_body: int, fields: tuple[str, ...], no_op: dict, model_id: str
) -> dict:
    """The request's JSON object (at most `max_body` bytes), its fields checked (`fields`
    honoured, `no_op` at those values) and its model `model_id`."""
    body = await read_json(request, max_body)
    openai_api.check_fields(body, fields, no_op)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "model is missing", param="model")
    check_model(model, model_id)
    return body


def check_context(job: Job, context: int, param: str) -> None:
    """400 (`context_length_exceeded`, naming `param`) for a prompt the model's context
    cannot hold: the engine would fail it, but a stream's status is sent before its first
    event."""
    if len(job.prompt) >= context:
        raise APIError(
            400,
            f"the prompt has {len(job.prompt)} tokens; the model's context holds {context} "
            "(with room for one generated token)",
            param=param,
            code="context_length_exceeded",
        )


async def refused(tickets: Sequence[Ticket], request: Request) -> None:
    """Before a stream's status is sent: the APIError (`engine_error`: 503 out of memory) of
    the first of its jobs the engine fails while it checks them (`first_failure`, at most
    CHECK_WAIT_S), all of them cancelled; nothing once each is begun, or one has an event to
    send, or the time is up (a later failure is the stream's error event). A client that
    leaves meanwhile cancels them at once."""
    failed = await while_connected(request, tickets, first_failure(tickets, CHECK_WAIT_S))
    if failed is not None:
        for ticket in tickets:
            ticket.cancel()
        raise engine_error(failed.error)


def check_model(model: str, served: str) -> None:
    """APIError 404 unless `model` is the one served."""
    if model != served:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def usage(finished: Sequence[Finished], n: int | None = None) -> dict:
    """OpenAI's usage object of a request's finished jobs (its choices, in order, `n` to a
    prompt: all where unset): each prompt once, as its first choice read it (the others resume
    from its prefill), the completion tokens of all; with drafts (speculative decoding), their
    counts as OpenAI counts a predicted output's."""
    firsts = finished[:: n or len(finished)]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finished)
    drafted = sum(f.draft_tokens for f in finished)
    accepted = sum(f.accepted_tokens for f in finished)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)},
    }
    if drafted:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return out


def sse(data: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


@dataclass(frozen=True)
class StreamFailed:
    """A job that failed after its stream began (its status sent already): an error event."""

    body: dict


async def _merged(tickets: Sequence[Ticket]) -> AsyncIterator[tuple[int, Event]]:
    """The events of `tickets` (submitted on this event loop) as they come, each with its
    ticket's index, until every ticket has ended. Closing it early cancels the tickets."""
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def pump(i: int, ticket: Ticket) -> None:
        async for event in ticket:
            queue.put_nowait((i, event))

    tasks = [asyncio.create_task(pump(i, t)) for i, t in enumerate(tickets)]
    try:
        left = len(tickets)
        while left:
            i, event = await queue.get()
            left -= isinstance(event, Finished | Failed)
            yield i, event
    finally:
        for ticket, task in zip(tickets, tasks, strict=True):
            ticket.cancel()
            task.cancel()


async def stream_events(
    tickets: Sequence[Ticket],
) -> AsyncIterator[tuple[int, Token | Finished | StreamFailed]]:
    """The tickets' events (`_merged`), a Failed as the error event to send (the status is
    already 200), after which the others are cancelled and nothing more comes."""
    async with aclosing(_merged(tickets)) as events:
        async for i, event in events:
            if isinstance(event, Failed):
                yield i, StreamFailed(engine_error(event.error).body)
                return
            yield i, event


async def collect(
    tickets: Sequence[Ticket], answers: Sequence[AnswerText], request: Request
) -> list[Finished]:
    """The whole answers into `answers` (→ each ticket's Finished, in order); a failed ticket
    fails them all (the others are cancelled), and a client that goes away first cancels them."""
    last: dict[int, Finished | Failed] = {}

    async def read() -> None:
        async with aclosing(_merged(tickets)) as events:
            async for i, event in events:
                if isinstance(event, Token):
                    answers[i].add(event.token, event.logprob)
                    continue
                if isinstance(event, PromptLogprobs):
                    answers[i].prompt_logprobs = event.logprobs
                    continue
                last[i] = event
                if isinstance(event, Failed):
                    return  # closing `events` cancels the others

    await while_connected(request, tickets, read())
    if failed := [e for e in last.values() if isinstance(e, Failed)]:
        raise engine_error(failed[0].error)
    finished = _in_order(last)
    for answer, one in zip(answers, finished, strict=True):
        answer.finish(one)
    return finished


async def while_connected(request: Request, tickets: Sequence[Ticket], work: Awaitable[T]) -> T:
    """What `work` gives; a client that leaves before it ends cancels `tickets` (their jobs
    then end, and `work` with them)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for ticket in tickets:
            ticket.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        result = await work
        group.cancel_scope.cancel()
    return result


def _in_order(finished: dict[int, Finished]) -> list[Finished]:
    return [finished[i] for i in range(len(finished))]


class EventStream(StreamingResponse):
    """An SSE response whose tickets are cancelled however it ends: a client gone mid-stream
    stops its rows at the engine's next step (a finished ticket ignores the cancel). A
    KEEP_ALIVE comment goes out after KEEP_ALIVE_S seconds with no event."""

    def __init__(self, chunks: AsyncGenerator[bytes], tickets: Sequence[Ticket]) -> None:
        super().__init__(
            _kept_alive(chunks, KEEP_ALIVE_S),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.tickets = tickets

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for ticket in self.tickets:
                ticket.cancel()


async def _kept_alive(chunks: AsyncGenerator[bytes], every: float) -> AsyncIterator[bytes]:
    """`chunks`, with KEEP_ALIVE between two of them `every` seconds apart or more. The next
    chunk is awaited in a task of its own (one at a time), cancelled if the stream ends first.
    A fault of the server's own in `chunks` is logged and ends the stream with an error event
    and [DONE] (a client's SDK raises it; the status was sent already)."""
    source = aiter(chunks)
    pending = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            except Exception as e:
                log.exception("a stream failed")
                yield sse(_fault(e).body) + b"data: [DONE]\n\n"
                return
            yield chunk
            pending = asyncio.ensure_future(anext(source))
    finally:
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await source.aclose()


def engine_error(error: SalabatchError) -> APIError:
    """The HTTP error of an engine failure: 429 queue full, 503 closed or out of memory, 400 a
    job the engine refused (ValueError: its prompt or settings), 500 anything else."""
    if isinstance(error, QueueFull):
        return APIError(429, str(error), code="queue_full")
    if isinstance(error, EngineClosed):
        return APIError(503, str(error), code="engine_closed")
    cause = getattr(error, "cause", error)  # JobFailed: what stopped the job
    if isinstance(cause, OutOfMemoryError):
        return APIError(503, str(error), code="out_of_memory")
    if isinstance(cause, ValueError | BodyError | TokenizerError):
        return APIError(400, str(error), code="invalid_request")
    return APIError(500, str(error), code="engine_error")


def _streaming(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage) of a body."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BodyError("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BodyError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise BodyError("stream_options must be an object", "stream_options")
    unknown = sorted(k for k in options if k != "include_usage")
    if unknown:
        raise BodyError(
            f"unsupported field: stream_options.{unknown[0]}", f"stream_options.{unknown[0]}"
        )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise BodyError(
            "stream_options.include_usage must be true or false", "stream_options.include_usage"
        )
    return stream, include


def _prompt_text(tok: Tokenizer, prompt: str | list[int]) -> str:
    """What `echo` sends back of a prompt: the string as sent, or token ids' text."""
    return prompt if isinstance(prompt, str) else tok.decode(prompt, skip_special=True)


def methods_route(path: str, **handlers: Callable) -> Route:
    """One route for `path` whose methods (`GET=handler`, ...) each have their handler: a path
    must be one route, for a 405's `Allow` (which Starlette takes from the first route whose
    path matches) to list every method it takes."""

    async def dispatch(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await handlers[method](request)

    return Route(path, dispatch, methods=list(handlers))


def query_int(query, name: str, default: int, low: int, high: int | None) -> int:
    """Query parameter `name` as an integer from `low` to `high` (None: no bound), or a 400
    naming it."""
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw) if raw.isascii() else None
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"{low} or more"
        raise APIError(400, f"{name} must be an integer {bounds}", param=name)
    return value


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (by Content-Length, then as read)."""
    declared = request.headers.get("content-length")
    too_large = APIError(
        413, f"request body is larger than {limit} bytes", code="request_too_large"
    )
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise too_large
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise too_large
    try:  # a long document's body takes a while to parse: off the event loop
        body = (
            json.loads(data) if len(data) < 1 << 20 else await run_in_threadpool(json.loads, data)
        )
    except ValueError as e:  # not UTF-8, not JSON, or an integer past Python's 4,300 digits
        raise APIError(400, f"the body is not valid JSON ({e})") from None
    except RecursionError:  # arrays nested past Python's stack: no body of ours is
        raise APIError(400, "the body is not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


# ---- errors --------------------------------------------------------------------------------


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = exc.detail
    response = APIError(
        exc.status_code, message, code="not_found" if exc.status_code == 404 else None
    ).response()
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _body_error(request: Request, exc: BodyError) -> Response:
    return APIError(400, str(exc), param=exc.param).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    """A fault of the server's own, as an OpenAI error object (Starlette logs the traceback
    after this answer)."""
    return _fault(exc).response()


def _fault(exc: Exception) -> APIError:
    """The 500 of a fault of the server's own: its type, the details in the log."""
    message = f"internal server error ({type(exc).__name__}); the server's log has the details"
    return APIError(500, message, code="internal_error")


class _KeyCheck:
    """ASGI middleware: with a key, every path but OPEN_PATHS needs `Authorization: Bearer KEY`
    (compared in constant time)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        message = "invalid API key" if header else "missing API key (Authorization: Bearer KEY)"
        response = APIError(401, message, code="invalid_api_key").response()
        await response(scope, receive, send)


class _Counting:
    """ASGI middleware: counts responses by endpoint (the path of the route the request
    matches, as `/v1/batches/{batch_id}`, else "other") and status."""

    def __init__(self, app, counts: Counter, routes: Sequence[Route]) -> None:
        self.app, self.counts, self.routes = app, counts, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        routes = (r for r in self.routes if r.matches(scope)[0] != Match.NONE)
        endpoint = next((r.path_format for r in routes), "other")

        started = False

        async def counted(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counts[endpoint, message["status"]] += 1
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:  # Starlette's outermost layer answers it with a 500
                self.counts[endpoint, 500] += 1
            raise


# ---- metrics -------------------------------------------------------------------------------

_BUCKET = re.compile(r"^(?P<name>.+)_bucket_(?P<le>[^_]+)$")


def prometheus(stats: dict[str, float], requests: Counter) -> str:
    """Prometheus text exposition of the engine's stats and the app's request counts.

    A stat `{h}_bucket_{le}` is a bucket of histogram `h` (with `{h}_sum`, `{h}_count`); a name
    ending in `_total` is a counter; the rest are gauges. Every name gets the `salabatch_`
    prefix."""
    lines: list[str] = []
    histograms: dict[str, list[tuple[float, str, float]]] = {}
    for key, value in stats.items():
        if m := _BUCKET.match(key):
            le = m["le"]
            bound = math.inf if le.lower() in ("inf", "+inf") else float(le)
            histograms.setdefault(m["name"], []).append((bound, le, value))
    for name, buckets in sorted(histograms.items()):
        full = _name(name)
        lines.append(f"# TYPE {full} histogram")
        for bound, _, value in sorted(buckets):
            le = "+Inf" if math.isinf(bound) else _number(bound)
            lines.append(f'{full}_bucket{{le="{le}"}} {_number(value)}')
        for part in ("sum", "count"):
            if f"{name}_{part}" in stats:
                lines.append(f"{full}_{part} {_number(stats[f'{name}_{part}'])}")
    shown = {f"{n}_{p}" for n in histograms for p in ("sum", "count")}
    for key, value in sorted(stats.items()):
        if _BUCKET.match(key) or key in shown:
            continue
        full = _name(key)
        lines.append(f"# TYPE {full} {'counter' if key.endswith('_total') else 'gauge'}")
        lines.append(f"{full} {_number(value)}")
    lines.append("# TYPE salabatch_http_requests_total counter")
    for (endpoint, status), n in sorted(requests.items()):
        lines.append(
            f'salabatch_http_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}'
        )
    return "\n".join(lines) + "\n"


def _name(key: str) -> str:
    key = re.sub(r"[^a-zA-Z0-9_:]", "_", key)
    return key if key.startswith("salabatch_") else f"salabatch_{key}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
