"""OpenAI Batch requests on builtin:random (an untrained test model): the body fields honoured or
refused, `run --requests x.jsonl -o out.jsonl` read back line by line with the `openai`
package's own types, in input order, and request lines sharing a document prefilled once."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from salabatch.engine.tokenizer import Tokenizer, load_tokenizer
from salabatch.errors import TokenizerError
from salabatch.jobs.results.read import read_results
from salabatch.jobs.run.openai_batch import plan_requests
from salabatch.jobs.run.plan import Planner
from salabatch.jobs.spec.load import requests_job
from salabatch.jobs.store.prefix_store import PrefixStore
from tests.jobs.run.test_runner import run_cli

openai_types = pytest.importorskip("openai.types", reason="the openai package is a test extra")
chat_types = pytest.importorskip("openai.types.chat")

WORDS = ["harbour", "ledger", "tide", "ferry", "quay", "fender", "crane", "ballast", "pilot"]
# ~1200 tokens of the demo tokenizer
DOCUMENT = " ".join(random.Random(0).choice(WORDS) for _ in range(350))


def line(custom_id: str, content: str = "Name a river.", **body) -> dict:
    messages = body.pop("messages", [{"role": "user", "content": content}])
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": messages, "max_tokens": 4, **body},
    }


def write_requests(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def run_requests(tmp_path: Path, model: Path, requests: Path, out: Path, *sets: str):
    settings = [f"cache.dir={tmp_path / 'cache'}", *sets]
    args = ["--requests", str(requests), "--model", str(model), "-o", str(out)]
    return run_cli("run", *args, *[a for s in settings for a in ("--set", s)])


def plans_of(tmp_path: Path, model: Path, lines: list, *sets: str):
    """The DocPlans of a requests file, as a run plans them (no weights)."""
    requests = write_requests(tmp_path / "plan.jsonl", lines)
    spec, _ = requests_job(requests, str(model), [f"cache.dir={tmp_path / 'cache'}", *sets])
    tok = load_tokenizer(model)
    return list(plan_requests(spec, tok, Planner(spec, tok, "sha", "float32")))


def only_row(plans):
    (plan,) = plans
    (row,) = plan.rows
    return plan, row


# ---- the round trip ----------------------------------------------------------------------------


def test_run_writes_openai_batch_output_jsonl_in_input_order(tmp_path, tiny_model):
    lines = [
        line("z-first", max_tokens=5),
        line(
            "b-developer",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name a river."}]},
            ],
            temperature=0.7,
            seed=3,
            min_p=0.05,
            top_k=20,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            max_completion_tokens=3,
        ),
        line("m-think", chat_template_kwargs={"enable_thinking": True}, stop=["\n\n"]),
        line("c-embed"),
        line("d-tools", tools=[{"type": "function", "function": {"name": "f"}}]),
        "not json",
    ]
    lines[3]["url"] = "/v1/embeddings"
    requests = write_requests(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out" / "answers.jsonl"
    result = run_requests(tmp_path, tiny_model, requests, out)
    assert result.exit_code == 3, result.output  # three lines cannot be served: error rows
    assert f"OpenAI Batch output -> {out}" in result.output

    got = [json.loads(text) for text in out.read_text(encoding="utf-8").splitlines()]
    ids = ["z-first", "b-developer", "m-think", "c-embed", "d-tools", "line-6"]
    assert [x["custom_id"] for x in got] == ids  # input order, not custom_id order
    table = {r["custom_id"]: r for r in read_results(out.with_suffix(".parquet")).to_pylist()}
    for number, x in enumerate(got, start=1):
        assert set(x) == {"id", "custom_id", "response", "error"}
        if x["error"] is not None:
            error = openai_types.BatchError.model_validate(x["error"])
            assert x["response"] is None and error.line == number and error.message
            continue
        assert x["response"]["status_code"] == 200
        body = chat_types.ChatCompletion.model_validate(x["response"]["body"])
        row = table[x["custom_id"]]
        assert body.choices[0].message.content == row["answer"]
        assert body.usage.completion_tokens == row["completion_tokens"]
        assert row["request_line"] == number
    assert table["b-developer"]["question"] == "Name a river."
    assert table["b-developer"]["completion_tokens"] <= 3  # max_completion_tokens wins
    think = got[2]["response"]["body"]["choices"][0]["message"]
    assert think["reasoning_content"] == table["m-think"]["reasoning"] is not None
    assert "reasoning_content" not in got[0]["response"]["body"]["choices"][0]["message"]
    assert "chat/completions" in got[3]["error"]["message"]
    assert "tools" in got[4]["error"]["message"]
    assert got[5]["error"]["message"] == "line 6: not valid JSON: Expecting value at column 1"
    assert "error in request line-6: line 6: not valid JSON" in result.output  # said as it runs

    # `salabatch export` of the results beside it writes the same bytes
    exported = tmp_path / "exported.jsonl"
    assert run_cli("export", str(out.with_suffix(".parquet")), "-o", str(exported)).exit_code == 0
    assert exported.read_bytes() == out.read_bytes()


def test_rerun_keeps_input_order_of_the_file_as_it_is_now(tmp_path, tiny_model):
    requests = write_requests(tmp_path / "batch.jsonl", [line("a"), line("b", "Name a sea.")])
    out = tmp_path / "answers.jsonl"
    assert run_requests(tmp_path, tiny_model, requests, out).exit_code == 0
    before = {json.loads(x)["custom_id"]: x for x in out.read_text().splitlines()}
    # a line inserted at the top, the others swapped: only the new one runs
    write_requests(requests, [line("new", "Name a lake."), line("b", "Name a sea."), line("a")])
    again = run_requests(tmp_path, tiny_model, requests, out)
    assert "1 row written" in again.output and "2 already done" in again.output
    # request lines are counted as such, not as documents (each line was one)
    assert "0 documents, 1 request line," in again.output, again.output
    shown = run_cli("inspect", str(out.with_suffix(".parquet"))).output
    assert re.search(r"documents +0\n", shown) and re.search(r"request lines +3\n", shown), shown
    after = out.read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in after] == ["new", "b", "a"]
    assert after[1:] == [before["b"], before["a"]]  # done rows: the same lines


def test_a_job_file_output_ending_in_jsonl_writes_batch_output(tmp_path, tiny_model):
    write_requests(tmp_path / "batch.jsonl", [line("b"), line("a", "Name a sea.")])
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: j\nmodel: {tiny_model}\nrequests: batch.jsonl\n"
        f"cache: {{dir: {tmp_path / 'cache'}}}\noutput: {{path: out/answers.jsonl}}\n"
    )
    assert run_cli("run", str(job)).exit_code == 0
    out = tmp_path / "out" / "answers.jsonl"
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["b", "a"]
    assert len(read_results(out.with_suffix(".parquet"))) == 2


def test_a_request_line_repeating_a_document_rows_custom_id_is_an_error_row(tmp_path, tiny_model):
    # Else the two rows would share a custom_id and every run keep only one of them.
    (tmp_path / "a.txt").write_text("The ferry leaves at seven.")
    write_requests(tmp_path / "batch.jsonl", [line("a.txt/q1"), line("other")])
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: j\nmodel: {tiny_model}\ndocuments: [{{path: a.txt}}]\nquestions: [when]\n"
        f"requests: batch.jsonl\ncache: {{dir: {tmp_path / 'cache'}}}\n"
        "output: {path: out/r.parquet}\n"
    )
    first = run_cli("run", str(job))
    assert first.exit_code == 3, first.output
    got = {r["custom_id"]: r for r in read_results(tmp_path / "out" / "r.parquet").to_pylist()}
    assert sorted(got) == ["a.txt/q1", "a.txt/q1#line-1", "other"]
    assert got["a.txt/q1"]["status"] == "ok" and got["a.txt/q1"]["question_id"] == "q1"
    assert got["a.txt/q1#line-1"]["error"] == (
        "line 1: duplicate custom_id 'a.txt/q1' (a document row's)"
    )
    again = run_cli("run", str(job))
    assert "0 rows written (0 errors), 3 already done" in again.output, again.output


def test_a_repeated_custom_id_is_renamed_to_one_no_line_has(tmp_path, tiny_model):
    """Lines `a#line-3`, `a`, `a`: the third, renamed `a#line-3`, took the first's id, and one
    of the two rows was lost at every merge."""
    plans = plans_of(tmp_path, tiny_model, [line("a#line-3"), line("a"), line("a")])
    errors = {row.custom_id: plan.error for plan in plans for row in plan.rows}
    assert errors == {
        "a#line-3": None,
        "a": None,
        "a#line-3~2": "line 3: duplicate custom_id 'a' (an earlier line's)",
    }


def test_engine_max_context_bounds_a_request_line_as_it_bounds_a_documents_row(
    tmp_path, tiny_model
):
    """A prompt over max_context was answered whole; now it is an error row, and an answer
    is cut where max_context ends (as the server cuts it where the model's context does)."""
    long, short = line("long", "word " * 300), line("short", "Name a river.", max_tokens=500)
    plans = plans_of(tmp_path, tiny_model, [long, short], "engine.max_context=200")
    rows = {row.custom_id: (plan, row) for plan in plans for row in plan.rows}
    plan, _ = rows["long"]
    assert re.fullmatch(
        r"line 1: the prompt has \d+ tokens; engine\.max_context 200 leaves no room for an answer",
        plan.error,
    )
    plan, row = rows["short"]
    assert plan.error is None and 0 < row.max_tokens < 200
    unbounded = {r.custom_id: r for p in plans_of(tmp_path, tiny_model, [short]) for r in p.rows}
    assert unbounded["short"].max_tokens == 500 and unbounded["short"].key != row.key


def test_a_bad_line_that_hides_the_model_is_named_by_its_line(tmp_path, tiny_model):
    requests = write_requests(tmp_path / "batch.jsonl", [line("a"), "{oops", line("b")])
    result = run_cli("run", "--requests", str(requests))
    assert result.exit_code == 2
    assert result.output == (
        f"error: {requests}: line 2: not valid JSON (Expecting property name enclosed in double "
        "quotes at column 2), so the model it names is unknown; fix the line or give --model\n"
    )


def test_without_a_job_file_a_mistake_says_whether_the_command_line_made_it(tmp_path):
    """`--requests` alone: a mistake in --model, --set or -o is marked "(from the command line)",
    a model named by the requests "(the model the requests name)" (both were pinned on the
    requests file, as if a line of it were wrong)."""
    requests = write_requests(tmp_path / "batch.jsonl", [line("a")])
    where = [
        (("--model", str(tmp_path / "nowhere")), f"model: no such folder: {tmp_path / 'nowhere'}"),
        (("--set", "generation.max_tokens=x"), "generation.max_tokens: expected an integer"),
        (("-o", str(tmp_path / "x.csv")), "output.path: must end in .parquet"),
    ]
    for args, message in where:
        result = run_cli("run", "--requests", str(requests), *args)
        assert result.exit_code == 2 and message in result.output, result.output
        assert result.output.rstrip().endswith("(from the command line)"), result.output
    own = run_cli("run", "--requests", str(requests))  # the requests name model "m"
    assert own.exit_code == 2
    assert own.output.rstrip().endswith("(the model the requests name)"), own.output


def test_requests_without_o_write_the_batch_output_beside_the_results(
    tmp_path, tiny_model, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    requests = write_requests(tmp_path / "batch.jsonl", [line("a"), line("b", "Name a sea.")])
    args = ["--requests", str(requests), "--model", str(tiny_model)]
    result = run_cli("run", *args, "--set", f"cache.dir={tmp_path / 'cache'}")
    assert result.exit_code == 0, result.output
    out = tmp_path / "results" / "batch.jsonl"
    assert f"OpenAI Batch output -> {out}" in result.output
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", "b"]
    assert len(read_results(out.with_suffix(".parquet"))) == 2


def test_output_suffix_other_than_parquet_or_jsonl_is_refused(tmp_path, tiny_model):
    requests = write_requests(tmp_path / "batch.jsonl", [line("a")])
    result = run_requests(tmp_path, tiny_model, requests, tmp_path / "answers.csv")
    assert result.exit_code == 2 and "answers.csv" in result.output
    assert ".parquet" in result.output and ".jsonl" in result.output
    assert list(tmp_path.iterdir()) == [requests]  # nothing written, no model loaded


# ---- body fields ------------------------------------------------------------------------------


def test_developer_role_renders_as_a_system_message(tmp_path, tiny_model):
    def prompt(role: str) -> tuple[int, ...]:
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi."}]
        return only_row(plans_of(tmp_path, tiny_model, [line("a", messages=messages)]))[1].prompt

    assert prompt("developer") == prompt("system")


def test_sampling_fields_are_honoured(tmp_path, tiny_model):
    plan, row = only_row(
        plans_of(
            tmp_path,
            tiny_model,
            [
                line(
                    "a",
                    temperature=0.5,
                    top_p=0.9,
                    top_k=-1,
                    min_p=0.1,
                    presence_penalty=-1.5,
                    frequency_penalty=2,
                    repetition_penalty=1.1,
                    seed=-4,
                    max_tokens=9,
                    max_completion_tokens=7,
                    stop="END",
                    chat_template_kwargs={"enable_thinking": True},
                    logit_bias={"12": -100, "7": 2.5},
                )
            ],
        )
    )
    assert plan.error is None and plan.doc_prompt is None
    p = row.params
    assert p.logit_bias == ((7, 2.5), (12, -100.0))
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 0, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-1.5, 2.0, 1.1)
    assert p.seed == -4 and row.max_tokens == 7 and row.stop_strings == ("END",) and row.think
    assert row.request_line == 1


@pytest.mark.parametrize(
    "extra",
    [
        {"model": "gpt-x", "user": "u", "metadata": {"k": "v"}, "store": False},
        {"n": 1, "stream": False, "logprobs": False, "top_logprobs": 0, "service_tier": "auto"},
        {"tools": None, "stop": None, "chat_template_kwargs": {}},
    ],
)
def test_fields_that_do_not_change_the_answer_are_accepted(tmp_path, tiny_model, extra):
    plan, _ = only_row(plans_of(tmp_path, tiny_model, [line("a", **extra)]))
    assert plan.error is None


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "none"}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
        ({"n": 2}, "n"),
        ({"stream": True}, "stream"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # past the vocabulary
        ({"logit_bias": [5]}, "logit_bias"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"documents": []}}, "chat_template_kwargs.documents"),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "enable_thinking"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "high"}, "frequency_penalty"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": True}, "temperature"),
    ],
)
def test_fields_that_cannot_be_honoured_give_an_error_row_naming_them(
    tmp_path, tiny_model, extra, field
):
    plan, row = only_row(plans_of(tmp_path, tiny_model, [line("a", **extra)]))
    assert plan.error is not None and field in plan.error and plan.error.startswith("line 1:")
    assert row.custom_id == "a" and row.request_line == 1


def test_a_line_needs_post_and_a_served_url_as_the_batches_api_checks_them(tmp_path, tiny_model):
    """A GET line was answered, a line without url taken for a chat one, and any url ending
    in /completions served: each is now an error row naming the field."""
    get, bare, other = line("get"), line("bare"), line("other")
    get["method"] = "GET"
    del bare["url"]
    other["url"] = "/v2/chat/completions"
    deep = "[" * 100_000 + "]" * 100_000  # nested past Python's stack: it crashed the run
    digits = '{"n": 1' + "0" * 5000 + "}"  # past Python's limit on an integer's: so did this
    plans = plans_of(tmp_path, tiny_model, [get, bare, other, deep, digits, line("ok")])
    assert [p.error for p in plans] == [
        "line 1: method must be POST, got 'GET'",
        "line 2: url is missing: it must be one of /v1/chat/completions, /v1/completions, "
        "/v1/responses",
        "line 3: url '/v2/chat/completions' is not served: it must be one of "
        "/v1/chat/completions, /v1/completions, /v1/responses",
        "line 4: not valid JSON: nested too deeply",
        "line 5: not valid JSON: an integer of more than 4,300 digits",
        None,
    ]


def test_a_line_break_unicode_has_inside_json_is_no_line_end(tmp_path, tiny_model):
    """U+2028 in a line (JSON leaves it as it is): the model was read from str.splitlines'
    halves (not valid JSON, exit 2), and the output line held it raw, so that the README's
    `.text.splitlines()` split it in two."""
    request = line("a\u2028b", "Name a river\u2029.")
    request["body"]["model"] = str(tiny_model)
    requests = write_requests(tmp_path / "batch.jsonl", [request])
    out = tmp_path / "out.jsonl"
    result = run_cli("run", "--requests", str(requests), "-o", str(out))
    assert result.exit_code == 0, result.output
    (text,) = out.read_text().splitlines()
    assert json.loads(text)["custom_id"] == "a\u2028b" and "\\u2028" in text
    # export: never over the requests file these results answer (run refuses it too)
    exported = run_cli("export", str(out.with_suffix(".parquet")), "-o", str(requests))
    assert exported.exit_code == 2 and "refusing to overwrite the input" in exported.output
    again = run_cli("export", str(out.with_suffix(".parquet")), "-o", str(tmp_path / "x.jsonl"))
    assert again.exit_code == 0 and "1 line -> " in again.output, again.output
    empty = write_requests(tmp_path / "empty.jsonl", ["", "  "])
    result = run_cli("run", "--requests", str(empty), "--model", str(tiny_model))
    assert result.exit_code == 2 and f"requests: no request lines in {empty}" in result.output


def test_n_above_1_is_an_error_row_that_says_where_it_is_answered(tmp_path, tiny_model):
    plan, _ = only_row(plans_of(tmp_path, tiny_model, [line("a", n=2)]))
    assert plan.error == (
        "line 1: n must be 1 (a row of the results holds one answer; salabatch serve's "
        "/v1/batches answers n > 1), got 2"
    )


def test_a_lone_surrogate_fails_its_line_in_a_message_and_is_kept_in_a_custom_id(
    tmp_path, tiny_model
):
    """JSON allows "\\ud800", which no tokenizer takes: in a message the line is an error row
    naming the field; in a custom_id the line is planned as any other."""
    plans = plans_of(tmp_path, tiny_model, [line("a", "Hi\ud800"), line("b\ud800")])
    assert [p.rows[0].custom_id for p in plans] == ["a", "b\ud800"]
    assert "messages[0].content" in plans[0].error and "U+D800" in plans[0].error
    assert plans[1].error is None


def test_a_chat_template_refusing_the_messages_fails_that_line_only(
    tmp_path, tiny_model, monkeypatch
):
    real = Tokenizer.chat_prompt_ids

    def refuse_assistant_first(self, messages, **kw):
        if messages[0]["role"] == "assistant":
            raise TokenizerError("roles must alternate user/assistant", field="chat_template")
        return real(self, messages, **kw)

    monkeypatch.setattr(Tokenizer, "chat_prompt_ids", refuse_assistant_first)
    first = [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Hello?"}]
    plans = plans_of(tmp_path, tiny_model, [line("a", messages=first), line("b")])
    assert [(p.rows[0].custom_id, p.error) for p in plans] == [
        ("a", "line 1: chat_template: roles must alternate user/assistant"),
        ("b", None),
    ]


def test_request_keys_follow_the_body_and_the_job_defaults(tmp_path, tiny_model):
    def key(*sets: str, **body) -> str:
        return only_row(plans_of(tmp_path, tiny_model, [line("a", **body)], *sets))[1].key

    base = key()
    assert key() == base
    changed = [
        key(stop="x"),
        key(min_p=0.2),
        key(presence_penalty=0.1),
        key(frequency_penalty=0.1),
        key(top_k=5),
        key(chat_template_kwargs={"enable_thinking": True}),
        key("generation.temperature=0.5"),  # the default of the body's unset temperature
    ]
    assert len({base, *changed}) == len(changed) + 1


# ---- automatic prefix caching -------------------------------------------------------------------


def shared_document_lines(*questions: str) -> list[dict]:
    return [
        line(
            f"q{i}",
            messages=[
                {"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": f"{DOCUMENT}\n\n{q}"},
            ],
        )
        for i, q in enumerate(questions, start=1)
    ]


def test_lines_sharing_a_document_plan_one_prefix(tmp_path, tiny_model):
    lines = shared_document_lines("Who pilots?", "Where is the beacon?")
    lines.insert(1, line("alone"))
    plans = plans_of(tmp_path, tiny_model, lines, "engine.pool_max_tokens=128")
    grouped = [p for p in plans if p.doc_prompt is not None]
    (group,) = grouped
    assert [r.custom_id for r in group.rows] == ["q1", "q2"]  # in line order
    assert [r.request_line for r in group.rows] == [1, 3]
    assert group.doc_tokens > 1000 and group.doc_tokens % 64 == 0
    assert all(r.doc.doc_id == r.custom_id for r in group.rows)  # each row its own identity
    alone = [p for p in plans if p.doc_prompt is None]
    assert [p.rows[0].custom_id for p in alone] == ["alone"]
    # below pool_max_tokens nothing is grouped: short shared prompts pool
    assert all(p.doc_prompt is None for p in plans_of(tmp_path, tiny_model, lines))


def test_lines_sharing_a_document_prefill_it_once(tmp_path, tiny_model):
    pool = ("engine.pool_max_tokens=128", "engine.dtype=float32")  # float32: answers compare
    requests = write_requests(
        tmp_path / "batch.jsonl", shared_document_lines("Who pilots?", "Where is the beacon?")
    )
    out = tmp_path / "answers.jsonl"
    assert run_requests(tmp_path, tiny_model, requests, out, *pool).exit_code == 0
    first, second = sorted(
        read_results(out.with_suffix(".parquet")).to_pylist(), key=lambda r: r["request_line"]
    )
    assert first["cache_source"] == "none" and first["cached_tokens"] == 0
    assert first["doc_prefill_s"] > 0 and first["doc_tokens"] > 1000
    assert second["cache_source"] == "memory" and second["doc_prefill_s"] == 0
    assert second["cached_tokens"] == second["doc_tokens"] == first["doc_tokens"]
    assert len(PrefixStore(tmp_path / "cache").entries()) == 1
    usage = json.loads(out.read_text().splitlines()[1])["response"]["body"]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == second["cached_tokens"]

    # the answers are those of each line prefilled whole
    whole = tmp_path / "whole.jsonl"
    no_sharing = run_requests(tmp_path, tiny_model, requests, whole, "engine.dtype=float32")
    assert no_sharing.exit_code == 0
    plain = {r["custom_id"]: r for r in read_results(whole.with_suffix(".parquet")).to_pylist()}
    assert plain["q1"]["doc_tokens"] is None and plain["q2"]["cached_tokens"] == 0
    for r in (first, second):
        assert plain[r["custom_id"]]["answer"] == r["answer"]

    # a new line on the same document, in a later run: its prefix comes from the store
    write_requests(requests, shared_document_lines("Who pilots?", "Where is the beacon?", "Why?"))
    assert run_requests(tmp_path, tiny_model, requests, out, *pool).exit_code == 0
    third = {r["custom_id"]: r for r in read_results(out.with_suffix(".parquet")).to_pylist()}
    assert third["q3"]["cache_source"] == "disk"
    assert third["q3"]["cached_tokens"] == first["doc_tokens"]
    assert third["q1"]["run_id"] == first["run_id"]  # done rows are not recomputed
    assert len(PrefixStore(tmp_path / "cache").entries()) == 1


def test_logprobs_of_request_lines_and_of_the_jobs_generation(tmp_path, tiny_model):
    """A line with logprobs gets the `logprobs` column and OpenAI's logprobs.content in its
    output line: one entry per generated token, whose bytes are the answer's, each token the
    most likely of its alternatives (greedy); a line without them has none, unless
    generation.logprobs sets a default (a line's own `logprobs: false` still wins)."""
    lines = [
        line("top2", logprobs=True, top_logprobs=2, max_tokens=6),
        line("plain", "Name a sea.", max_tokens=6),
        line("off", "Name a lake.", logprobs=False, max_tokens=6),
    ]
    requests = write_requests(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "answers.jsonl"
    assert run_requests(tmp_path, tiny_model, requests, out).exit_code == 0
    rows = {r["custom_id"]: r for r in read_results(out.with_suffix(".parquet")).to_pylist()}
    entries = rows["top2"]["logprobs"]
    assert len(entries) == rows["top2"]["completion_tokens"]
    text = b"".join(bytes(e["bytes"]) for e in entries).decode()
    assert text.strip() == rows["top2"]["answer"]
    for e in entries:
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted(
            (t["logprob"] for t in e["top_logprobs"]), reverse=True
        )
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
    assert rows["plain"]["logprobs"] is None and rows["off"]["logprobs"] is None
    got = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    body = chat_types.ChatCompletion.model_validate(got["top2"]["response"]["body"])
    assert [e.model_dump() for e in body.choices[0].logprobs.content] == entries
    assert got["plain"]["response"]["body"]["choices"][0]["logprobs"] is None

    again = run_requests(tmp_path, tiny_model, requests, out, "generation.logprobs=0")
    assert again.exit_code == 0, again.output
    rows = {r["custom_id"]: r for r in read_results(out.with_suffix(".parquet")).to_pylist()}
    assert [e["top_logprobs"] for e in rows["plain"]["logprobs"]] == [[]] * len(
        rows["plain"]["logprobs"]
    )
    assert rows["off"]["logprobs"] is None  # its own logprobs: false wins
    assert rows["top2"]["logprobs"] == entries  # rerun (the defaults are in every line's key)


def test_response_format_and_guided_lines_answer_within_their_pattern(tmp_path, tiny_model):
    """json_schema, json_object, guided_choice: answers that parse, validate, are one of the
    choices; a line whose pattern cannot be compiled against the vocabulary is an error row
    naming it, and the lines beside it are answered."""
    schema = {
        "type": "object",
        "properties": {"river": {"type": "string", "maxLength": 20}},
        "required": ["river"],
    }
    lines = [
        line(
            "schema",
            max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        ),
        line("object", max_tokens=40, response_format={"type": "json_object"}),
        line("choice", max_tokens=8, guided_choice=["Nile", "Rhine"]),
        # a choice's own spaces and newlines are its text (a chat answer was stripped)
        line("spaced", max_tokens=8, guided_choice=[" Nile ", "\nRhine\n"]),
        line("bad", max_tokens=8, guided_regex="(?=a)b"),
        line("free", max_tokens=8),
    ]
    requests = write_requests(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "answers.jsonl"
    result = run_requests(tmp_path, tiny_model, requests, out)
    assert result.exit_code == 3, result.output
    rows = {r["custom_id"]: r for r in read_results(out.with_suffix(".parquet")).to_pylist()}
    assert set(json.loads(rows["schema"]["answer"])) == {"river"}
    assert isinstance(json.loads(rows["object"]["answer"]), dict)
    assert rows["choice"]["answer"] in ("Nile", "Rhine")
    assert rows["spaced"]["answer"] in (" Nile ", "\nRhine\n")
    assert all(rows[c]["finish_reason"] == "stop" for c in ("schema", "object", "choice"))
    assert rows["bad"]["status"] == "error" and "pattern cannot be used" in rows["bad"]["error"]
    assert rows["free"]["status"] == "ok"
    assert "error in request bad: GenerationError" in result.output


def text_line(custom_id: str, prompt, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": prompt, "max_tokens": 6, **body},
    }


def test_text_completion_lines_answer_their_prompt_as_it_is(tmp_path, tiny_model):
    """/v1/completions lines beside chat lines: a text or token-id prompt is answered as the
    engine answers exactly its tokens (no chat template, its BOS where the tokenizer adds
    one), the answer as generated; the output line is a text_completion (legacy logprobs: each
    token's text and log-probability, the alternatives and itself, offsets); what a row cannot
    hold (echo, several prompts, n) is an error row naming it; export writes the same bytes."""
    from salabatch.engine.generate import Generator, Request
    from salabatch.engine.load import load_model

    tok = load_tokenizer(tiny_model)
    ids = tok.encode("The ferry leaves at", add_bos=tok.add_bos_token)
    lines = [
        text_line("text", "The ferry leaves at", logprobs=2),
        text_line("ids", ids[1:] + ids[1:3], stop=["zzz"]),
        line("chat"),
        text_line("echo", "x", echo=True),
        text_line("two", ["a", "b"]),
        text_line("n", "a", n=2),
    ]
    requests = write_requests(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "answers.jsonl"
    result = run_requests(tmp_path, tiny_model, requests, out)
    assert result.exit_code == 3, result.output
    got = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    rows = {r["custom_id"]: r for r in read_results(out.with_suffix(".parquet")).to_pylist()}
    model = load_model(tiny_model)
    for custom_id, prompt in (("text", ids), ("ids", ids[1:] + ids[1:3])):
        request = Request(custom_id, tuple(prompt), max_tokens=6, stop=frozenset(tok.eos_ids))
        (g,) = Generator(model, batch_size=1).generate([request])
        body = openai_types.Completion.model_validate(got[custom_id]["response"]["body"])
        assert (
            body.object == "text_completion" and body.choices[0].text == rows[custom_id]["answer"]
        )
        assert rows[custom_id]["answer"] == tok.decode(g.tokens, skip_special=True)
        assert rows[custom_id]["question_id"] == "completion"
        assert body.usage.prompt_tokens == len(prompt)
    lp = got["text"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == rows["text"]["completion_tokens"] == len(lp["text_offset"])
    assert "".join(lp["tokens"]) == rows["text"]["answer"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    for token, value, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert top[token] == value == max(top.values()) and 1 <= len(top) <= 3  # greedy
    assert got["ids"]["response"]["body"]["choices"][0]["logprobs"] is None
    assert got["chat"]["response"]["body"]["object"] == "chat.completion"
    assert rows["chat"]["question_id"] == "request"
    assert "echo must be false" in got["echo"]["error"]["message"]
    assert "prompt must be one prompt" in got["two"]["error"]["message"]
    assert "n must be 1" in got["n"]["error"]["message"]
    exported = tmp_path / "exported.jsonl"
    assert run_cli("export", str(out.with_suffix(".parquet")), "-o", str(exported)).exit_code == 0
    assert exported.read_bytes() == out.read_bytes()


def response_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def test_responses_lines_answer_as_the_chat_completion_of_their_messages(tmp_path, tiny_model):
    """/v1/responses lines: `instructions` and `input` (a string, or messages with text parts)
    answer as the chat line of the same messages does; the output line is a response object
    the `openai` package's own type accepts (its message the row's answer, its usage the
    row's tokens), `incomplete` where max_output_tokens ran out; thinking (reasoning.effort)
    puts the think block in a reasoning item with its tokens counted; a line that continues a
    stored response, or a tool, is an error row naming it; export writes the same bytes. A
    chat line whose think block a pattern forces counts its reasoning tokens."""
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "A port?"}]
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "A port?"}]}]
    lines = [
        line("chat", messages=messages, max_tokens=6),
        response_line("plain", instructions=DOCUMENT, input="A port?", max_output_tokens=6),
        response_line("parts", instructions=DOCUMENT, input=parts, max_output_tokens=6),
        response_line("think", input="A port?", max_output_tokens=12, reasoning={"effort": "low"}),
        response_line("short", input="A port?", max_output_tokens=1),
        response_line("chained", input="And?", previous_response_id="resp_1"),
        response_line("tool", input="x", tools=[{"type": "function", "name": "f"}]),
        response_line("none", input="x", max_output_tokens=0),
        line(
            "forced",
            chat_template_kwargs={"enable_thinking": True},
            max_tokens=80,  # the pattern's text, however the model spells it in tokens
            guided_regex="<think>\nplan the route\n</think>\n\nyes",
            logprobs=True,  # the tokens the model spelled it in
        ),
    ]
    requests = write_requests(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "answers.jsonl"
    result = run_requests(tmp_path, tiny_model, requests, out, "generation.max_tokens=6")
    assert result.exit_code == 3, result.output
    got = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    rows = {r["custom_id"]: r for r in read_results(out.with_suffix(".parquet")).to_pylist()}
    responses = pytest.importorskip("openai.types.responses")
    chat = rows["chat"]["answer"]
    for custom_id in ("plain", "parts", "think", "short"):
        body = responses.Response.model_validate(got[custom_id]["response"]["body"])
        row = rows[custom_id]
        assert row["question_id"] == "response" and body.output_text == row["answer"]
        assert body.usage.output_tokens == row["completion_tokens"]
        assert body.usage.input_tokens == row["prompt_tokens"]
    assert rows["plain"]["answer"] == rows["parts"]["answer"] == chat
    assert rows["plain"]["prompt_tokens"] == rows["chat"]["prompt_tokens"]
    short = responses.Response.model_validate(got["short"]["response"]["body"])
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    think = responses.Response.model_validate(got["think"]["response"]["body"])
    # reasoning.effort turned thinking on (the reasoning column is set only then)
    assert think.output[-1].type == "message" and rows["think"]["reasoning"] is not None
    assert rows["plain"]["reasoning"] is None
    # a think block forced by a pattern (an untrained model writes none): its text and tokens
    forced = rows["forced"]
    assert (forced["reasoning"], forced["answer"]) == ("plan the route", "yes")
    # the generated tokens up to the one that closes the block
    spelled = [lp["token"] for lp in forced["logprobs"]]
    closed = next(i for i in range(len(spelled)) if "</think>" in "".join(spelled[: i + 1]))
    assert forced["reasoning_tokens"] == closed + 1 < forced["completion_tokens"]
    details = got["forced"]["response"]["body"]["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == forced["reasoning_tokens"]
    # ... and such a row as a response: a reasoning item before the message
    from salabatch.jobs.results.export import _openai_line

    as_response = _openai_line(forced | {"question_id": "response"})["response"]["body"]
    thought = responses.Response.model_validate(as_response)
    assert [item.type for item in thought.output] == ["reasoning", "message"]
    assert thought.output[0].content[0].text == "plan the route" and thought.output_text == "yes"
    assert thought.usage.output_tokens_details.reasoning_tokens == forced["reasoning_tokens"]
    assert "previous_response_id" in got["chained"]["error"]["message"]
    assert "tools" in got["tool"]["error"]["message"]
    assert "max_output_tokens must be an integer ≥ 1" in got["none"]["error"]["message"]
    exported = tmp_path / "exported.jsonl"
    assert run_cli("export", str(out.with_suffix(".parquet")), "-o", str(exported)).exit_code == 0
    assert exported.read_bytes() == out.read_bytes()
