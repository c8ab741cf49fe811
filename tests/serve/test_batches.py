"""The Batch API (`/v1/files`, `/v1/batches`) with the real `openai` client against a server on
127.0.0.1 over a ServeEngine on builtin:tiny: the round trip, an invalid input file, a refused
field, cancel, a restart mid-batch on the same state dir, chat answered while a batch runs."""

from __future__ import annotations

import http.client
import json
import re
import time

import openai
import pytest
from openai.types.chat import ChatCompletion

from salabatch.serve.app import ServeDefaults
from salabatch.serve.batches import runner as runner_module
from salabatch.serve.batches.routes import batch_routes
from salabatch.serve.batches.runner import BatchRunner
from salabatch.serve.batches.store import BatchStore, StateDirBusy
from salabatch.serve.engine import ServeEngine
from salabatch.serve.responses import Responses
from tests.serve.test_http import DOCS, MODEL, Served
from tests.serve.test_http import QUESTIONS as ASKED

QUESTIONS = ASKED[:4]


class Server(Served):
    """A server with the Batch API over `state` (the prefix store and the batch records), in
    a uvicorn thread, as `salabatch serve` runs one; `api` its openai client."""

    def __init__(
        self, tiny, state, *, max_file: int = 1 << 20, in_flight: int = 2, window_s=24 * 3600
    ) -> None:
        model, tok = tiny
        engine = ServeEngine(model, tok, batch_size=4, max_queue=16, store_dir=state / "p")
        self.store = BatchStore(state / "batches")
        self.runner = BatchRunner(
            engine, tok, self.store, model_id=MODEL, in_flight=in_flight, window_s=window_s
        )
        answers = Responses(engine, tok, model_id=MODEL, defaults=ServeDefaults())
        routes = [*batch_routes(self.runner, max_file), *answers.routes]
        super().__init__(engine, tok, routes=routes, starting=[answers.resume])
        self.api = self.client("none")  # no key is asked for

    def __enter__(self) -> Server:
        super().__enter__()
        self.runner.start()
        return self

    def __exit__(self, *exc) -> None:
        self.runner.close()
        super().__exit__(*exc)
        self.store.close()

    def upload(self, lines: list[dict]) -> str:
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        return self.api.files.create(file=("in.jsonl", data), purpose="batch").id

    def start_batch(self, lines: list[dict], endpoint: str = "/v1/chat/completions"):
        return self.api.batches.create(
            input_file_id=self.upload(lines),
            endpoint=endpoint,
            completion_window="24h",
            metadata={"test": "yes"},
        )

    def wait(self, batch_id: str, until, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while not until(batch := self.api.batches.retrieve(batch_id)):
            assert time.monotonic() < deadline, f"timed out: {batch}"
            time.sleep(0.05)
        return batch

    def done(self, batch_id: str, timeout: float = 120.0):
        final = ("completed", "failed", "cancelled", "expired")
        return self.wait(batch_id, lambda b: b.status in final, timeout)

    def output(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        return [json.loads(x) for x in self.api.files.content(file_id).text.splitlines()]


def line(custom_id: str, doc: str, question: str, **body) -> dict:
    messages = [
        {"role": "system", "content": f"Document: contract\n\n{(DOCS / doc).read_text()}"},
        {"role": "user", "content": question},
    ]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": messages, "max_tokens": 16, **body},
    }


def endpoint_lines(url: str, prefix: str, bodies: list[dict]) -> list[dict]:
    """Batch lines to `url`, one per body (the model added), custom_ids prefix0, prefix1, ..."""
    return [
        {"custom_id": f"{prefix}{i}", "method": "POST", "url": url, "body": b | {"model": MODEL}}
        for i, b in enumerate(bodies)
    ]


def many(n: int, max_tokens: int) -> list[dict]:
    docs = ["redwater-robotics.txt", "brightgate-systems.md"]
    return [line(f"q{i}", docs[i % 2], QUESTIONS[i % 4], max_tokens=max_tokens) for i in range(n)]


def test_round_trip_files_and_output_in_input_order(tiny, tmp_path):
    lines = [
        line(f"req-{i}", doc, q)
        for i, (doc, q) in enumerate(
            (d, q) for d in ("redwater-robotics.txt", "brightgate-systems.md") for q in QUESTIONS
        )
    ]
    with Server(tiny, tmp_path) as s:
        batch = s.start_batch(lines)
        assert batch.status == "validating" and batch.metadata == {"test": "yes"}
        batch = s.done(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.total == batch.request_counts.completed == 8
        assert batch.error_file_id is None and batch.errors is None
        assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at
        assert batch.finalizing_at <= batch.completed_at
        out = s.output(batch.output_file_id)
        assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(8)]
        cached = []
        for o in out:
            assert o["response"]["status_code"] == 200 and o["error"] is None
            assert re.fullmatch("req_[0-9a-f]{32}", o["response"]["request_id"])
            body = ChatCompletion.model_validate(o["response"]["body"])
            assert body.model == MODEL and body.choices[0].finish_reason in ("stop", "length")
            cached.append(body.usage.prompt_tokens_details.cached_tokens)
        # the document is the system message: its prefix is prefilled once per document
        assert cached[0] == 0 and sum(c > 0 for c in cached[1:4]) >= 2, cached
        assert sum(c > 0 for c in cached[5:8]) >= 2, cached

        # the files: listed, retrieved, deleted; unknown ids and big files refused
        ids = {f.id for f in s.api.files.list()}
        assert {batch.input_file_id, batch.output_file_id} <= ids
        assert s.api.files.retrieve(batch.output_file_id).purpose == "batch_output"
        assert s.api.batches.list(limit=5).data[0].id == batch.id
        page = s.api.files.list(limit=1)
        assert [f.id for f in page.data] == [batch.output_file_id] and page.has_more
        oldest = s.api.files.list(order="asc", limit=1).data[0].id
        assert oldest == batch.input_file_id
        rest = s.api.files.list(order="asc", after=oldest).data
        assert [f.id for f in rest] == [batch.output_file_id]
        for path in ("/v1/files?limit=0", "/v1/batches?limit=101", "/v1/batches?limit=%C2%B2"):
            status, _, data = s.raw("GET", path)  # "²": a digit to str.isdigit, not to int
            assert status == 400 and json.loads(data)["error"]["param"] == "limit", data
        for fields, param in (
            ({"input_file_id": batch.output_file_id}, "input_file_id"),  # not purpose batch
            ({"output_expires_after": {"anchor": "created_at", "seconds": 3600}}, None),
        ):
            fields = {"input_file_id": batch.input_file_id} | fields
            with pytest.raises(openai.BadRequestError) as e:
                s.api.batches.create(
                    endpoint="/v1/chat/completions", completion_window="24h", **fields
                )
            assert e.value.body["param"] == (param or "output_expires_after"), e.value.body
        assert s.api.files.delete(batch.input_file_id).deleted
        with pytest.raises(openai.NotFoundError):
            s.api.files.retrieve(batch.input_file_id)
        with pytest.raises(openai.NotFoundError):
            s.api.batches.retrieve("batch_nope")
        with pytest.raises(openai.APIStatusError) as e:
            s.api.files.create(file=("big.jsonl", b"x" * (2 << 20)), purpose="batch")
        assert e.value.status_code == 413
        # chunked (no length): the form was spooled whole, of any size, before it was counted
        form = b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b--\r\n'
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        headers = {"Content-Type": "multipart/form-data; boundary=b"}
        conn.request("POST", "/v1/files", body=iter([form]), headers=headers)
        assert conn.getresponse().status == 411
        conn.close()
        with pytest.raises(openai.BadRequestError, match="expires_after"):  # refused, not ignored
            s.api.files.create(
                file=("in.jsonl", b"{}"),
                purpose="batch",
                extra_body={"expires_after": {"anchor": "created_at", "seconds": 3600}},
            )
        fresh = s.upload(lines[:1])
        with pytest.raises(openai.BadRequestError, match="at most 16 strings"):  # OpenAI's limits
            s.api.batches.create(
                input_file_id=fresh,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata={f"k{i}": "v" for i in range(17)},
            )
        status, _, data = s.raw("GET", "/v1/batches?after=batch_nope")
        assert status == 400 and json.loads(data)["error"]["param"] == "after"


def test_a_line_with_n_answers_n_choices_as_chat_answers_each_seed(tiny, tmp_path):
    """A line with n = 3 (temperature 2, seed 11, logprobs) between two plain ones: its body
    holds three choices, choice i the answer (and log-probabilities) chat gives with seed
    11 + i; a line past the server's rows and
    queue (n = 21: batch_size 4 + max_queue 16) goes to the error file naming n."""
    hot = {"temperature": 2.0, "seed": 11}
    lines = [
        line("plain-1", "redwater-robotics.txt", QUESTIONS[0]),
        line("three", "redwater-robotics.txt", QUESTIONS[1], n=3, logprobs=True, **hot),
        line("too-many", "redwater-robotics.txt", QUESTIONS[1], n=21),
        line("plain-2", "brightgate-systems.md", QUESTIONS[2]),
    ]
    with Server(tiny, tmp_path) as s:
        batch = s.done(s.start_batch(lines).id)
        assert batch.status == "completed" and batch.request_counts.failed == 1
        out = {o["custom_id"]: o["response"]["body"] for o in s.output(batch.output_file_id)}
        assert list(out) == ["plain-1", "three", "plain-2"]
        body = ChatCompletion.model_validate(out["three"])
        assert [c.index for c in body.choices] == [0, 1, 2]
        asked = {k: v for k, v in lines[1]["body"].items() if k not in ("n", "seed")}
        alone = [s.api.chat.completions.create(**asked, seed=11 + i) for i in range(3)]
        texts = [c.message.content for c in body.choices]
        assert texts == [a.choices[0].message.content for a in alone] and len(set(texts)) > 1
        assert body.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
        lps = [[e.logprob for e in c.logprobs.content] for c in body.choices]
        for mine, chat in zip(lps, alone, strict=True):  # batches apart: float rounding apart
            expected = [e.logprob for e in chat.choices[0].logprobs.content]
            assert mine == pytest.approx(expected, abs=1e-4)
        (err,) = s.output(batch.error_file_id)
        error = err["response"]["body"]["error"]
        assert err["custom_id"] == "too-many" and error["param"] == "n"
        assert "batch_size 4 + max_queue 16" in error["message"]


def test_a_completions_batch_answers_each_line_as_the_endpoint_does(tiny, tmp_path):
    """A batch of /v1/completions lines: each output body is the text_completion the endpoint
    answers the same body with (prompts as text or ids, a list of them, n, echo with the
    prompt's logprobs, max_tokens 0); a chat line in it is refused by its url, and so is a
    completions line in a chat batch."""
    bodies = [
        {"prompt": "The gate code is", "max_tokens": 6},
        {"prompt": ["Who is the provider?", [5, 6, 7]], "max_tokens": 4, "n": 2, "seed": 3,
         "temperature": 1.0},
        {"prompt": "The fee is", "max_tokens": 0, "echo": True, "logprobs": 2},
    ]  # fmt: skip
    lines = endpoint_lines("/v1/completions", "c", bodies)
    with Server(tiny, tmp_path) as s:
        batch = s.done(s.start_batch(lines, "/v1/completions").id)
        assert batch.status == "completed" and batch.endpoint == "/v1/completions", batch
        out = {x["custom_id"]: x["response"]["body"] for x in s.output(batch.output_file_id)}
        for i, body in enumerate(bodies):
            got, want = out[f"c{i}"], s.api.completions.create(**body | {"model": MODEL})
            assert got["object"] == "text_completion"
            assert [c["text"] for c in got["choices"]] == [c.text for c in want.choices]
            assert got["usage"]["prompt_tokens"] == want.usage.prompt_tokens
        scored = out["c2"]["choices"][0]
        assert scored["text"] == "The fee is" and scored["logprobs"]["token_logprobs"][0] is None
        assert len(scored["logprobs"]["tokens"]) == out["c2"]["usage"]["prompt_tokens"]
        mixed = s.done(s.start_batch([lines[0], line("x", "redwater-robotics.txt", "Who?")],
                                     "/v1/completions").id)  # fmt: skip
        assert mixed.status == "failed" and mixed.errors.data[0].param == "url"
        wrong = s.done(s.start_batch(lines[:1]).id)
        assert wrong.status == "failed" and "/v1/chat/completions" in wrong.errors.data[0].message
        with pytest.raises(openai.BadRequestError) as e:
            s.start_batch(lines[:1], "/v1/embeddings")
        assert e.value.body["param"] == "endpoint"


def test_a_responses_batch_answers_each_line_as_the_endpoint_does(tiny, tmp_path):
    """A batch of /v1/responses lines: each output body is the response the endpoint gives
    the same body (its text, status and usage; text.format honoured); a line that continues a
    stored response goes to the error file naming previous_response_id (a line stores none)."""
    document = (DOCS / "redwater-robotics.txt").read_text()
    bodies = [
        {"instructions": document, "input": QUESTIONS[0], "max_output_tokens": 8},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": QUESTIONS[1]}]}],
         "max_output_tokens": 40, "text": {"format": {"type": "json_object"}}},
        {"input": "Hi", "previous_response_id": "resp_x"},
        {"input": "Hi", "stream": True},  # a line is no stream: refused, as `run` refuses it
        {"input": "Hi", "background": True},
    ]  # fmt: skip
    lines = endpoint_lines("/v1/responses", "r", bodies)
    with Server(tiny, tmp_path) as s:
        batch = s.done(s.start_batch(lines, "/v1/responses").id)
        assert batch.status == "completed" and batch.endpoint == "/v1/responses", batch
        out = {x["custom_id"]: x["response"]["body"] for x in s.output(batch.output_file_id)}
        for i, body in enumerate(bodies[:2]):
            got, want = out[f"r{i}"], s.api.responses.create(**body | {"model": MODEL})
            assert got["object"] == "response" and got["store"] is False
            text = "".join(p["text"] for item in got["output"] for p in item["content"])
            assert text == want.output_text and got["status"] == want.status
            assert got["usage"]["input_tokens"] == want.usage.input_tokens
        assert isinstance(json.loads(want.output_text), dict)
        errors = s.output(batch.error_file_id)
        params = [e["response"]["body"]["error"]["param"] for e in errors]
        assert [e["custom_id"] for e in errors] == ["r2", "r3", "r4"]
        assert params == ["previous_response_id", "stream", "background"]


def test_an_invalid_input_file_fails_with_its_errors(tiny, tmp_path):
    good = line("a", "redwater-robotics.txt", QUESTIONS[0])
    with Server(tiny, tmp_path) as s:
        file_id = s.api.files.create(
            file=("bad.jsonl", (json.dumps(good) + "\nnot json\n" + json.dumps(good)).encode()),
            purpose="batch",
        ).id
        batch = s.api.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = s.done(batch.id)
        assert batch.status == "failed" and batch.failed_at is not None
        assert batch.output_file_id is None and batch.request_counts.completed == 0
        errors = {(e.line, e.code) for e in batch.errors.data}
        assert errors == {(2, "invalid_json_line"), (3, "duplicate_custom_id")}

        # a repeat is named even after an earlier bad line
        lines = ["not json", json.dumps(good), json.dumps(good)]
        file_id = s.api.files.create(file=("b.jsonl", "\n".join(lines).encode()), purpose="batch")
        batch = s.api.batches.create(
            input_file_id=file_id.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        errors = {(e.line, e.code) for e in s.done(batch.id).errors.data}
        assert errors == {(1, "invalid_json_line"), (3, "duplicate_custom_id")}


def test_a_file_of_many_bad_lines_or_too_many_requests_fails_with_a_short_list(
    tiny, tmp_path, monkeypatch
):
    """A batch's errors listed one entry a bad line (a 1 MB file of them: a 74 MB batch object at
    every retrieve and list); now the first MAX_ERRORS and a count of the rest. More request
    lines than MAX_REQUESTS (OpenAI's 50,000) fail validation too (they ran)."""
    monkeypatch.setattr(runner_module, "MAX_REQUESTS", 3)
    good = [line(f"r{i}", "redwater-robotics.txt", QUESTIONS[0]) for i in range(4)]
    with Server(tiny, tmp_path) as s:
        file_id = s.api.files.create(file=("bad.jsonl", b"x\n" * 5000), purpose="batch").id
        batch = s.api.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = s.done(batch.id)
        codes = [e.code for e in batch.errors.data]
        assert batch.status == "failed" and len(codes) == runner_module.MAX_ERRORS + 2, len(codes)
        assert codes[0] == "too_many_requests" and "5000 requests" in batch.errors.data[0].message
        assert codes[1:-1] == ["invalid_json_line"] * runner_module.MAX_ERRORS
        assert codes[-1] == "too_many_errors"
        assert batch.errors.data[-1].message.startswith(f"{5000 - runner_module.MAX_ERRORS} more")
        status, _, body = s.raw("GET", "/v1/batches?limit=1")
        assert status == 200 and len(body) < 40_000, len(body)

        batch = s.done(s.start_batch(good).id)
        assert batch.status == "failed" and batch.request_counts.completed == 0
        assert [e.code for e in batch.errors.data] == ["too_many_requests"]
        assert s.done(s.start_batch(good[:3]).id).status == "completed"


def test_a_line_that_is_not_text_is_refused_and_the_runner_goes_on(tiny, tmp_path):
    """A lone surrogate (valid JSON, no text a tokenizer takes) in a message is that line's 400,
    in one in a custom_id the line's output echoes it escaped; the runner takes the next
    batch."""
    bad_text = line("bad-text", "redwater-robotics.txt", "Who pays\ud800?")
    bad_text["body"]["messages"][1]["content"] = "Who pays\ud800?"
    bad_id = line("id-\ud800", "redwater-robotics.txt", QUESTIONS[0], max_tokens=4)
    with Server(tiny, tmp_path) as s:
        batch = s.done(s.start_batch([bad_text, bad_id]).id)
        assert batch.status == "completed"
        (err,) = s.output(batch.error_file_id)
        assert err["custom_id"] == "bad-text" and err["response"]["status_code"] == 400
        error = err["response"]["body"]["error"]
        assert error["param"] == "messages[1].content" and "U+D800" in error["message"]
        (out,) = s.output(batch.output_file_id)
        assert out["custom_id"] == "id-\ud800" and out["response"]["status_code"] == 200
        # U+2028, which JSON leaves raw: escaped, so that README's splitlines() loop reads it
        spaced = s.done(s.start_batch([line("a\u2028b", "redwater-robotics.txt", "Who?")]).id)
        (text,) = s.api.files.content(spaced.output_file_id).text.splitlines()
        assert json.loads(text)["custom_id"] == "a\u2028b"
        later = s.done(s.start_batch(many(1, max_tokens=4)).id)
        assert later.status == "completed"


def test_a_fault_of_the_server_fails_its_line_or_batch_not_the_runner(tiny, tmp_path, monkeypatch):
    """A line the server itself fails on is a 500 in the error file; a fault outside any line
    fails its batch (errors say so) and is not met again by a restart; the next batch runs."""
    with Server(tiny, tmp_path) as s:
        real = s.runner._submit

        def submit(body, endpoint):
            if body["max_tokens"] == 5:
                raise RuntimeError("a bug")
            return real(body, endpoint)

        monkeypatch.setattr(s.runner, "_submit", submit)
        lines = many(2, max_tokens=4)
        lines[0]["body"]["max_tokens"] = 5
        batch = s.done(s.start_batch(lines).id)
        assert batch.status == "completed" and batch.request_counts.failed == 1
        (err,) = s.output(batch.error_file_id)
        assert err["response"]["status_code"] == 500
        assert "RuntimeError: a bug" in err["response"]["body"]["error"]["message"]

        monkeypatch.setattr(s.runner, "_write_files", lambda batch_id: 1 / 0)
        broken = s.done(s.start_batch(many(1, max_tokens=4)).id)
        monkeypatch.undo()
        assert broken.status == "failed"
        assert "ZeroDivisionError" in broken.errors.data[0].message
        assert broken.request_counts.completed == 1  # its line ran: counted, not 0
        assert s.done(s.start_batch(many(1, max_tokens=4)).id).status == "completed"
    with Server(tiny, tmp_path) as s:  # a restart finds nothing open
        assert s.api.batches.retrieve(broken.id).status == "failed"


def test_a_refused_field_goes_to_the_error_file_and_the_batch_completes(tiny, tmp_path):
    lines = [
        line("ok-1", "redwater-robotics.txt", QUESTIONS[0]),
        line("tools", "redwater-robotics.txt", QUESTIONS[1], tools=[{"type": "function"}]),
        line("ok-2", "redwater-robotics.txt", QUESTIONS[2]),
    ]
    with Server(tiny, tmp_path) as s:
        batch = s.done(s.start_batch(lines).id)
        assert batch.status == "completed"
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (3, 2, 1)
        assert [o["custom_id"] for o in s.output(batch.output_file_id)] == ["ok-1", "ok-2"]
        (err,) = s.output(batch.error_file_id)
        assert err["custom_id"] == "tools" and err["response"]["status_code"] == 400
        assert err["response"]["body"]["error"]["param"] == "tools"


def test_a_batch_past_its_window_expires(tiny, tmp_path):
    """A window that has closed before the batch runs: it ends expired, every line in the
    error file with OpenAI's `batch_expired` error, no output file."""
    lines = many(3, max_tokens=4)
    with Server(tiny, tmp_path, window_s=0) as s:
        batch = s.done(s.start_batch(lines).id)
        assert batch.status == "expired" and batch.expired_at is not None
        assert batch.output_file_id is None
        errors = s.output(batch.error_file_id)
        assert [e["custom_id"] for e in errors] == [x["custom_id"] for x in lines]
        assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors)
        assert batch.request_counts.failed == 3


def test_cancel_mid_batch(tiny, tmp_path):
    with Server(tiny, tmp_path) as s:
        batch = s.start_batch(many(40, 48))
        s.wait(batch.id, lambda b: b.request_counts.completed >= 2)
        assert s.api.batches.cancel(batch.id).status == "cancelling"
        batch = s.done(batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at
        done = batch.request_counts.completed
        assert 2 <= done < 40
        out = s.output(batch.output_file_id)
        assert len(out) == done and len({o["custom_id"] for o in out}) == done
        assert s.api.batches.cancel(batch.id).status == "cancelled"  # again: as it is
        finished = s.done(s.start_batch(many(1, 4)).id)
        requests = s.metrics()
        with pytest.raises(openai.BadRequestError, match="completed: it cannot be cancelled"):
            s.api.with_options(max_retries=2).batches.cancel(finished.id)
        after = s.metrics()
        key = 'salabatch_http_requests_total{endpoint="/v1/batches/{batch_id}/cancel",status="400"}'
        assert after.get(key, 0) - requests.get(key, 0) == 1  # a 400: the client does not retry


def test_a_cancel_while_validating_or_queued_ends_the_batch_cancelled(tiny, tmp_path):
    """A cancel that lands while the input is read was written over by `in_progress` (the
    batch ran on); one queued behind another batch stayed `cancelling` until that one ended."""
    with Server(tiny, tmp_path) as s:
        read = s.runner._read_input

        def read_then_cancel(file_id, endpoint):
            found = read(file_id, endpoint)
            (validating,) = [b for b in s.store.open_batches() if b["status"] == "validating"]
            s.api.batches.cancel(validating["id"])
            return found

        s.runner._read_input = read_then_cancel
        batch = s.done(s.start_batch(many(4, 4)).id)
        s.runner._read_input = read
        assert batch.status == "cancelled" and batch.in_progress_at is None
        assert batch.request_counts.completed == 0 and batch.output_file_id is None

        running = s.start_batch(many(40, 48))
        queued = s.start_batch(many(2, 4))
        s.wait(running.id, lambda b: b.request_counts.completed >= 1)
        cancelled = s.api.batches.cancel(queued.id)
        assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
        assert s.api.batches.retrieve(running.id).status == "in_progress"
        s.api.batches.cancel(running.id)
        assert s.done(running.id).status == "cancelled"


def test_the_input_of_a_batch_not_ended_cannot_be_deleted(tiny, tmp_path):
    """Deleting it and restarting ended the batch `completed` with the lines not answered yet
    missing: it is a 400 naming the batch; were the file gone anyway (a disk's fault), the
    restarted batch fails saying so, its answered lines in its output file and counts."""
    with Server(tiny, tmp_path) as s:
        batch = s.start_batch(many(16, 24))
        s.wait(batch.id, lambda b: b.request_counts.completed >= 2)
        with pytest.raises(openai.BadRequestError, match=f"input of batch {batch.id}"):
            s.api.files.delete(batch.input_file_id)
        s.store.file_path(batch.input_file_id).unlink()  # the bytes lost behind its back
    with Server(tiny, tmp_path) as s:
        failed = s.done(batch.id)
        assert failed.status == "failed" and failed.errors.data[0].code == "missing_file"
        answered = failed.request_counts.completed
        assert answered >= 2 and len(s.output(failed.output_file_id)) == answered
        s.api.files.delete(failed.input_file_id)  # it ended: the record goes


def test_a_restart_mid_batch_answers_every_line_once(tiny, tmp_path):
    lines = many(16, 24)
    with Server(tiny, tmp_path) as s:
        batch = s.start_batch(lines)
        s.wait(batch.id, lambda b: b.request_counts.completed >= 3)
    with Server(tiny, tmp_path) as s:  # the same state dir: the batch resumes
        before = s.api.batches.retrieve(batch.id)
        assert before.status == "in_progress" and 3 <= before.request_counts.completed < 16
        batch = s.done(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 16
        out = s.output(batch.output_file_id)
        assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]
        assert len({o["id"] for o in out}) == 16


def test_a_second_server_on_the_same_state_dir_is_refused(tiny, tmp_path):
    # Both would run its open batches: lines answered twice, a batch finalized twice.
    busy = pytest.raises(StateDirBusy, match="another salabatch serve holds this state dir")
    with Server(tiny, tmp_path), busy:
        BatchStore(tmp_path / "batches")
    BatchStore(tmp_path / "batches").close()  # free once the first one closed


def test_a_start_removes_the_half_made_files_a_killed_server_left(tmp_path):
    """An upload killed mid-write left its temporary file, one killed after the rename its
    bytes with no record (not listed, never deleted): both are gone at the next start; the
    files that have a record stay."""
    store = BatchStore(tmp_path / "batches")
    kept = store.add_file("in.jsonl", "batch", lambda f: f.write(b"{}\n"))
    store.close()
    files = tmp_path / "batches" / "files"
    (files / ".file-abc.tmp-123-deadbeef").write_bytes(b"x" * 1000)
    (files / "file-0123456789abcdef").write_bytes(b"y" * 1000)
    store = BatchStore(tmp_path / "batches")
    assert sorted(p.name for p in files.iterdir()) == [kept["id"]]
    assert store.file(kept["id"])["bytes"] == 3
    store.close()


def test_chat_is_answered_while_a_batch_runs(tiny, tmp_path):
    with Server(tiny, tmp_path) as s:
        batch = s.start_batch(many(30, 48))
        s.wait(batch.id, lambda b: b.request_counts.completed >= 1)
        messages = [{"role": "user", "content": "Who is the provider?"}]
        reply = s.api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        assert reply.choices[0].message.content is not None
        running = s.api.batches.retrieve(batch.id)
        assert running.status == "in_progress", running  # the chat did not wait for the batch
        assert running.request_counts.completed < 30
        s.api.batches.cancel(batch.id)
        assert s.done(batch.id).status == "cancelled"


def test_sigkill_of_salabatch_serve_mid_batch_then_restart_answers_every_line_once(tmp_path):
    """...and a response the first server stored is there after the kills: GET returns it and a
    request continues it; a background one the kill stopped mid-prefill runs again, the next
    server's, and ends with its answer, under its id."""
    from tests.serve.test_http import serve_process, wait_healthy

    lines = many(24, 24)
    batch_id = stored = stopped = None
    for kill_after in (2, 8, 14, None):  # three SIGKILLs mid-batch, then one that finishes it
        with serve_process(tmp_path) as (port, process, log):
            wait_healthy(port, process)
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60
            )
            if stored is None:
                stored = client.responses.create(
                    model="builtin:tiny", input="Who signs it?", max_output_tokens=4
                )

            if batch_id is None:
                data = "".join(json.dumps(x) + "\n" for x in lines).encode()
                file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
                batch_id = client.batches.create(
                    input_file_id=file_id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                ).id
            deadline = time.monotonic() + 120
            while True:
                batch = client.batches.retrieve(batch_id)
                assert time.monotonic() < deadline, batch
                if kill_after is not None and batch.request_counts.completed >= kill_after:
                    assert batch.status == "in_progress", batch
                    if stopped is None:  # killed just after it is accepted: mid-prefill
                        stopped = client.responses.create(
                            model="builtin:tiny",
                            input="The ferry leaves at 7:10 from the north quay. " * 200,
                            max_output_tokens=4,
                            background=True,
                        )
                    process.kill()
                    process.wait()
                    break
                if kill_after is None and batch.status == "completed":
                    out = client.files.content(batch.output_file_id).text.splitlines()
                    kept = client.responses.retrieve(stored.id)
                    while (
                        resumed := client.responses.retrieve(stopped.id)
                    ).status == "in_progress":
                        assert time.monotonic() < deadline, resumed
                        time.sleep(0.05)
                    after = client.responses.create(
                        model="builtin:tiny",
                        previous_response_id=stored.id,
                        input="And when?",
                        max_output_tokens=4,
                    )
                    break
                time.sleep(0.05)
    assert batch.request_counts.completed == 24 and batch.request_counts.failed == 0
    assert [json.loads(o)["custom_id"] for o in out] == [x["custom_id"] for x in lines]
    assert kept.model_dump() == stored.model_dump()
    assert resumed.status == "incomplete" and resumed.usage.output_tokens == 4, resumed
    assert resumed.created_at == stopped.created_at
    # the conversation continued: the first input, its answer, the new input
    assert after.usage.input_tokens > stored.usage.input_tokens + stored.usage.output_tokens


@pytest.mark.parametrize("damaged", ["responses.sqlite", "batches/batches.sqlite"])
def test_a_damaged_state_file_is_refused_naming_it_before_the_model_loads(tmp_path, damaged):
    from tests.jobs.run.test_runner import run_cli

    state = tmp_path / "state"
    (state / "batches").mkdir(parents=True)
    (state / damaged).write_bytes(b"no database here\n" * 300)
    result = run_cli("serve", "--model", "/nonexistent/model", "--state-dir", str(state))
    assert result.exit_code == 2, result.output
    assert f"{state / damaged}: cannot open" in result.output and "move" in result.output
    if damaged == "responses.sqlite":
        BatchStore(state / "batches").close()  # the state dir was let go
