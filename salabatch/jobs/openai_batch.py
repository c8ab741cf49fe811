"""OpenAI Batch input: a .jsonl of chat-completion requests becomes rows of the run.

Each line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {"messages",
"max_tokens" | "max_completion_tokens", "temperature", "top_p", "seed", ...}}`. Unset sampling
fields take the job's `generation:` values; a line that cannot be served becomes an error row
named by its custom_id (or `line-N`), and the others go on. Every request is its own prompt
(no shared prefix), decoded in batches across requests.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from salabatch.engine.sampling import SamplingParams
from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import JobSpecError
from salabatch.jobs.documents import Document
from salabatch.jobs.plan import DocPlan, Planner, Row, request_key
from salabatch.jobs.spec import JobSpec

ROLES = ("system", "user", "assistant")
# Body fields we read; others that change the answer are refused rather than ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "response_format", "logprobs", "stop")


def plan_requests(spec: JobSpec, tok: Tokenizer, planner: Planner) -> Iterator[DocPlan]:
    """One DocPlan (one row, whole prompt) per request line not done yet (`planner` gives the
    model identity and the done keys, and counts what it skips)."""
    path = Path(spec.requests)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise JobSpecError(f"cannot read requests file ({e.strerror})", path=path) from None
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        custom_id, body, problem = _parse(raw, number)
        if custom_id in seen:
            custom_id, problem = f"{custom_id}#line-{number}", f"duplicate custom_id {custom_id!r}"
        seen.add(custom_id)
        canonical = (
            json.dumps(body, sort_keys=True, ensure_ascii=False)
            if body
            else raw.decode("utf-8", "replace")
        )
        sha = hashlib.sha256(canonical.encode()).hexdigest()
        key = request_key(**planner.identity, custom_id=custom_id, request=canonical)
        planner.job_keys.add(key)
        if key in planner.done:
            planner.skipped += 1
            continue
        doc = Document(custom_id, str(path), "", sha, meta={"line": number})
        question = ""
        params, max_tokens, think = (
            SamplingParams(),
            spec.generation.max_tokens,
            spec.generation.think,
        )
        prompt: tuple[int, ...] = ()
        if problem is None:
            try:
                messages = _messages(body["messages"])
                question = next(
                    (m["content"] for m in reversed(messages) if m["role"] == "user"), ""
                )
                params, max_tokens = _sampling(spec, body)
                prompt = tuple(tok.chat_prompt_ids(messages, think=think))
            except (ValueError, TypeError, KeyError) as e:
                problem = str(e).strip("'\"")
        row = Row(key, doc, "request", question, custom_id, params, max_tokens, think, prompt)
        yield DocPlan(doc, [row], error=None if problem is None else f"line {number}: {problem}")


def _parse(raw: bytes, number: int) -> tuple[str, dict | None, str | None]:
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"line-{number}", None, f"not valid JSON ({e})"
    if not isinstance(line, dict):
        return f"line-{number}", None, "a request line must be a JSON object"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return f"line-{number}", None, "custom_id is missing"
    body = line.get("body")
    url = line.get("url", "/v1/chat/completions")
    if not isinstance(body, dict):
        return custom_id, None, "body is missing"
    if not str(url).endswith("/chat/completions"):
        return custom_id, body, f"only /v1/chat/completions requests are served, not {url}"
    if body.get("n", 1) != 1:
        return custom_id, body, "n must be 1"
    refused = [f for f in UNSUPPORTED if body.get(f) not in (None, False)]
    if refused:
        return custom_id, body, f"unsupported field(s): {', '.join(refused)}"
    return custom_id, body, None


def _messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ValueError(f"messages[{i}]: only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]: content must be text")
        out.append({"role": m["role"], "content": content})
    return out


def _sampling(spec: JobSpec, body: dict) -> tuple[SamplingParams, int]:
    gen = spec.generation

    def number(name: str, default, kind=float):
        value = body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number")
        return kind(value)

    max_tokens = number("max_completion_tokens", None, int) or number(
        "max_tokens", gen.max_tokens, int
    )
    if max_tokens < 1:
        raise ValueError("max_tokens must be ≥ 1")
    params = SamplingParams(
        temperature=number("temperature", gen.temperature),
        top_p=number("top_p", gen.top_p),
        top_k=gen.top_k,
        repetition_penalty=gen.repetition_penalty,
        seed=number("seed", gen.seed, int),
    )
    return params, max_tokens
