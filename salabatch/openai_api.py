"""The OpenAI request body as salabatch reads it, for the Batch path
(`salabatch.jobs.run.openai_batch`) and the server (`salabatch.serve.app`) alike: which fields
are honoured, which are accepted because they cannot change the answer, and which are refused,
never silently ignored. Every check raises a BodyError naming its field.

    messages                  system, developer (rendered as system), user, assistant; text only
    max_completion_tokens     or max_tokens (max_completion_tokens wins)
    temperature, top_p, top_k (-1 or 0: off), min_p, seed
    presence_penalty, frequency_penalty (OpenAI's: subtracted from the logits), repetition_penalty
    logit_bias                {token id: bias in [-100, 100]} added to those tokens' logits
    stop                      a string or up to 4: the answer ends before the first one it holds
    chat_template_kwargs      {"enable_thinking": bool}: the request's think mode
    n                         answers sampled from one prompt (`choices`): the server's; a job's
                              results hold one answer per line, so there it must be 1
    logprobs, top_logprobs    each token's log-probability and its most likely alternatives'
                              (`logprobs`)
    response_format           text, json_object or json_schema: what the answer must be
                              (`structure`); vLLM's guided_json, guided_regex, guided_choice too

A text completion's body (`/v1/completions`, `TEXT_HONOURED`) has a `prompt` instead of
messages (`prompts`: a string or token ids, or a list of them), `logprobs` as an integer
(`text_logprobs`) and `echo` (the prompt before its answer), and no chat template. A Responses
body (`/v1/responses`, `RESPONSE_HONOURED`) is a chat completion's in other words: `instructions`
and `input` its messages (`response_messages`), `max_output_tokens`, `text.format` its
response_format (`response_structure`), `reasoning.effort` its think mode; `response_body` is
the response object of its answer. Unset sampling fields take the caller's defaults (a job's
`generation:`, the server's).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from salabatch.engine.sampling import TOP_LOGPROBS, SamplingParams, TokenLogprob
from salabatch.errors import SalabatchError, not_utf8
from salabatch.structure import ANY_OBJECT, choice_pattern, schema_pattern

if TYPE_CHECKING:
    from salabatch.engine.tokenizer import Tokenizer

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SAMPLING = (
    "max_completion_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logit_bias",
)
STRUCTURE = ("response_format", "guided_json", "guided_regex", "guided_choice")
HONOURED = (
    "messages",
    *SAMPLING,
    "stop",
    "chat_template_kwargs",
    "n",
    "logprobs",
    "top_logprobs",
    *STRUCTURE,
)
TEXT_HONOURED = ("prompt", *SAMPLING, "stop", "n", "logprobs", "echo", *STRUCTURE)
# Fields about billing, logging or delivery: they cannot change the answer.
ACCEPTED = (
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "stream_options",
    "parallel_tool_calls",
)
NO_OP = {"stream": False}  # accepted at this value
TEXT_NO_OP = {**NO_OP, "best_of": 1}
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_CHOICES = 128  # n, as OpenAI allows


class BodyError(SalabatchError):
    """A request body field that is malformed, or refused because salabatch cannot honour it.
    `param` names the field (OpenAI's error `param`); str() is the message, which names it too."""

    exit_code = 2

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class Defaults(Protocol):
    """What an unset sampling field takes: a job's `generation:` or the server's settings."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int


def check_fields(
    body: Mapping, honoured: tuple[str, ...], no_op: Mapping[str, object] = NO_OP
) -> None:
    """BodyError naming the fields of `body` that are neither honoured, accepted, nor at their
    no-op value (`no_op`); a field set to null counts as unset."""
    refused = [
        name
        for name, value in body.items()
        if value is not None
        and name not in honoured + ACCEPTED
        and not _same(value, no_op.get(name))
    ]
    if refused:
        fields = f"field{'s' * (len(refused) > 1)}: {', '.join(refused)}"
        raise BodyError(f"unsupported {fields} (refused rather than ignored)", refused[0])


def _same(value, no_op) -> bool:
    """Whether `value` is the no-op value itself (`true` is not `1`, `0` not `false`)."""
    return no_op is not None and type(value) is type(no_op) and value == no_op


def messages(raw) -> list[dict]:
    """The chat messages of a body as the chat template takes them ({"role", "content"})."""
    if not isinstance(raw, list) or not raw:
        raise BodyError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        at = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BodyError(f"{at}.role must be one of {', '.join(ROLES)}", f"{at}.role")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise BodyError(f"unsupported field: {at}.{extra[0]}", f"{at}.{extra[0]}")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise BodyError(f"{at}.content: only text parts are supported", f"{at}.content")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BodyError(f"{at}.content must be text", f"{at}.content")
        out.append({"role": ROLES[m["role"]], "content": text(content, f"{at}.content")})
    return out


def text(value: str, param: str) -> str:
    """`value`, where UTF-8 can hold it (JSON can carry a lone surrogate, `"\\ud800"`, that no
    tokenizer takes); else BodyError naming `param`."""
    if bad := not_utf8(value, from_bytes=False):
        raise BodyError(f"{param} is not text UTF-8 can hold ({bad})", param)
    return value


def sampling(
    body: Mapping, defaults: Defaults, least_tokens: int = 1, vocab: int | None = None
) -> tuple[SamplingParams, int]:
    """(sampling settings, max tokens) of a body, each field checked; unset ones are
    `defaults`'. `least_tokens`: the smallest max_tokens taken (0 where the prompt is only
    scored: a completion's `echo`); `vocab`: the tokenizer's size, which a `logit_bias` token
    must be under (None: unchecked here)."""

    def number(name: str, default, ok, expected: str, integer: bool = False):
        value = body.get(name)
        if value is None:
            return default
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not (numeric and _finite(value, integer) and ok(value)) or (
            integer and value != int(value)
        ):
            raise BodyError(f"{name} must be {expected}, got {_shown(value)}", name)
        return int(value) if integer else float(value)

    penalty = "a number in [-2, 2]"
    top_k = number("top_k", defaults.top_k, lambda v: v >= -1, "an integer ≥ -1 (-1: off)", True)
    at_least = (lambda v: v >= least_tokens, f"an integer ≥ {least_tokens}")
    max_tokens = number("max_tokens", defaults.max_tokens, *at_least, True)
    params = SamplingParams(
        temperature=number("temperature", defaults.temperature, lambda v: v >= 0, "a number ≥ 0"),
        top_p=number("top_p", defaults.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=max(top_k, 0),
        repetition_penalty=number(
            "repetition_penalty", defaults.repetition_penalty, lambda v: v > 0, "a number > 0"
        ),
        seed=number("seed", defaults.seed, lambda v: True, "an integer", True),
        min_p=number("min_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        presence_penalty=number("presence_penalty", 0.0, lambda v: abs(v) <= 2, penalty),
        frequency_penalty=number("frequency_penalty", 0.0, lambda v: abs(v) <= 2, penalty),
        logit_bias=logit_bias(body.get("logit_bias"), vocab),
    )
    for name in ("max_completion_tokens", "max_output_tokens"):  # chat's newer name, Responses'
        max_tokens = number(name, max_tokens, *at_least, True)
    return params, max_tokens


def logit_bias(value, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """A body's `logit_bias`, {token id (as JSON keys are, text): bias in [-100, 100]}, as
    (id, bias) pairs in id order; BodyError naming it otherwise, or for an id at or past
    `vocab`."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise BodyError("logit_bias must be an object of token id → bias", "logit_bias")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None or (vocab is not None and token >= vocab):
            bound = "" if vocab is None else f" under {vocab}"
            raise BodyError(f"logit_bias keys must be token ids{bound}, got {key!r}", "logit_bias")
        numeric = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not (numeric and -100 <= bias <= 100):
            raise BodyError(
                f"logit_bias values must be numbers in [-100, 100], got {bias!r}", "logit_bias"
            )
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def choices(body: Mapping, most: int, why: str = "") -> int:
    """The body's `n`: how many answers to sample from its prompt (1 where unset); BodyError
    past `most` (`why` says where that bound comes from) or MAX_CHOICES."""
    most = min(most, MAX_CHOICES)
    value = body.get("n")
    if value is None:
        return 1
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if not (numeric and _finite(value, True) and value == int(value) and 1 <= value <= most):
        expected = "1" if most == 1 else f"an integer in [1, {most}]"
        bound = f" ({why})" if why and most < MAX_CHOICES else ""
        raise BodyError(f"n must be {expected}{bound}, got {_shown(value)}", "n")
    return int(value)


def _finite(value: float, integer: bool) -> bool:
    """Whether a JSON number is finite: an integer is, where an integer is asked for; else it
    must be a finite float (JSON has integers of any length: one past float's range is not, and
    math.isfinite raises OverflowError on it)."""
    if integer and isinstance(value, int):
        return True
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _shown(value: object) -> str:
    """A value as an error shows it: its repr, a long one cut."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def logprobs(body: Mapping, default: int | None = None) -> int | None:
    """The body's `logprobs` and `top_logprobs`: None where no log-probabilities are asked for,
    else how many alternatives each token's come with (0 to TOP_LOGPROBS, 20); `default` where
    the body sets neither."""
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is None and top is None:
        return default
    if want is not None and not isinstance(want, bool):
        raise BodyError("logprobs must be true or false", "logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= TOP_LOGPROBS
    ):
        raise BodyError(
            f"top_logprobs must be an integer in [0, {TOP_LOGPROBS}], got {top!r}", "top_logprobs"
        )
    if not want:
        if top:
            raise BodyError("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def text_logprobs(body: Mapping) -> int | None:
    """A text completion's `logprobs` (an integer, OpenAI's legacy field): None where unset,
    else how many alternatives each token's log-probability comes with (0 to TOP_LOGPROBS)."""
    k = body.get("logprobs")
    if k is not None and (
        isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= TOP_LOGPROBS
    ):
        raise BodyError(
            f"logprobs must be an integer in [0, {TOP_LOGPROBS}], got {k!r}", "logprobs"
        )
    return k


def prompts(value) -> list[str | list[int]]:
    """A text completion's `prompt`: a string, a list of token ids, or a list of either (an
    answer, or `n`, to each); BodyError naming it otherwise, or a string UTF-8 cannot hold."""
    if isinstance(value, str) or _token_ids(value):
        value = [value]
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(p, str) or _token_ids(p) for p in value)
    ):
        raise BodyError(
            "prompt must be a string, a list of token ids, or a non-empty list of either",
            "prompt",
        )
    for i, p in enumerate(value):
        if isinstance(p, str):
            text(p, "prompt" if len(value) == 1 else f"prompt[{i}]")
    return value


def _token_ids(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def echo(body: Mapping) -> bool:
    """A text completion's `echo`: whether its prompt comes back before its answer."""
    value = body.get("echo")
    if value is not None and not isinstance(value, bool):
        raise BodyError("echo must be true or false", "echo")
    return bool(value)


def structure_field(body: Mapping) -> str:
    """The field `structure` reads (the first given of STRUCTURE; response_format where none
    is), for an error about its pattern."""
    return next((name for name in STRUCTURE if body.get(name) is not None), "response_format")


def structure(body: Mapping) -> str | None:
    """The regular expression the answer must match whole, of the body's `response_format`
    (`json_object`: any JSON object; `json_schema`: JSON its `schema` validates; `text`: none)
    or of vLLM's `guided_json` (a schema), `guided_regex` or `guided_choice` (one of a list of
    strings); None where the answer is free. At most one of them."""
    given = [name for name in STRUCTURE if body.get(name) is not None]
    if len(given) > 1:
        raise BodyError(f"give one of {', '.join(given)}, not both", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise BodyError("guided_regex must be a non-empty string", name)
        return value
    if name == "guided_choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise BodyError("guided_choice must be a non-empty list of non-empty strings", name)
        return choice_pattern(value)
    if name == "guided_json":
        return _schema_regex(json_object(value, name), name)
    if not isinstance(value, dict):
        raise BodyError("response_format must be an object", name)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema_regex(ANY_OBJECT, name)
    if kind != "json_schema":
        raise BodyError(
            "response_format.type must be text, json_object or json_schema", f"{name}.type"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise BodyError(
            "response_format.json_schema.schema must be an object", f"{name}.json_schema.schema"
        )
    return _schema_regex(spec["schema"], f"{name}.json_schema.schema")


def json_object(value, param: str) -> dict:
    """`value`, a JSON object given as one or as its text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BodyError(f"{param} is not valid JSON ({e.msg})", param) from None
    if not isinstance(value, dict):
        raise BodyError(f"{param} must be a JSON schema object", param)
    return value


def _schema_regex(schema: dict, param: str) -> str:
    try:
        return schema_pattern(schema)
    except ValueError as e:
        raise BodyError(f"{param}: {e}", param) from None


def logprob_entry(tok: Tokenizer, lp: TokenLogprob) -> dict:
    """OpenAI's entry of a token in `logprobs.content`: its text, log-probability and bytes (a
    piece of a multi-byte character shows as U+FFFD in the text, its bytes as they are), and
    its `top_logprobs` alternatives the same way."""

    def entry(token: int, logprob: float) -> dict:
        raw = tok.token_bytes(token)
        return {"token": raw.decode(errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}


def stop(raw) -> tuple[str, ...]:
    """The stop strings of a body's `stop` (a string or a list of at most MAX_STOP)."""
    stops = [raw] if isinstance(raw, str) else [] if raw is None else raw
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise BodyError(f"stop must be a non-empty string or a list of at most {MAX_STOP}", "stop")
    return tuple(text(s, "stop") for s in stops)


def think(kwargs, default: bool) -> bool:
    """The think mode of a body's `chat_template_kwargs` (`default` where it says none)."""
    if kwargs is None:
        return default
    if not isinstance(kwargs, dict):
        raise BodyError("chat_template_kwargs must be an object", "chat_template_kwargs")
    unknown = sorted(k for k in kwargs if k != "enable_thinking")
    if unknown:
        raise BodyError(
            f"unsupported field: chat_template_kwargs.{unknown[0]}",
            f"chat_template_kwargs.{unknown[0]}",
        )
    value = kwargs.get("enable_thinking", default)
    if not isinstance(value, bool):
        raise BodyError(
            "chat_template_kwargs.enable_thinking must be true or false",
            "chat_template_kwargs.enable_thinking",
        )
    return value


# ---- the Responses API (`/v1/responses`: the server's endpoint, Batch lines) -----------------

# A Responses body's fields that decide the answer (the caller adds its own: the server's
# `stream`, `store`, `previous_response_id`)
RESPONSE_HONOURED = (
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "text",
    "reasoning",
)
RESPONSE_NO_OP = {
    **NO_OP,
    "truncation": "disabled",
    "tools": [],
    "include": [],
    "background": False,
}
PART_TYPES = ("input_text", "output_text", "text")  # the text parts of a Responses message


def response_messages(body: Mapping) -> list[dict]:
    """The chat messages of a Responses body: `instructions` as the system message, then
    `input` (`input_messages`)."""
    instructions = body.get("instructions")
    system = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BodyError("instructions must be a string", "instructions")
        system = [{"role": "system", "content": text(instructions, "instructions")}]
    return [*system, *input_messages(body.get("input"))]


def response_sampling_fields(body: Mapping) -> dict:
    """A Responses body's sampling fields (`max_output_tokens` included), for the caller's
    `sampling` (with its defaults)."""
    fields = (*SAMPLING, "max_output_tokens")
    return {k: body[k] for k in fields if k in body and k in RESPONSE_HONOURED}


def input_messages(raw) -> list[dict]:
    """The chat messages of a Responses `input`: a string (one user message) or a list of
    messages ({"role", "content"}, optionally "type": "message"; content a string or text
    parts: input_text, output_text, text). BodyError naming the item otherwise."""
    if isinstance(raw, str):
        return [{"role": "user", "content": text(raw, "input")}]
    if not isinstance(raw, list) or not raw:
        raise BodyError("input must be a string or a non-empty list of messages", "input")
    out = []
    for i, item in enumerate(raw):
        at = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise BodyError(f"{at}: only messages are supported, not {kind!r}", at)
        given = (k for k, v in item.items() if v is not None)  # null: unset (the SDK's dumps)
        extra = sorted(k for k in given if k not in ("type", "role", "content", "id", "status"))
        if extra:
            raise BodyError(f"unsupported field: {at}.{extra[0]}", f"{at}.{extra[0]}")
        role = item.get("role")
        if role not in ROLES:
            roles = ", ".join(ROLES)
            raise BodyError(f"{at}.role must be one of {roles}", f"{at}.role")
        content = item.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                where = f"{at}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
                    raise BodyError(f"{where}: only text parts are supported", where)
                if not isinstance(part.get("text"), str):
                    raise BodyError(f"{where}.text must be a string", f"{where}.text")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise BodyError(f"{at}.content must be text", f"{at}.content")
        out.append({"role": ROLES[role], "content": text(content, f"{at}.content")})
    return out


def response_structure(text) -> str | None:
    """The pattern the answer must match (`structure`) of a Responses `text`
    ({"format": ...}: json_object, json_schema or text); a bad one a BodyError naming its
    field under text.format."""
    try:
        return structure(_response_format(text))
    except BodyError as e:

        def renamed(name: str) -> str:
            return name.replace("response_format.json_schema", "text.format").replace(
                "response_format", "text.format"
            )

        raise BodyError(renamed(str(e)), renamed(e.param or "text.format")) from None


def _response_format(setting) -> dict:
    """A body with the `response_format` of a Responses `text`: json_object, json_schema (its
    schema, name and strict at the top of the format, as Responses puts them) or text."""
    if setting is None:
        return {}
    if not isinstance(setting, dict) or set(setting) - {"format", "verbosity"}:
        raise BodyError("text must be an object with a format", "text")
    if setting.get("verbosity") not in (None, "medium"):  # medium: OpenAI's default, no change
        raise BodyError("text.verbosity cannot be honoured (only medium)", "text.verbosity")
    fmt = setting.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise BodyError("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        fields = ("type", "name", "schema", "strict", "description")
        if unknown := sorted(k for k in fmt if k not in fields):
            raise BodyError(
                f"unsupported field: text.format.{unknown[0]}", f"text.format.{unknown[0]}"
            )
        for key in ("name", "description"):  # echoed in the response: UTF-8 must hold them
            if isinstance(fmt.get(key), str):
                text(fmt[key], f"text.format.{key}")
        schema = {k: fmt[k] for k in fields[1:] if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    return {"response_format": fmt}


def response_think(reasoning, default: bool) -> bool:
    """Whether to think: `reasoning.effort` other than "none" (`default` where unset)."""
    if reasoning is None:
        return default
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"}:
        raise BodyError("reasoning must be an object with effort", "reasoning")
    if reasoning.get("summary") is not None:  # the think block is the reasoning item, whole
        raise BodyError("reasoning.summary cannot be honoured: no summaries", "reasoning.summary")
    effort = reasoning.get("effort")
    if effort is None:
        return default
    if effort not in ("none", "minimal", "low", "medium", "high"):
        efforts = "none, minimal, low, medium or high"
        raise BodyError(f"reasoning.effort must be {efforts}", "reasoning.effort")
    return effort != "none"


def response_metadata(raw) -> dict:
    """A body's `metadata`, echoed in its response: at most 16 strings, keys of at most 64
    characters and values of at most 512 (OpenAI's rule)."""
    if raw is None:
        return {}
    if not (
        isinstance(raw, dict)
        and len(raw) <= 16
        and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in raw.items()
        )
    ):
        raise BodyError(
            "metadata must be an object of at most 16 strings, keys of at most 64 characters "
            "and values of at most 512",
            "metadata",
        )
    for key, value in raw.items():
        text(key, "metadata")
        text(value, "metadata")
    return raw


def flag(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BodyError(f"{name} must be true or false", name)
    return value


def item_id(response_id: str, kind: str) -> str:
    """An output item's id: its kind ("msg", "rs") and the response's own hex."""
    return f"{kind}_{response_id.removeprefix('resp_')}"


def message_item(response_id: str, content: str, status: str) -> dict:
    return {
        "type": "message",
        "id": item_id(response_id, "msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": content, "annotations": []}],
    }


def input_item(response_id: str, index: int, message: Mapping) -> dict:
    """Message `index` of a response's input as an item of its `input_items`: a user, system or
    developer message with input_text, an assistant one as an output message."""
    assistant = message["role"] == "assistant"
    part = {"type": "output_text" if assistant else "input_text", "text": message["content"]}
    return {
        "type": "message",
        "id": f"{item_id(response_id, 'msg')}_{index}",
        "status": "completed",
        "role": message["role"],
        "content": [part | {"annotations": []} if assistant else part],
    }


def reasoning_item(response_id: str, reasoning: str, status: str) -> dict:
    return {
        "type": "reasoning",
        "id": item_id(response_id, "rs"),
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": reasoning}] if reasoning else [],
    }


def response_body(
    echoed: Mapping,
    *,
    content: str,
    reasoning: str | None,
    reasoning_tokens: int,
    finish_reason: str,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    completed_at: int,
) -> dict:
    """A finished response object: `echoed`, what it repeats of its request (its id, created_at,
    model, settings), then its status (`incomplete` where the answer ran out of tokens), its
    output (a reasoning item where there is reasoning, then the message) and usage. The
    cached tokens are those resumed from a held prefix; what a request leaves held is not
    counted (`cache_write_tokens` 0: nothing here is billed)."""
    complete = finish_reason == "stop"
    response_id = echoed["id"]
    output = [reasoning_item(response_id, reasoning, "completed")] if reasoning else []
    output.append(message_item(response_id, content, "completed"))
    return {
        **echoed,
        "status": "completed" if complete else "incomplete",
        "incomplete_details": None if complete else {"reason": "max_output_tokens"},
        "completed_at": completed_at if complete else None,
        "output": output,
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def response_shell(response_id: str, created_at: int, model: str) -> dict:
    """What every response object holds before its request's settings: its id, kind, time,
    model, and no tools."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "truncation": "disabled",
        "error": None,
    }


def response_echo(
    body: Mapping, params: SamplingParams, response_id: str, created_at: int, model: str
) -> dict:
    """What a response repeats of its request (`response_body`'s `echoed`): `response_shell`
    and the settings its request took (`params`: unset fields at their defaults)."""
    return response_shell(response_id, created_at, model) | {
        "truncation": body.get("truncation") or "disabled",
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "store": flag(body, "store", True),
        "background": flag(body, "background", False),
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning"),
        "metadata": response_metadata(body.get("metadata")),
    }
