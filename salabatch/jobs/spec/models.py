"""The job file's pydantic models: what a valid job is, and what identifies it and its answers.

`JobSpec.model_validate(data, context={"base_dir": folder})` validates parsed job data: paths
resolve against the job file's folder (`~` expanded), and every mistake is reported at once,
each at its location, fields and checks across fields alike (`load.load_job` adds the YAML
lines). The models never touch the disk, so a spec loads on any machine; `load.check_paths`
reports what the job names but the disk lacks.

Numbers and booleans are strict: YAML already types them, so `batch_size: "4"` or `think: 1` is
a mistake worth reporting, not something to coerce.

A job is identified by its canonical JSON (`spec_json`, the results file's metadata) and a
question's answers by its effective generation settings (`generation_key`, part of every row's
key).
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
    ModelWrapValidatorHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from salabatch.errors import ConfigError, not_utf8
from salabatch.files import cache_dir
from salabatch.jobs.ingest.documents import DocumentSource
from salabatch.jobs.results.export import is_batch_output
from salabatch.jobs.results.read import parts_dir_of
from salabatch.jobs.spec.errors import Loc, job_error, raised_again, show_value
from salabatch.models import builtin_name, hub_repo, is_builtin
from salabatch.structure import choice_pattern, schema_pattern

# Job names and question ids name files and Parquet columns: keep them portable.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_SAFE_TEXT = "1 to 100 letters, digits, _ . - (not starting with . or -)"
_MAX_TOKENS = 512  # generation.max_tokens by default
_CONTEXT = 1_048_576  # engine.max_context by default: the model's own context


def slug(text: str) -> str:
    """`text` with every run of characters a name cannot hold turned into `-`, ends trimmed."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")


def _resolve(value: object, info: ValidationInfo) -> str:
    """A path from the job file: `~` expanded, relative to the job file's folder (the validation
    context's `base_dir`, else the current directory). Glob characters are kept as they are."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str):
        raise job_error(f"expected a path, got {show_value(value)}")
    if not value.strip():
        raise job_error("must not be empty")
    if "\0" in value:
        raise job_error(f"must not contain a NUL byte, got {show_value(value)}")
    if bad := not_utf8(value):
        # the spec is stored as UTF-8 JSON in the results; a name from the command line may
        # hold any bytes
        raise job_error(f"is not valid UTF-8 ({bad}); rename it, or match it with a glob")
    base = (info.context or {}).get("base_dir") or os.getcwd()
    # A string, not a Path: JSON-mode validation (`model_validate_json`) takes only strings.
    return os.path.abspath(os.path.join(base, os.path.expanduser(value)))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- the models, from the leaves up ------------------------------------------------------------


class DocumentEntry(_Strict):
    """One `documents:` entry: a file, a folder (with an optional `glob`) or a glob pattern.

    Existence is not checked here (see `check_paths`): a spec loads on any machine.
    """

    path: Path
    glob: str | None = None  # for a folder: a pattern relative to it, e.g. "**/*.pdf"
    text_field: str = Field("text", min_length=1)  # .jsonl records: where the text is
    id_field: str = Field("id", min_length=1)  # .jsonl records: where the id is
    # Read every file of the entry so, whatever its suffix (none included); default: by suffix.
    format: Literal["text", "pdf", "jsonl"] | None = None

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
            raise job_error("must not be empty (leave glob out to read every supported file)")
        if value.startswith(("/", "~")):
            raise job_error(f"must be relative to the folder in path, got {show_value(value)}")
        path = info.data.get("path")
        # a folder named with glob characters (`Contracts [2023]`) is a folder
        if path is not None and globlib.has_magic(str(path)) and not os.path.isdir(path):
            raise job_error("path is already a glob pattern: put the whole pattern in path")
        return value

    def to_source(
        self, max_tokens: int | None = None, skip: tuple[Path, ...] = ()
    ) -> DocumentSource:
        """The entry as `salabatch.jobs.ingest.documents` reads it; `max_tokens`, the job's
        max_context, limits the bytes of a document; `skip`: the job's own files."""
        return DocumentSource(
            self.path, self.glob, self.text_field, self.id_field, self.format, max_tokens, skip
        )


class Question(_Strict):
    """A question asked of every document. `id` names its answers (`q<position>` when left out);
    `max_tokens` and `think` override the job's `generation:` for this question only;
    `json_schema` (JSON it validates) or `choices` (one of these strings) is what its answers
    must be (`pattern`, `salabatch.structure`); choices are scored by their likelihood where
    the question does not think (`salabatch.engine.choose`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

    id: str
    text: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    think: StrictBool | None = None
    json_schema: dict[str, Any] | None = None
    choices: list[StrictStr] | None = Field(None, min_length=1)

    @field_validator("json_schema")
    @classmethod
    def _check_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                schema_pattern(value)
            except ValueError as e:
                raise job_error(str(e)) from None
        return value

    @field_validator("choices")
    @classmethod
    def _check_choices(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is not None and info.data.get("json_schema") is not None:
            raise job_error("give json_schema or choices, not both")
        if value is not None and not all(value):
            raise job_error("must not hold an empty string")
        if value is not None and (twice := [c for c in dict.fromkeys(value) if value.count(c) > 1]):
            raise job_error(f"holds {show_value(twice[0])} more than once")
        return value

    def pattern(self) -> str | None:
        """The regular expression its answers must match whole; None: any text."""
        if self.json_schema is not None:
            return schema_pattern(self.json_schema)
        return None if self.choices is None else choice_pattern(self.choices)

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        if not _SAFE_NAME.fullmatch(value):
            raise job_error(
                f"must be {_SAFE_TEXT}; it names columns and files, got {show_value(value)}"
            )
        return value

    @field_validator("text")
    @classmethod
    def _check_text(cls, value: str) -> str:
        # A YAML block scalar (`text: |`) ends with a newline the user did not mean to send.
        if not value.strip():
            raise job_error("must not be empty")
        return value.strip()


class GenerationSettings(_Strict):
    """Sampling settings of every question (greedy by default): the job's `generation:`."""

    max_tokens: StrictInt = Field(_MAX_TOKENS, ge=1)
    temperature: StrictFloat = Field(0.0, ge=0, allow_inf_nan=False)  # 0: greedy
    top_p: StrictFloat = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0)  # 0: off
    repetition_penalty: StrictFloat = Field(1.0, gt=0, allow_inf_nan=False)  # 1: off
    seed: StrictInt = 0  # any integer, as a request line's and `generate --seed` take
    think: StrictBool = False  # MiniCPM's thinking mode in the chat template
    # None: none; k: each answer token's log-probability and its k most likely alternatives'
    # (the results' `logprobs` column); a request line's own `logprobs` wins
    logprobs: StrictInt | None = Field(None, ge=0, le=20)

    def key(self) -> dict[str, Any]:
        """The settings as plain JSON values, for row keys: `logprobs` only where set, so the
        keys of a job that asks for none are those of the salabatch before it."""
        return self.model_dump(mode="json", exclude_none=True)


class Speculative(_Strict):
    """Speculative decoding, the job's `engine.speculative` (see
    `salabatch.engine.speculative.Speculation`): a greedy answer is the same with it or without
    it, so it is in no row's key and no prefix's, and changing it reruns nothing."""

    # off | lookup (the document's own text) | layers (the model's first `layers` layers) |
    # auto (lookup where it pays); the same names as the engine's DRAFTS (a test holds them so)
    draft: Literal["off", "lookup", "layers", "auto"] = "auto"
    tokens: StrictInt = Field(4, ge=1, le=16)  # drafts per step; a longer draft is rarely kept
    layers: StrictInt = Field(8, ge=1)  # the `layers` drafter's depth

    @field_validator("draft", mode="before")
    @classmethod
    def _off(cls, value: object) -> object:
        # YAML reads an unquoted `off` (or `no`) as false: the user wrote off.
        return "off" if value is False else value


class Engine(_Strict):
    """How the model runs; none of this changes an answer except `dtype` and `on_overflow`."""

    prefill_chunk: StrictInt = Field(2048, ge=16)  # tokens per prefill step
    batch_size: StrictInt = Field(8, ge=1)  # questions of a document decoded together
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_context: StrictInt = Field(_CONTEXT, ge=1)  # document + question tokens
    # A document over max_context: fail its rows (the message gives its token count), or keep
    # its start and end, or its start.
    on_overflow: Literal["error", "truncate_middle", "truncate_end"] = "error"
    # A document of at most this many tokens, with fewer questions than batch_size, is pooled:
    # its rows prefill their whole prompts and decode in full batches across documents, since a
    # short document prompt is cheap to prefill again and its own batch would be mostly empty.
    # 0: never.
    pool_max_tokens: StrictInt = Field(2048, ge=0)
    speculative: Speculative = Field(default_factory=Speculative)


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


# The longest output file name: the file system allows 255 bytes, and the results file gets a
# parts folder (`.parts`) and temporary files (`.<stem>.tmp-<pid>-<8 hex>.parquet`) beside it.
MAX_OUTPUT_NAME = 255 - 25
OUTPUT_SUFFIXES = (".parquet", ".jsonl")


class OutputSettings(_Strict):
    """Where the results go; `path` defaults to `results/<name>.parquet` beside the job file.
    A path ending in .jsonl is OpenAI Batch output, its results beside it in .parquet."""

    path: Path

    @field_validator("path", mode="before")
    @classmethod
    def _resolve_path(cls, value: object, info: ValidationInfo) -> str:
        path = _resolve(value, info)
        name = os.path.basename(path)
        if os.path.splitext(name)[1].lower() not in OUTPUT_SUFFIXES:
            raise job_error(
                f"must end in .parquet (the results) or .jsonl (OpenAI Batch output, the results "
                f"beside it in .parquet), got {show_value(name)}"
            )
        too_long = [p for p in Path(path).parts if len(os.fsencode(p)) > 255]
        if too_long or len(os.fsencode(name)) > MAX_OUTPUT_NAME:
            part = too_long[0] if too_long else name
            raise job_error(
                f"a file name of {len(os.fsencode(part))} bytes: at most {MAX_OUTPUT_NAME} "
                "(file systems allow 255, and the results get a .parts folder and temporary "
                "files named after them)"
            )
        return path


class JobSpec(_Strict):
    """A whole job file. Build it with `load_job`, or with
    `JobSpec.model_validate(data, context={"base_dir": folder})` to resolve relative paths."""

    name: str
    model: str  # a checkpoint folder (resolved), or "builtin:NAME" or a Hub repo id (kept as is)
    documents: list[DocumentEntry] = Field(default_factory=list)
    questions: list[Question] = Field(default_factory=list)
    requests: Path | None = None  # an OpenAI batch .jsonl of chat requests
    system: str | None = None  # system prompt of the document questions
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    engine: Engine = Field(default_factory=Engine)
    cache: CacheSettings
    output: OutputSettings

    @model_validator(mode="wrap")
    @classmethod
    def _check_job(cls, data: Any, handler: ModelWrapValidatorHandler[JobSpec]) -> JobSpec:
        # The checks across fields read the data as given, so they run once whether or not the
        # fields are valid, and their problems are reported beside the field errors.
        data = _with_defaults(data)
        problems = _job_problems(data)
        try:
            spec = handler(data)
        except ValidationError as e:
            if not problems:
                raise
            errors = [raised_again(err) for err in e.errors()]
        else:
            if not problems:
                return spec
            errors = []
        errors += [
            {"type": job_error(message), "loc": loc, "input": data} for loc, message in problems
        ]
        raise ValidationError.from_exception_data(cls.__name__, errors)

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
            raise job_error(f"must be {_SAFE_TEXT}, got {show_value(value)}{hint}")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, (str, Path)):
            return value  # pydantic says "expected a string"
        if isinstance(value, str) and is_builtin(value):
            try:
                builtin_name(value)  # refuses an unknown NAME
            except ConfigError as e:
                raise job_error(e.message) from None
            return value
        path = _resolve(value, info)
        if isinstance(value, str) and hub_repo(value) and not os.path.exists(path):
            return value  # `org/name`, no such folder: a Hugging Face repo id (salabatch.models)
        return path

    @field_validator("requests", mode="before")
    @classmethod
    def _resolve_requests(cls, value: object, info: ValidationInfo) -> str | None:
        return None if value is None else _resolve(value, info)

    @field_validator("system")
    @classmethod
    def _check_system(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise job_error("must not be empty (leave system out for no system prompt)")
        return value

    @property
    def model_is_builtin(self) -> bool:
        return is_builtin(self.model)

    def sources(self) -> list[DocumentSource]:
        """The `documents:` entries for `salabatch.jobs.ingest.documents.iter_documents`, with
        the byte limit of `engine.max_context`, never taking the job's own files: its results
        (.parquet) and their parts folder, its requests, and the Batch output beside the
        results (.jsonl) where the job writes one (its output is .jsonl, or it has requests) or
        the file holds Batch output lines; else that file is a user's (documents, say)."""
        results = self.output.path.with_suffix(".parquet")
        own = [results, parts_dir_of(results), self.requests]
        batch = results.with_suffix(".jsonl")
        writes_batch = self.output.path.suffix.lower() == ".jsonl" or self.requests is not None
        if writes_batch or (batch.is_file() and _readable_batch_output(batch)):
            own.append(batch)
        skip = tuple(path for path in own if path is not None)
        return [entry.to_source(self.engine.max_context, skip) for entry in self.documents]


def _readable_batch_output(path: Path) -> bool:
    """Whether `path` holds OpenAI Batch output lines salabatch wrote, or nothing."""
    try:
        return is_batch_output(path)
    except OSError:  # not readable: no documents either, and a walk reports it
        return False


def _with_defaults(data: Any) -> Any:
    """Defaults that depend on the job file: question ids, sections whose paths resolve against
    the job's folder, the output path named after the job."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    questions = data.get("questions")
    if isinstance(questions, list):
        data["questions"] = [_question(q, n) for n, q in enumerate(questions, 1)]
    if "cache" not in data:
        data["cache"] = {}
    output = data.get("output", {})
    if isinstance(output, dict) and "path" not in output:
        name = _number_as_text(data.get("name"))
        # A bad or missing name is reported on its own; the placeholder is never used.
        stem = name if isinstance(name, str) and _SAFE_NAME.fullmatch(name) else "job"
        data["output"] = {**output, "path": f"results/{stem}.parquet"}
    return data


def _question(question: object, number: int) -> object:
    """A question as given, its id `q<number>` when it has none; a plain string is its text."""
    if isinstance(question, str):
        return {"id": f"q{number}", "text": question}
    if isinstance(question, dict) and question.get("id") is None:
        return {**question, "id": f"q{number}"}
    return question


def _number_as_text(value: object) -> object:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _job_problems(data: Any) -> list[tuple[Loc, str]]:
    """Mistakes across the fields of unvalidated job data (defaults filled in): nothing to do,
    documents without questions (or the reverse), a question id used twice."""
    if not isinstance(data, dict):
        return []  # pydantic says "expected a mapping"
    has_documents, has_requests = bool(data.get("documents")), data.get("requests") is not None
    questions = data.get("questions")
    questions = questions if isinstance(questions, list) else []
    problems: list[tuple[Loc, str]] = []
    if not (has_documents or questions or has_requests):
        problems.append(
            (("documents",), "nothing to do: give documents and questions, or requests")
        )
    elif has_documents and not questions:
        problems.append((("questions",), "field required: documents need questions to ask"))
    elif questions and not has_documents:
        problems.append((("documents",), "field required: questions need documents to ask"))

    first: dict[str, int] = {}
    for index, question in enumerate(questions):
        qid = question.get("id") if isinstance(question, dict) else None
        # An id that is not text or a number is reported by its own field.
        if isinstance(qid, bool) or not isinstance(qid, (str, int, float)) or qid == "":
            continue
        qid = str(qid)  # as `Question` reads it: `id: 7` is "7"
        if qid not in first:
            first[qid] = index
            continue
        auto = "; a question without an id is q<position>" if re.fullmatch(r"q\d+", qid) else ""
        message = f"duplicate id {qid!r} (also questions[{first[qid]}].id){auto}"
        problems.append((("questions", index, "id"), message))
    return problems + _room_problems(data, questions)


def _room_problems(data: dict[str, Any], questions: list[Any]) -> list[tuple[Loc, str]]:
    """Answer lengths that leave no token of `engine.max_context` for the document and its
    question, so that every row asking them would be an error row: a question's own
    max_tokens, the job's (where given, or where a question takes its default of 512). A value
    of the wrong type is reported by its own field."""
    engine = data.get("engine")
    context = engine.get("max_context", _CONTEXT) if isinstance(engine, dict) else _CONTEXT
    generation = data.get("generation")
    given = generation.get("max_tokens") if isinstance(generation, dict) else None
    own = [q.get("max_tokens") if isinstance(q, dict) else None for q in questions]
    if not _is_int(context):
        return []

    def no_room(value: int) -> str:
        return (
            f"{value} leaves no room for a document within engine.max_context {context} (the "
            "document, question and answer together): lower it or raise engine.max_context"
        )

    problems = [
        (("questions", index, "max_tokens"), no_room(value))
        for index, value in enumerate(own)
        if _is_int(value) and value >= context
    ]
    if given is not None:
        if _is_int(given) and given >= context:
            problems.append((("generation", "max_tokens"), no_room(given)))
    elif context <= _MAX_TOKENS and any(value is None for value in own):
        message = (
            f"{context} leaves no room for a document beside answers of generation.max_tokens "
            f"(default {_MAX_TOKENS}): raise it or give a lower generation.max_tokens"
        )
        problems.append((("engine", "max_context"), message))
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- what identifies a job and a question's answers -------------------------------------------


def spec_json(spec: JobSpec) -> str:
    """The spec as canonical JSON (sorted keys, resolved paths): for file metadata."""
    return json.dumps(
        spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def spec_fingerprint(spec: JobSpec) -> str:
    """sha256 (hex) of `spec_json(spec)`. Any change, paths and engine settings included,
    changes it; row-level resume keys should use `generation_key` instead."""
    return hashlib.sha256(spec_json(spec).encode("utf-8")).hexdigest()


def effective_generation(spec: JobSpec, question: Question) -> GenerationSettings:
    """The job's `generation:` with the question's own overrides applied."""
    update = {
        key: value
        for key, value in (("max_tokens", question.max_tokens), ("think", question.think))
        if value is not None
    }
    return spec.generation.model_copy(update=update)


def generation_key(spec: JobSpec, question: Question) -> dict[str, Any]:
    """The effective generation settings of one question, as plain JSON values."""
    return effective_generation(spec, question).key()
