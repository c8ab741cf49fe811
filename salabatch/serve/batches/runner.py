"""The batch runner: one thread that takes batches in the order they came and answers their
lines through the server's ServeEngine, as the batch's endpoint answers a request: a chat
completion's (the same body checks, the same Job with a boundary where the system messages end,
so lines sharing a document prefill it once), a text completion's (its prompts, `echo` and
legacy `logprobs` as `/v1/completions` takes them) or a response's (as `/v1/responses` reads
it; a line neither continues a stored response nor is stored); a line's `n` choices are n jobs,
`app.seeded`. A line is taken while fewer
than `in_flight` jobs of the batch are in the engine, so chat requests arriving meanwhile join
the next step rather than wait behind the batch.

    validating   the input file is read and checked; a bad one → failed, its `errors` listed
    in_progress  each answered line is recorded in the store before the next is taken
    finalizing   the output file (answered lines) and error file (refused or failed lines)
    completed | failed | cancelling → cancelled (the lines answered so far are its files)

`start()` resumes what a killed server left: validating, in_progress and finalizing batches go
on from their recorded lines (none answered twice); cancelling ones end cancelled.

A fault of the server's own ends a line as a 500 in the error file, or, outside any line, the
batch as failed (`errors` saying so; its traceback in the log): the thread goes on with the next
line and the next batch, and a restart does not meet the same fault again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import replace

from salabatch import openai_api
from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import SalabatchError, TokenizerError
from salabatch.openai_api import BodyError
from salabatch.serve import responses
from salabatch.serve.app import (
    APIError,
    Reply,
    ServeDefaults,
    chat_completion,
    check_model,
    choices,
    engine_error,
    grammar_of,
    sampling,
    seeded,
    text_completion,
    text_request,
)
from salabatch.serve.batches.store import OPEN, BatchStore, new_id
from salabatch.serve.completion import AnswerText, LeadingIds, chat_job
from salabatch.serve.engine import (
    EngineClosed,
    Failed,
    PromptLogprobs,
    QueueFull,
    ServeEngine,
    Token,
)

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
RESPONSES = "/v1/responses"
ENDPOINTS = (CHAT, TEXT, RESPONSES)
WINDOW_S = 24 * 3600  # completion_window "24h"
DEFAULTS = ServeDefaults()
MAX_REQUESTS = 50_000  # request lines a batch may hold (OpenAI's limit, beside 200 MB a file)
MAX_ERRORS = 100  # errors a failed validation lists (one more entry counts the rest)
IN_FLIGHT = 2  # jobs of a batch in the engine at once: chat requests keep the other rows
log = logging.getLogger(__name__)


class BatchRunner:
    """Runs the store's batches on `engine` (started and closed by the caller, around
    `start()` and `close()`)."""

    def __init__(
        self,
        engine: ServeEngine,
        tok: Tokenizer,
        store: BatchStore,
        *,
        model_id: str,
        defaults: ServeDefaults = DEFAULTS,
        in_flight: int = IN_FLIGHT,
        window_s: float = WINDOW_S,
    ) -> None:
        self.engine, self.tok, self.store = engine, tok, store
        self.model_id, self.defaults, self.in_flight = model_id, defaults, in_flight
        self.window_s = window_s  # a batch not done this long after its creation expires
        self.leading_ids = LeadingIds(tok)  # its lines' documents, each tokenized once
        self._cv = threading.Condition()
        self._queue: deque[str] = deque()
        self._tickets: list = []  # of the batch running: cancelled by cancel() and close()
        self._current: str | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the callers' side -------------------------------------------------------------------

    def start(self) -> None:
        """Queues the batches a previous server left open, then starts the thread."""
        for batch in self.store.open_batches():
            if batch["status"] == "cancelling":
                self._end_cancelled(batch["id"])
            else:
                self._queue.append(batch["id"])
        self._thread = threading.Thread(target=self._loop, name="salabatch-batches", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops after the lines in flight (their tickets cancelled, their lines not recorded:
        a restarted server answers them)."""
        with self._cv:
            self._stopping = True
            for ticket in self._tickets:
                ticket.cancel()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def create(self, input_file_id: str, metadata: dict | None, endpoint: str = CHAT) -> dict:
        """A new batch of requests to `endpoint` (one of ENDPOINTS), validating, queued."""
        now = int(time.time())
        batch = {
            "id": new_id("batch"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + round(self.window_s),
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        self.store.add_batch(batch)
        with self._cv:
            self._queue.append(batch["id"])
            self._cv.notify_all()
        return self.store.batch(batch["id"])

    def cancel(self, batch_id: str) -> dict | None:
        """Marks a validating or in-progress batch cancelling: the runner ends it cancelled,
        at once where it waits behind another batch; one cancelling or cancelled already is
        returned as it is; APIError 400 for one that finished otherwise (not 409, which the
        OpenAI SDK retries); None for no such batch."""

        def cancelling(batch: dict) -> dict | None:
            if batch["status"] in ("cancelling", "cancelled"):
                return None
            if batch["status"] not in ("validating", "in_progress"):
                message = f"batch {batch_id} is {batch['status']}: it cannot be cancelled"
                raise APIError(400, message, param="batch_id")
            return {**batch, "status": "cancelling", "cancelling_at": int(time.time())}

        batch = self.store.update_batch(batch_id, cancelling)
        if batch is None or batch["status"] != "cancelling":
            return batch
        with self._cv:
            queued = batch_id in self._queue
            if queued:  # waiting behind another batch: none of its lines runs
                self._queue.remove(batch_id)
            if self._current == batch_id:
                for ticket in self._tickets:
                    ticket.cancel()
            self._cv.notify_all()
        if queued:
            self._end_cancelled(batch_id)
            return self.store.batch(batch_id)
        return batch

    # ---- the thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                self._current = batch_id = self._queue.popleft()
            try:
                self._run(batch_id)
            except EngineClosed:
                return  # the server is stopping: a restart resumes the batch
            except Exception as e:
                log.exception("batch %s failed", batch_id)
                self._fail(batch_id, e)
            finally:
                self._current = None

    def _run(self, batch_id: str) -> None:
        """Takes a batch from where it is (a restart's too) to its end. Each change of status
        is made only from the status it was seen in, so a cancel that lands meanwhile wins
        and the batch then ends cancelled."""
        batch = self.store.batch(batch_id)
        status = None if batch is None else batch["status"]
        if status not in ("validating", "in_progress", "finalizing"):
            if status == "cancelling":
                self._end_cancelled(batch_id)
            return
        lines, errors = self._read_input(batch["input_file_id"], batch["endpoint"])
        if status == "validating":
            if errors:
                listed = {"object": "list", "data": errors}
                self._set(batch_id, "failed", ("validating",), errors=listed)
            else:
                total = {"total": len(lines), "completed": 0, "failed": 0}
                self._set(batch_id, "in_progress", ("validating",), request_counts=total)
        elif errors:  # its input is gone since it was validated (a disk's fault)
            self._fail(batch_id, errors)
            return
        if self.store.status(batch_id) == "in_progress":
            done = self.store.done_lines(batch_id)
            todo = [x for x in lines if x[0] not in done]
            if not self._answer(batch_id, todo, batch["endpoint"], batch["expires_at"]):
                return
        status = self.store.status(batch_id)
        if status == "in_progress" and time.time() >= batch["expires_at"]:
            done = self.store.done_lines(batch_id)
            for number, custom_id, _ in (x for x in lines if x[0] not in done):
                self.store.add_line(batch_id, number, _expired_line(custom_id), failed=True)
            if self._set(batch_id, "expired", ("in_progress",), **self._write_files(batch_id)):
                return
        elif status in ("in_progress", "finalizing") and self._set(
            batch_id, "finalizing", ("in_progress", "finalizing")
        ):
            self._set(batch_id, "completed", ("finalizing",), **self._write_files(batch_id))
            return
        if self.store.status(batch_id) == "cancelling":
            self._end_cancelled(batch_id)

    def _answer(
        self, batch_id: str, lines: list[tuple[int, str, dict]], endpoint: str, expires_at: int
    ) -> bool:
        """Answers `lines` (line, custom_id, body) as `endpoint` does, `in_flight` jobs at a
        time, recording each line as it ends, until they are answered, the batch is cancelled
        or `expires_at` passes; False when the runner stopped first (the rest stay
        unanswered)."""
        pending, running = deque(lines), deque()
        while pending or running:
            stop = self.store.status(batch_id) == "cancelling" or time.time() >= expires_at
            if self._stopping or stop:
                for _, tickets, _ in running:
                    for ticket in tickets:
                        ticket.cancel()
                return not self._stopping
            while pending and sum(len(t) for _, t, _ in running) < self.in_flight:
                number, custom_id, body = pending[0]
                try:
                    tickets, answers, respond = self._submit(body, endpoint)
                except QueueFull:
                    break  # chat has the queue: take this line when a row frees
                except (APIError, BodyError, TokenizerError) as e:
                    error = e if isinstance(e, APIError) else _refused(e)
                    self._record(batch_id, number, custom_id, None, error)
                except EngineClosed:
                    raise
                except Exception as e:
                    log.exception("batch %s: line %d failed", batch_id, number)
                    self._record(batch_id, number, custom_id, None, _fault(e))
                else:
                    running.append(((number, custom_id), tickets, (answers, respond)))
                    with self._cv:
                        self._tickets.extend(tickets)
                pending.popleft()
            if not running:
                time.sleep(0.05)  # the queue was full
                continue
            (number, custom_id), tickets, (answers, respond) = running.popleft()
            last = []
            for ticket, answer in zip(tickets, answers, strict=True):
                last.append(_last(ticket, answer))
                if isinstance(last[-1], Failed):  # the line fails: its other jobs stop
                    for other in tickets:
                        other.cancel()
            with self._cv:
                for ticket in tickets:
                    self._tickets.remove(ticket)
            if failed := [e for e in last if isinstance(e, Failed)]:
                if isinstance(failed[0].error, EngineClosed):
                    raise failed[0].error
                self._record(batch_id, number, custom_id, None, engine_error(failed[0].error))
            elif all(e.finish_reason != "cancelled" for e in last):  # else it stays unanswered
                for answer, finished in zip(answers, last, strict=True):
                    answer.finish(finished)
                self._record(batch_id, number, custom_id, respond(tickets[0].job.id, last), None)
        return True

    def _submit(self, body: dict, endpoint: str):
        """(tickets, AnswerText of each, respond) of a line's body, checked as `endpoint`
        checks one: a ticket per choice (its prompts' `n`); respond(reply id, each choice's
        Finished) → the response body. QueueFull when the engine cannot take them all (none is
        then submitted)."""
        if endpoint == RESPONSES:
            return self._response(body)
        text = endpoint == TEXT
        if text:
            openai_api.check_fields(body, openai_api.TEXT_HONOURED, openai_api.TEXT_NO_OP)
        else:
            openai_api.check_fields(body, openai_api.HONOURED)
        if body.get("model") is not None:
            check_model(body["model"], self.model_id)
        if text:
            request = text_request(body, self.tok, self.engine, self.defaults)
            jobs, n, answers = request.jobs, request.n, request.answers(self.tok)

            def respond(reply_id: str, finished) -> dict:
                reply = Reply(reply_id, "text_completion", self.model_id, int(time.time()))
                return text_completion(reply, request, answers, finished, self.tok)
        else:
            jobs, n, answers, respond = self._chat(body)
        choices = [one for job in jobs for one in seeded(replace(job, background=True), n)]
        return self.engine.submit_all(choices), answers, respond

    def _response(self, body: dict):
        """([its ticket], [its AnswerText], respond) of a Responses line's body, as
        `/v1/responses` reads one (`responses.response_request`), except that a line continues
        no stored response and is stored by none (its output line is the response)."""
        # the fields a Responses line may hold, as `salabatch run` takes one: no stream or
        # background (a batch line is neither), no previous_response_id (it continues none)
        openai_api.check_fields(body, openai_api.RESPONSE_HONOURED, openai_api.RESPONSE_NO_OP)
        if body.get("model") is not None:
            check_model(body["model"], self.model_id)
        asked = responses.response_request(
            body | {"store": False}, self.tok, self.defaults, self.model_id, None, self.leading_ids
        )
        ticket = self.engine.submit(replace(asked.job, background=True))
        return [ticket], [asked.answer], lambda _reply_id, finished: asked.response(finished[0])

    def _chat(self, body: dict):
        """([the job], n, AnswerText of each choice, respond) of a chat line's body."""
        n, logprobs = choices(body, self.engine), openai_api.logprobs(body)
        pattern = openai_api.structure(body)
        field = openai_api.structure_field(body)
        grammar = None if pattern is None else grammar_of(self.tok, pattern, field)
        messages = openai_api.messages(body.get("messages"))
        params, max_tokens = sampling(body, self.defaults, self.tok.vocab_size)
        think = openai_api.think(body.get("chat_template_kwargs"), self.defaults.think)
        stops = openai_api.stop(body.get("stop"))
        job = chat_job(
            self.tok,
            messages,
            think=think,
            params=params,
            max_tokens=max_tokens,
            stop_strings=stops,
            leading_ids=self.leading_ids,
        )
        strip = grammar is None  # an answer held to a pattern keeps its spaces: its text
        answers = [
            AnswerText(self.tok, stop_strings=stops, think=think, strip=strip) for _ in range(n)
        ]

        def respond(reply_id: str, finished) -> dict:
            reply = Reply(reply_id, "chat.completion", self.model_id, int(time.time()))
            return chat_completion(reply, answers, think, finished, self.tok)

        return [replace(job, logprobs=logprobs, grammar=grammar)], n, answers, respond

    def _record(self, batch_id, number, custom_id, body: dict | None, error: APIError | None):
        status, body = (error.status, error.body) if error is not None else (200, body)
        output = {
            "id": new_id("batch_req"),
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": new_id("req"), "body": body},
            "error": None,
        }
        self.store.add_line(batch_id, number, output, failed=error is not None)

    # ---- input, output, status ---------------------------------------------------------------

    def _read_input(
        self, file_id: str, endpoint: str
    ) -> tuple[list[tuple[int, str, dict]], list[dict]]:
        """(lines as (line number, custom_id, body), errors) of an input file: every line a JSON
        object with a unique custom_id, method POST, url the batch's `endpoint`, a body
        object; at most MAX_REQUESTS of them. The first MAX_ERRORS errors are listed, then one
        entry counts the rest (the list is the batch's `errors`, returned by every retrieve and
        list: one entry a bad line made a 1 MB file's batch 74 MB)."""
        lines, errors, seen, requests, unlisted = [], [], set(), 0, 0

        def entry(number: int | None, code: str, message: str, param: str | None = None):
            return {"code": code, "message": message, "param": param, "line": number}

        def error(*args):
            nonlocal unlisted
            if len(errors) < MAX_ERRORS:
                errors.append(entry(*args))
            else:
                unlisted += 1

        try:
            data = self.store.file_path(file_id).read_bytes()
        except FileNotFoundError:
            error(None, "missing_file", f"the input file {file_id} was deleted")
            return [], errors
        for number, raw in enumerate(data.splitlines(), 1):
            if not raw.strip():
                continue
            requests += 1
            try:
                line = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                error(number, "invalid_json_line", f"line {number} is not valid JSON ({e})")
                continue
            except RecursionError:
                error(number, "invalid_json_line", f"line {number} is nested too deeply")
                continue
            if not isinstance(line, dict):
                error(number, "invalid_request", f"line {number} is not a JSON object")
                continue
            custom_id = line.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                error(number, "missing_required_parameter", "custom_id is missing", "custom_id")
            elif custom_id in seen:
                message = f"custom_id {custom_id!r} repeats"
                error(number, "duplicate_custom_id", message, "custom_id")
            if line.get("method") != "POST":
                error(number, "invalid_method", "method must be POST", "method")
            if line.get("url") != endpoint:
                error(number, "invalid_url", f"url must be {endpoint}, the batch's endpoint", "url")
            if not isinstance(line.get("body"), dict):
                error(number, "missing_required_parameter", "body must be an object", "body")
            if isinstance(custom_id, str):
                seen.add(custom_id)
            if not errors:
                lines.append((number, custom_id, line["body"]))
        if requests > MAX_REQUESTS:
            message = f"the input file has {requests} requests; a batch takes {MAX_REQUESTS}"
            errors.insert(0, entry(None, "too_many_requests", message))
        if unlisted:
            message = f"{unlisted} more errors in later lines, not listed"
            errors.append(entry(None, "too_many_errors", message))
        if not requests:
            error(None, "empty_file", "the input file has no request lines")
        return lines, errors

    def _write_files(self, batch_id: str) -> dict:
        """The output and error files of the recorded lines (ids fixed by the batch, so a
        restart while finalizing writes the same files once)."""
        ids = {}
        for failed, key in ((False, "output_file_id"), (True, "error_file_id")):
            outputs = self.store.outputs(batch_id, failed)
            file_id = f"file-{'err' if failed else 'out'}-{batch_id.removeprefix('batch_')}"
            ids[key] = None
            if outputs:
                if self.store.file(file_id) is None:
                    text = "".join(o + "\n" for o in outputs).encode()
                    self.store.add_file(
                        f"{batch_id}_{'error' if failed else 'output'}.jsonl",
                        "batch_output",
                        lambda f, text=text: f.write(text),
                        file_id,
                    )
                ids[key] = file_id
        return ids

    def _fail(self, batch_id: str, why: Exception | list[dict]) -> None:
        """Ends a batch a fault of the server's stopped (an exception, or the errors of an input
        gone since it was validated): failed, with the files of its answered lines where they
        can be written (what cannot be recorded is in the log)."""
        if isinstance(why, Exception):
            message = f"the server failed running this batch ({type(why).__name__}: {why})"
            why = [{"code": "server_error", "message": message}]
        errors = {"object": "list", "data": why}
        try:
            try:
                files = self._write_files(batch_id)
            except Exception:
                log.exception("batch %s: cannot write its files", batch_id)
                files = {}
            self._set(batch_id, "failed", OPEN, errors=errors, **files)
        except Exception:
            log.exception("batch %s: cannot record its failure", batch_id)

    def _end_cancelled(self, batch_id: str) -> None:
        self._set(batch_id, "cancelled", ("cancelling",), **self._write_files(batch_id))

    def _set(self, batch_id: str, status: str, was: tuple[str, ...], **fields) -> bool:
        """The batch `status` (its `<status>_at` now, `fields` with it) if it is still one of
        `was`; whether it was."""
        at = {f"{status}_at": int(time.time())}

        def change(batch: dict) -> dict | None:
            return {**batch, **fields, **at, "status": status} if batch["status"] in was else None

        changed = self.store.update_batch(batch_id, change)
        return changed is not None and changed["status"] == status


def _last(ticket, answer: AnswerText):
    """The ticket's tokens into `answer` (blocking) → its last event, Finished or Failed."""
    last = None
    for event in ticket:
        if isinstance(event, Token):
            answer.add(event.token, event.logprob)
        elif isinstance(event, PromptLogprobs):
            answer.prompt_logprobs = event.logprobs
        else:
            last = event
    return last


def _expired_line(custom_id: str) -> dict:
    """The error-file line of a request the batch's window closed on, as OpenAI writes it."""
    return {
        "id": new_id("batch_req"),
        "custom_id": custom_id,
        "response": None,
        "error": {
            "code": "batch_expired",
            "message": "This request could not be executed before the completion window expired.",
        },
    }


def _fault(e: Exception) -> APIError:
    """The 500 of a line the server failed on (its traceback in the log)."""
    return APIError(500, f"the server failed on this line ({type(e).__name__}: {e})")


def _refused(e: SalabatchError) -> APIError:
    """The 400 of a line's body that cannot be answered (a refused field, a bad message)."""
    return APIError(400, str(e), param=getattr(e, "param", None))
