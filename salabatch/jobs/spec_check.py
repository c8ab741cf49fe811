"""What is wrong with a job, as `location: message` lines (`questions[2].text: field required`).

`format_validation_error` rewrites pydantic's errors for people (an unknown field gets the close
match and the allowed ones); `check_paths` reports what the job names but the disk lacks. A
`JobValidationError` carries every line at once: a job left running overnight should not stop
at 3 a.m. on a typo, nor on the second typo after the first is fixed.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from salabatch.errors import JobSpecError
from salabatch.jobs.documents import SUPPORTED_SUFFIXES, expand_sources
from salabatch.jobs.spec import CROSS_FIELD_ERROR, JobSpec, Loc, render_loc, show_value


class JobValidationError(JobSpecError):
    """Every mistake of a job file, one `location: message` line each, in `errors`.

    str(): `job.yaml: questions[2].text: field required` for one error, else
    `job.yaml: 3 errors` followed by the errors, one per indented line.
    """

    def __init__(self, path: str | Path, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        if len(self.errors) == 1:
            message = self.errors[0]
        else:
            message = f"{len(self.errors)} errors\n" + "\n".join(f"  {e}" for e in self.errors)
        super().__init__(message, path=path)


# ---- pydantic's errors, for people ---------------------------------------------------------------


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


def format_validation_error(
    error: ValidationError, *, note: Callable[[Loc], str] | None = None
) -> list[str]:
    """One `location: message` line per error of a JobSpec validation; `note(loc)` is appended
    (load_job adds the YAML line)."""
    lines = []
    for err in error.errors(include_url=False):
        if err["type"] == CROSS_FIELD_ERROR:
            items = err["ctx"]["problems"]
        else:
            items = [(tuple(err["loc"]), _message(err))]
        for loc, message in items:
            lines.append(f"{render_loc(loc)}: {message}{note(loc) if note else ''}")
    return lines


def _message(err: Any) -> str:
    kind, value = err["type"], err.get("input")
    if kind == "missing":
        return "field required"
    if kind == "extra_forbidden":
        return _unknown_field(tuple(err["loc"]))
    if kind == "job_spec":
        return err["msg"]
    text = _SHORT.get(kind)
    if text is None:
        text = err["msg"].removeprefix("Value error, ")
        text = f"must be {text[16:]}" if text.startswith("Input should be ") else text
    return f"{text}, got {show_value(value)}"


def _unknown_field(loc: Loc) -> str:
    model = _model_at(loc[:-1])
    if model is None:
        return "unknown field"
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f", did you mean {close[0]!r}?" if close else ""
    return f"unknown field{hint} (allowed: {', '.join(allowed)})"


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The model class validating the mapping at `loc` (list items step through)."""
    model: type[BaseModel] | None = JobSpec
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


# ---- what needs the disk -------------------------------------------------------------------------


def check_paths(spec: JobSpec) -> list[str]:
    """`location: message` lines for what the job names but the disk lacks: document paths and
    globs (as `iter_documents` would report them, every entry), the model folder, the requests
    file, an output path that is a folder. Empty when all is there."""
    return path_problems(spec)[0]


def path_problems(spec: JobSpec) -> tuple[list[str], int | None]:
    """(`check_paths(spec)`, number of distinct document files or None when the documents have
    problems)."""
    problems: list[str] = []
    if not spec.model_is_builtin:
        model = Path(spec.model)
        if not model.exists():
            problems.append(f"model: no such folder: {model}")
        elif not model.is_dir():
            problems.append(f"model: not a folder: {model} (expected a checkpoint folder)")
        elif not (model / "config.json").is_file():
            problems.append(f"model: no config.json in {model} (expected a checkpoint folder)")
    if spec.requests is not None and not spec.requests.is_file():
        kind = "a folder" if spec.requests.is_dir() else "no such file"
        problems.append(f"requests: {kind}: {spec.requests} (expected a .jsonl file)")
    if spec.output.path.is_dir():
        problems.append(f"output.path: is a folder: {spec.output.path} (expected a file path)")

    sources = spec.sources()
    try:
        files = expand_sources(sources)
    except JobSpecError:
        files = None
    if files is not None:
        for file in files:  # only a file named directly can have an unsupported type
            if file.path.suffix.lower() not in SUPPORTED_SUFFIXES:
                where = f"documents[{sources.index(file.source)}].path"
                supported = " ".join(SUPPORTED_SUFFIXES)
                kind = file.path.suffix or "(none)"
                problems.append(f"{where}: unsupported file type {kind} (supported: {supported})")
        return problems, len(files)
    # expand_sources stops at the first bad entry: expand each alone to report them all. It
    # names an entry by its place in the list it was given, so put back the real index.
    for index, source in enumerate(sources):
        try:
            expand_sources([source])
        except JobSpecError as e:
            where = (e.field or "documents[0].path").replace("documents[0]", f"documents[{index}]")
            shown = "" if e.path is None or e.path in e.message else f": {e.path}"
            problems.append(f"{where}: {e.message}{shown}")
    return problems, None
