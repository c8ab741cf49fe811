"""Validation errors of a job, for people: one `location: message` line each.

A location is written as users write it (`questions[2].text`, `render_loc`), a value as they wrote
it in YAML (`show_value`). The job's own checks raise `job_error(message)`: a pydantic error of
type `JOB_ERROR` whose text is the message as written. `error_lines` turns a ValidationError into
lines: pydantic's types get a short wording, an unknown field gets its close match and the
allowed names.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

Loc = tuple[int | str, ...]  # a pydantic location: ("questions", 2, "text")


def render_loc(loc: Loc) -> str:
    """A location as users write it: `("questions", 2, "text")` -> `questions[2].text`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def show_value(value: object) -> str:
    """A value as the user wrote it in YAML, short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


# The pydantic error type of every mistake the job's own checks find.
JOB_ERROR = "job_spec"


def job_error(message: str) -> PydanticCustomError:
    # The message goes through the context: pydantic formats `{...}` in templates, and a
    # user's value may contain braces.
    return PydanticCustomError(JOB_ERROR, "{message}", {"message": message})


def raised_again(err: ErrorDetails) -> InitErrorDetails:
    """A pydantic error as `ValidationError.from_exception_data` takes it, to raise it again
    beside more: pydantic's own types go by name, the job's own need their message."""
    kind = job_error(err["msg"]) if err["type"] == JOB_ERROR else err["type"]
    again: InitErrorDetails = {"type": kind, "loc": err["loc"], "input": err["input"]}
    if "ctx" in err:
        again["ctx"] = err["ctx"]
    return again


_SHORT = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected a whole number",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "finite_number": "expected a finite number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "dict_type": "expected a mapping",
}


def error_lines(
    error: ValidationError, root: type[BaseModel], *, note: Callable[[Loc], str] | None = None
) -> list[str]:
    """One `location: message` line per error of a validation by `root` (an unknown field gets the
    close match and the allowed ones); `note(loc)` is appended (load_job adds the YAML line)."""
    lines = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "invalid_key":  # a key YAML read as a number: no field is one
            loc = (*loc[:-1], str(loc[-1]))
            err = {**err, "type": "extra_forbidden", "loc": loc}
        lines.append(f"{render_loc(loc)}: {_message(err, root)}{note(loc) if note else ''}")
    return lines


def _message(err: ErrorDetails, root: type[BaseModel]) -> str:
    kind, value = err["type"], err.get("input")
    if kind == "missing":
        return "field required"
    if kind == "extra_forbidden":
        return _unknown_field(tuple(err["loc"]), root)
    if kind == JOB_ERROR:
        return err["msg"]
    text = _SHORT.get(kind)
    if text is None:
        text = err["msg"].removeprefix("Value error, ")
        text = f"must be {text[16:]}" if text.startswith("Input should be ") else text
    return f"{text}, got {show_value(value)}"


def _unknown_field(loc: Loc, root: type[BaseModel]) -> str:
    model = _model_at(loc[:-1], root)
    if model is None:
        return "unknown field"
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f", did you mean {close[0]!r}?" if close else ""
    return f"unknown field{hint} (allowed: {', '.join(allowed)})"


def _model_at(loc: Loc, root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class validating the mapping at `loc` under `root` (list items step through)."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model else None
        model = _submodel(field.annotation) if field else None
    return model


def _submodel(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _submodel(arg))), None)
