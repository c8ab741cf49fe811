"""The job file's models: pydantic, `extra="forbid"`, frozen; they never touch the disk.

Build a JobSpec with `salabatch.jobs.spec_load.load_job` (YAML, `--set` overrides, errors with
line numbers), or with `JobSpec.model_validate(data, context={"base_dir": folder})`: paths are
resolved there (relative to the job file's folder, `~` expanded). Cross-field mistakes (nothing
to do, a question id used twice) are reported together, each at its own location.

Numbers and booleans are strict: YAML already types them, so `batch_size: "4"` or `think: 1` is
a mistake worth reporting, not something to coerce.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from salabatch.files import cache_dir
from salabatch.jobs.documents import DocumentSource

BUILTIN_MODELS = ("tiny",)  # `model: builtin:tiny`, the bundled demo model

# Job names and question ids name files and Parquet columns: keep them portable.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_SAFE_TEXT = "1 to 100 letters, digits, _ . - (not starting with . or -)"

Loc = tuple[int | str, ...]  # a pydantic location: ("questions", 2, "text")


def render_loc(loc: Loc) -> str:
    """A location as users write it: `("questions", 2, "text")` -> `questions[2].text`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def slug(text: str) -> str:
    """`text` with every run of characters a name cannot hold turned into `-`, ends trimmed."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")


def _fail(message: str) -> PydanticCustomError:
    # The message goes through the context: pydantic formats `{...}` in templates, and a
    # user's value may contain braces.
    return PydanticCustomError("job_spec", "{message}", {"message": message})


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


def _resolve(value: object, info: ValidationInfo) -> str:
    """A path from the job file: `~` expanded, relative to the job file's folder (the validation
    context's `base_dir`, else the current directory). Glob characters are kept as they are."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str):
        raise _fail(f"expected a path, got {show_value(value)}")
    if not value.strip():
        raise _fail("must not be empty")
    base = (info.context or {}).get("base_dir") or os.getcwd()
    # A string, not a Path: JSON-mode validation (`model_validate_json`) takes only strings.
    return os.path.abspath(os.path.join(base, os.path.expanduser(value)))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- the models, from the leaves up ------------------------------------------------------------


class DocumentEntry(_Strict):
    """One `documents:` entry: a file, a folder (with an optional `glob`) or a glob pattern.

    Existence is not checked here (see `spec_check.check_paths`): a spec loads on any machine.
    """

    path: Path
    glob: str | None = None  # for a folder: a pattern relative to it, e.g. "**/*.pdf"
    text_field: str = Field("text", min_length=1)  # .jsonl records: where the text is
    id_field: str = Field("id", min_length=1)  # .jsonl records: where the id is

    @field_validator("path", mode="before")
    @classmethod
    def _resolve_path(cls, value: object, info: ValidationInfo) -> str:
        return _resolve(value, info)

    @field_validator("glob")
    @classmethod
    def _check_glob(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise _fail("must not be empty (leave glob out to read every supported file)")
        if value.startswith(("/", "~")):
            raise _fail(f"must be relative to the folder in path, got {show_value(value)}")
        path = info.data.get("path")
        if path is not None and globlib.has_magic(str(path)):
            raise _fail("path is already a glob pattern: put the whole pattern in path")
        return value

    def to_source(self) -> DocumentSource:
        """The entry as `salabatch.jobs.documents` reads it."""
        return DocumentSource(self.path, self.glob, self.text_field, self.id_field)


class Question(_Strict):
    """A question asked of every document. `id` names its answers (`q<position>` when left out);
    `max_tokens` and `think` override the job's `generation:` for this question only."""

    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

    id: str
    text: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    think: StrictBool | None = None

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        if not _SAFE_NAME.fullmatch(value):
            raise _fail(
                f"must be {_SAFE_TEXT}; it names columns and files, got {show_value(value)}"
            )
        return value

    @field_validator("text")
    @classmethod
    def _check_text(cls, value: str) -> str:
        # A YAML block scalar (`text: |`) ends with a newline the user did not mean to send.
        if not value.strip():
            raise _fail("must not be empty")
        return value.strip()


class Generation(_Strict):
    """Sampling settings of every question (greedy by default)."""

    max_tokens: StrictInt = Field(512, ge=1)
    temperature: StrictFloat = Field(0.0, ge=0, allow_inf_nan=False)  # 0: greedy
    top_p: StrictFloat = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0)  # 0: off
    repetition_penalty: StrictFloat = Field(1.0, gt=0, allow_inf_nan=False)  # 1: off
    seed: StrictInt = Field(0, ge=0)
    think: StrictBool = False  # MiniCPM's thinking mode in the chat template


class Engine(_Strict):
    """How the model runs; none of this changes an answer except `dtype` and `on_overflow`."""

    prefill_chunk: StrictInt = Field(2048, ge=16)  # tokens per prefill step
    batch_size: StrictInt = Field(8, ge=1)  # questions of a document decoded together
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_context: StrictInt = Field(1_048_576, ge=1)  # document + question tokens
    # A document over max_context: fail its rows (the message gives its token count), or keep
    # its start and end, or its start.
    on_overflow: Literal["error", "truncate_middle", "truncate_end"] = "error"


class CacheSettings(_Strict):
    """The on-disk store of prefilled documents (prefix caches)."""

    dir: Path = Field(default_factory=cache_dir, validate_default=True)  # as `salabatch cache`
    max_gb: StrictFloat = Field(50.0, gt=0, allow_inf_nan=False)
    enabled: StrictBool = True
    # Tokens between resumable snapshots of a long prefill (0: off). At ~200 tok/s, a Mac's
    # 9B prefill speed, a kill loses at most ~3 minutes of prefill.
    snapshot_every: StrictInt = Field(32768, ge=0)

    @field_validator("dir", mode="before")
    @classmethod
    def _resolve_dir(cls, value: object, info: ValidationInfo) -> str:
        return _resolve(value, info)


class OutputSettings(_Strict):
    """Where the results go; `path` defaults to `results/<name>.parquet` beside the job file."""

    path: Path

    @field_validator("path", mode="before")
    @classmethod
    def _resolve_path(cls, value: object, info: ValidationInfo) -> str:
        return _resolve(value, info)


class JobSpec(_Strict):
    """A whole job file. Build it with `spec_load.load_job`, or with
    `JobSpec.model_validate(data, context={"base_dir": folder})` to resolve relative paths."""

    name: str
    model: str  # a checkpoint folder (resolved) or "builtin:NAME" (kept as is)
    documents: list[DocumentEntry] = Field(default_factory=list)
    questions: list[Question] = Field(default_factory=list)
    requests: Path | None = None  # an OpenAI batch .jsonl of chat requests
    system: str | None = None  # system prompt of the document questions
    generation: Generation = Field(default_factory=Generation)
    engine: Engine = Field(default_factory=Engine)
    cache: CacheSettings
    output: OutputSettings

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        return with_defaults(data)

    @field_validator("name", mode="before")
    @classmethod
    def _number_name(cls, value: object) -> object:
        # `name: 2024` is a fine name; YAML reads it as a number.
        return _number_as_text(value)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _SAFE_NAME.fullmatch(value):
            suggestion = slug(value)[:100]
            hint = f"; try {suggestion!r}" if suggestion else ""
            raise _fail(f"must be {_SAFE_TEXT}, got {show_value(value)}{hint}")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, (str, Path)):
            return value  # pydantic says "expected a string"
        if isinstance(value, str) and value.startswith("builtin:"):
            if value.removeprefix("builtin:") not in BUILTIN_MODELS:
                known = ", ".join(f"builtin:{m}" for m in BUILTIN_MODELS)
                raise _fail(f"unknown builtin model {value!r} (available: {known})")
            return value
        return _resolve(value, info)

    @field_validator("requests", mode="before")
    @classmethod
    def _resolve_requests(cls, value: object, info: ValidationInfo) -> str | None:
        return None if value is None else _resolve(value, info)

    @field_validator("system")
    @classmethod
    def _check_system(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise _fail("must not be empty (leave system out for no system prompt)")
        return value

    @model_validator(mode="after")
    def _check_job(self) -> JobSpec:
        problems = job_problems(
            bool(self.documents),
            bool(self.questions),
            self.requests is not None,
            [(i, q.id) for i, q in enumerate(self.questions)],
        )
        if problems:
            # One error carrying every problem, each with its own location.
            text = "; ".join(f"{render_loc(loc)}: {msg}" for loc, msg in problems)
            raise PydanticCustomError(
                CROSS_FIELD_ERROR, "{message}", {"message": text, "problems": problems}
            )
        return self

    @property
    def model_is_builtin(self) -> bool:
        return self.model.startswith("builtin:")

    def sources(self) -> list[DocumentSource]:
        """The `documents:` entries for `salabatch.jobs.documents.iter_documents`."""
        return [entry.to_source() for entry in self.documents]


def with_defaults(data: Any) -> Any:
    """Defaults that depend on the job file: question ids, sections whose paths resolve against
    the job's folder, the output path named after the job."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    questions = data.get("questions")
    if isinstance(questions, list):
        data["questions"] = [
            {**q, "id": f"q{n}"} if isinstance(q, dict) and q.get("id") is None else q
            for n, q in enumerate(questions, 1)
        ]
    if "cache" not in data:
        data["cache"] = {}
    output = data.get("output", {})
    if isinstance(output, dict) and "path" not in output:
        name = _number_as_text(data.get("name"))
        # A bad or missing name is reported on its own; the placeholder is never used.
        stem = name if isinstance(name, str) and _SAFE_NAME.fullmatch(name) else "job"
        data["output"] = {**output, "path": f"results/{stem}.parquet"}
    return data


def _number_as_text(value: object) -> object:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# The pydantic error type of the one error carrying every cross-field problem.
CROSS_FIELD_ERROR = "job_spec_problems"


def job_problems(
    has_documents: bool,
    has_questions: bool,
    has_requests: bool,
    question_ids: list[tuple[int, object]],
) -> list[tuple[Loc, str]]:
    """Mistakes across fields: nothing to do, documents without questions (or the reverse),
    a question id used twice."""
    problems: list[tuple[Loc, str]] = []
    if not (has_documents or has_questions or has_requests):
        problems.append(
            (("documents",), "nothing to do: give documents and questions, or requests")
        )
    elif has_documents and not has_questions:
        problems.append((("questions",), "field required: documents need questions to ask"))
    elif has_questions and not has_documents:
        problems.append((("documents",), "field required: questions need documents to ask"))
    first: dict[object, int] = {}
    for index, qid in question_ids:
        if qid not in first:
            first[qid] = index
            continue
        auto = (
            "; a question without an id is q<position>" if re.fullmatch(r"q\d+", str(qid)) else ""
        )
        message = f"duplicate id {qid!r} (also questions[{first[qid]}].id){auto}"
        problems.append((("questions", index, "id"), message))
    return problems


# ---- fingerprint and per-question settings -----------------------------------------------------


def spec_json(spec: JobSpec) -> str:
    """The spec as canonical JSON (sorted keys, resolved paths): for file metadata."""
    return json.dumps(
        spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def spec_fingerprint(spec: JobSpec) -> str:
    """sha256 (hex) of `spec_json(spec)`. Any change, paths and engine settings included,
    changes it; row-level resume keys should use `generation_key` instead."""
    return hashlib.sha256(spec_json(spec).encode("utf-8")).hexdigest()


def effective_generation(spec: JobSpec, question: Question) -> Generation:
    """The job's `generation:` with the question's own overrides applied."""
    update = {
        key: value
        for key, value in (("max_tokens", question.max_tokens), ("think", question.think))
        if value is not None
    }
    return spec.generation.model_copy(update=update)


def generation_key(spec: JobSpec, question: Question) -> dict[str, Any]:
    """The effective generation settings of one question, as plain JSON values."""
    return effective_generation(spec, question).model_dump(mode="json")
