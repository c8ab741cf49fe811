"""OpenAI Batch input: a .jsonl of chat-completion or text-completion requests becomes rows of
the run.

Each line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`,
or a text completion's, `"url": "/v1/completions"` with a `prompt` (a string, or token ids: one
prompt, no chat template, its answer the text as generated; its row's question_id is
`TEXT_ROWS`, "completion", a chat line's "request"), or a response's, `"url": "/v1/responses"`
(`instructions` and `input`, read as salabatch serve's /v1/responses reads them: a chat
completion of those messages, its row's question_id `RESPONSE_ROWS`, "response", exported as a
response object; it continues no stored response). The body is read by
`salabatch.openai_api`, as the server reads it; the fields that decide the answer are
honoured:

    messages                  system, developer (rendered as system), user, assistant; text only
    max_completion_tokens     or max_tokens (max_completion_tokens wins)
    temperature, top_p, top_k (-1 or 0: off), min_p, seed
    presence_penalty, frequency_penalty (OpenAI's: subtracted from the logits), repetition_penalty
    logit_bias                {token id: bias in [-100, 100]}, added to those tokens' logits
    stop                      a string or up to 4: the answer ends before the first one it holds
    chat_template_kwargs      {"enable_thinking": bool}: the row's think mode
    logprobs, top_logprobs    the row's `logprobs` column (unset: the job's generation.logprobs;
                              a text completion's `logprobs` is the number of alternatives)
    response_format           json_object, json_schema (and vLLM's guided_json, guided_regex,
                              guided_choice): what the answer must be (`engine.grammar`)

Fields that do not change the answer are accepted: `model`, `user`, `metadata`, `store`,
`service_tier`, ... (`openai_api.ACCEPTED`), and `stream` at its no-op value
(`openai_api.NO_OP`); `n` must be 1 (a row holds one answer), and so must a text completion's
prompts, with `echo` false (the server's /v1/completions answers either). Anything else
(tools, an unknown field or chat_template_kwargs key) is refused, never ignored: the line
becomes an error row naming the field. Unset sampling fields take the job's `generation:`
values. A line that cannot be served becomes an error row named by its custom_id (or
`line-N`), and the others go on.

Automatic prefix caching: request lines whose prompts share a long prefix (the same document
before different questions) are planned as one DocPlan whose document prompt is that prefix, so
it is prefilled once, kept in the prefix store, and the lines decode from it as a batch. Lines
share a prefix when their prompt ids agree on more than `engine.pool_max_tokens` tokens; done
lines take part in the grouping, so a new line finds the prefix its group stored earlier.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from salabatch import openai_api
from salabatch.engine.sampling import SamplingParams
from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import JobSpecError, TokenizerError, not_utf8
from salabatch.jobs.ingest.documents import Document
from salabatch.jobs.results.schema import CHAT_ROWS, RESPONSE_ROWS, TEXT_ROWS
from salabatch.jobs.run.plan import DocPlan, Planner, Row, request_key
from salabatch.jobs.spec.errors import show_value
from salabatch.jobs.spec.models import Engine, JobSpec
from salabatch.openai_api import BodyError

PREFIX_BLOCK = 64  # a shared prefix is cut at a multiple of this many tokens (see _shared)
ONE_ANSWER = "a row of the results holds one answer; salabatch serve's /v1/batches answers n > 1"
_KINDS = {
    "/v1/chat/completions": CHAT_ROWS,
    "/v1/completions": TEXT_ROWS,
    "/v1/responses": RESPONSE_ROWS,
}
ECHOED = "a row holds the answer alone; salabatch serve's /v1/completions echoes the prompt"


def plan_requests(spec: JobSpec, tok: Tokenizer, planner: Planner) -> Iterator[DocPlan]:
    """The request lines not done yet (`planner` gives the model identity, the done keys and
    the document rows' custom_ids, which a line may not repeat, and counts what it skips):
    error plans as they are read, then, once every line is read and tokenized, one DocPlan per
    group of lines sharing a prefix and one per other line. Plan the documents first."""
    path = Path(spec.requests)
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as e:
        raise JobSpecError(f"cannot read requests file ({e.strerror})", path=path) from None
    generation = spec.generation.key()  # the defaults of unset fields
    # engine.max_context cuts a line's answer: part of its key where set (other keys stay)
    limit = spec.engine.max_context
    bound = {} if limit == Engine.model_fields["max_context"].default else {"max_context": limit}
    lines: list[_Line] = []
    seen: set[str] = set()

    def taken(name: str) -> bool:
        return name in seen or name in planner.custom_ids

    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        custom_id, body, problem, kind = _parse(raw, number)
        if taken(custom_id):
            whose = "an earlier line's" if custom_id in seen else "a document row's"
            problem = f"duplicate custom_id {custom_id!r} ({whose})"
            renamed, n = f"{custom_id}#line-{number}", 1
            while taken(renamed):  # an earlier line's own id, say: one row each
                n += 1
                renamed = f"{custom_id}#line-{number}~{n}"
            custom_id = renamed
        seen.add(custom_id)
        canonical = (
            json.dumps(body, sort_keys=True, ensure_ascii=False)
            if body
            else raw.decode("utf-8", "replace")
        )
        if not_utf8(canonical):  # a lone surrogate (JSON allows "\ud800"): escaped, as JSON says it
            canonical = json.dumps(body, sort_keys=True)
        sha = hashlib.sha256(canonical.encode()).hexdigest()
        key = request_key(
            **planner.identity,
            custom_id=custom_id,
            request=canonical,
            generation=generation,
            **bound,
        )
        planner.job_keys.add(key)
        planner.request_lines[key] = number
        done = key in planner.done
        if done:
            planner.skipped += 1
        doc = Document(custom_id, str(path), "", sha, meta={"line": number})
        row = Row(
            key,
            doc,
            kind,
            "",
            custom_id,
            SamplingParams(),
            spec.generation.max_tokens,
            spec.generation.think,
            request_line=number,
        )
        if problem is None:
            try:
                row, ids = _request_row(spec, tok, row, body)
            except (BodyError, ValueError, TypeError, KeyError, TokenizerError) as e:  # a template
                problem = str(e).strip("'\"")  # may refuse the messages: that line fails
            else:
                if len(ids) < limit:  # the answer cut where max_context ends, as the server cuts
                    row = replace(row, max_tokens=min(row.max_tokens, limit - len(ids)))
                    lines.append(_Line(number, ids, None if done else row))
                    continue
                problem = (
                    f"the prompt has {len(ids)} tokens; engine.max_context {limit} leaves no "
                    "room for an answer"
                )
        if not done:
            yield DocPlan(doc, [row], error=f"line {number}: {problem}")
    min_shared = max(spec.engine.pool_max_tokens + 1, PREFIX_BLOCK)
    for group in _groups(lines, min_shared):
        yield from _plans(group, path)


# ---- one line --------------------------------------------------------------------------------


def _parse(raw: bytes, number: int) -> tuple[str, dict | None, str | None, str]:
    """(custom_id, body, problem, kind: CHAT_ROWS or TEXT_ROWS) of one line; the problem names
    the field it is about."""
    try:
        line = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"line-{number}", None, f"not valid JSON: {e.msg} at column {e.colno}", CHAT_ROWS
    except UnicodeDecodeError as e:
        bad = f"not valid UTF-8: byte 0x{e.object[e.start]:02x}"
        return f"line-{number}", None, bad, CHAT_ROWS
    except RecursionError:  # arrays nested past Python's stack: no request is
        return f"line-{number}", None, "not valid JSON: nested too deeply", CHAT_ROWS
    except ValueError:  # Python's limit on an integer's digits
        too_long = "not valid JSON: an integer of more than 4,300 digits"
        return f"line-{number}", None, too_long, CHAT_ROWS
    if not isinstance(line, dict):
        return f"line-{number}", None, "a request line must be a JSON object", CHAT_ROWS
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return f"line-{number}", None, "custom_id is missing", CHAT_ROWS
    body, url = line.get("body"), line.get("url")
    kind = _KINDS.get(url, CHAT_ROWS) if isinstance(url, str) else CHAT_ROWS  # another's: a chat
    if not isinstance(body, dict):
        return custom_id, None, "body is missing", kind
    if (
        not isinstance(url, str) or url not in _KINDS
    ):  # as OpenAI's batches (and salabatch serve's) check a line
        given = "url is missing" if url is None else f"url {show_value(url)} is not served"
        return custom_id, body, f"{given}: it must be one of {', '.join(_KINDS)}", kind
    if line.get("method") != "POST":
        return custom_id, body, f"method must be POST, got {show_value(line.get('method'))}", kind
    try:
        if kind == RESPONSE_ROWS:  # previous_response_id among the refused: a row stores none
            openai_api.check_fields(body, openai_api.RESPONSE_HONOURED, openai_api.RESPONSE_NO_OP)
            return custom_id, body, None, kind
        if kind == TEXT_ROWS:
            openai_api.check_fields(body, openai_api.TEXT_HONOURED, openai_api.TEXT_NO_OP)
            if len(openai_api.prompts(body.get("prompt"))) > 1:
                raise BodyError(f"prompt must be one prompt: {ONE_ANSWER}", "prompt")
            if openai_api.echo(body):
                raise BodyError(f"echo must be false: {ECHOED}", "echo")
        else:
            openai_api.check_fields(body, openai_api.HONOURED)
        openai_api.choices(body, 1, ONE_ANSWER)
    except BodyError as e:
        return custom_id, body, str(e), kind
    return custom_id, body, None, kind


def _request_row(spec: JobSpec, tok: Tokenizer, row: Row, body: dict) -> tuple[Row, np.ndarray]:
    """The row of a well-formed body, and its whole prompt's ids; ValueError names a bad field."""
    if row.question_id == TEXT_ROWS:
        return _text_row(spec, tok, row, body)
    if row.question_id == RESPONSE_ROWS:  # a response: a chat completion of its messages
        messages = openai_api.response_messages(body)
        chat = openai_api.response_sampling_fields(body)
        think = openai_api.response_think(body.get("reasoning"), spec.generation.think)
        stops, logprobs = (), spec.generation.logprobs
        grammar = openai_api.response_structure(body.get("text"))
        openai_api.response_metadata(body.get("metadata"))
    else:
        messages = openai_api.messages(body.get("messages"))
        chat = body
        think = openai_api.think(body.get("chat_template_kwargs"), spec.generation.think)
        stops = openai_api.stop(body.get("stop"))
        logprobs = openai_api.logprobs(body, spec.generation.logprobs)
        grammar = openai_api.structure(body)
    params, max_tokens = openai_api.sampling(chat, spec.generation, vocab=tok.vocab_size)
    row = replace(
        row,
        question=next((m["content"] for m in reversed(messages) if m["role"] == "user"), ""),
        params=params,
        max_tokens=max_tokens,
        think=think,
        stop_strings=stops,
        logprobs=logprobs,
        grammar=grammar,
    )
    # big-endian: the bytes of two prompts compare as their ids do (see _groups)
    ids = np.array(tok.chat_prompt_ids(messages, think=think), dtype=">u4")
    return row, ids


def _text_row(spec: JobSpec, tok: Tokenizer, row: Row, body: dict) -> tuple[Row, np.ndarray]:
    """A text completion's row: its prompt as it is (after BOS where the tokenizer adds one),
    or its token ids, checked against the vocabulary; no think block."""
    (prompt,) = openai_api.prompts(body.get("prompt"))
    params, max_tokens = openai_api.sampling(body, spec.generation, vocab=tok.vocab_size)
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_bos=tok.add_bos_token)
    else:
        ids = prompt
        if bad := [t for t in ids if not 0 <= t < tok.vocab_size]:
            raise BodyError(
                f"prompt token id {bad[0]} is out of range [0, {tok.vocab_size})", "prompt"
            )
    if not ids:
        raise BodyError("prompt has no tokens", "prompt")
    logprobs = openai_api.text_logprobs(body)
    row = replace(
        row,
        question=prompt if isinstance(prompt, str) else tok.decode(prompt, skip_special=True),
        params=params,
        max_tokens=max_tokens,
        think=False,
        stop_strings=openai_api.stop(body.get("stop")),
        logprobs=spec.generation.logprobs if logprobs is None else logprobs,
        grammar=openai_api.structure(body),
    )
    return row, np.array(ids, dtype=">u4")


# ---- lines sharing a prefix ------------------------------------------------------------------


@dataclass
class _Line:
    """A well-formed request line: its whole prompt, and its row (None when done already)."""

    number: int
    ids: np.ndarray  # [T] big-endian uint32
    row: Row | None


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _groups(lines: list[_Line], min_shared: int) -> Iterator[list[_Line]]:
    """Lines in prompt order, cut into runs where each prompt shares at least `min_shared`
    tokens with the one before it (a run of one: a prompt that shares with no other)."""
    lines = sorted(lines, key=lambda x: x.ids.tobytes())  # sorted, shared prefixes are adjacent
    group: list[_Line] = []
    for line in lines:
        if group and _common(group[-1].ids, line.ids) < min_shared:
            yield group
            group = []
        group.append(line)
    if group:
        yield group


def _shared(group: list[_Line]) -> int:
    """Tokens of the prefix a group's lines share: the common prefix of the first and last
    prompt (sorted, that is everyone's), leaving each line at least one token of its own, cut
    to a multiple of PREFIX_BLOCK so that a line added later (its question starting otherwise)
    most likely cuts at the same place and finds the stored prefix."""
    shared = min(_common(group[0].ids, group[-1].ids), min(len(x.ids) for x in group) - 1)
    return shared - shared % PREFIX_BLOCK


def _plans(group: list[_Line], path: Path) -> Iterator[DocPlan]:
    """One DocPlan for the lines to do of a group with a shared prefix, else one per line."""
    todo = sorted((x for x in group if x.row is not None), key=lambda x: x.number)
    shared = _shared(group) if len(group) > 1 else 0
    if not shared:
        for x in todo:
            yield DocPlan(x.row.doc, [replace(x.row, prompt=tuple(x.ids.tolist()))])
        return
    if not todo:
        return
    prefix = group[0].ids[:shared]
    first = sorted(x.number for x in group)[:4]
    numbers = ", ".join(map(str, first[:3])) + (", …" if len(first) > 3 else "")
    doc = Document(
        f"prefix of {len(group)} requests (lines {numbers})",
        str(path),
        "",
        hashlib.sha256(prefix.tobytes()).hexdigest(),
    )
    rows = [replace(x.row, prompt=tuple(x.ids[shared:].tolist())) for x in todo]
    yield DocPlan(doc, rows, doc_prompt=prefix.tolist())
