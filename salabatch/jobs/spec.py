"""The job file: its pydantic models, YAML loading, `--set` overrides and the problem checks.

`load_job(path, overrides)` reads a job file with the safe YAML loader, applies `--set key=value`
overrides and validates it: paths resolve against the job file's folder (`~` expanded). Every
mistake is reported at once, as one `JobValidationError` (exit code 2) with a
`location: message` line each (`questions[2].text: field required (line 7)`): a job left running
overnight should not stop at 3 a.m. on a typo, nor on the second typo after the first is fixed.
The models never touch the disk, so a spec loads on any machine; `check_paths` reports what the
job names but the disk lacks.

Numbers and booleans are strict: YAML already types them, so `batch_size: "4"` or `think: 1` is
a mistake worth reporting, not something to coerce.
"""

from __future__ import annotations

import difflib
import glob as globlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from salabatch.demo import builtin
from salabatch.engine.models import hub_repo
from salabatch.errors import ConfigError, JobSpecError, JobValidationError
from salabatch.files import cache_dir
from salabatch.jobs.documents import SUPPORTED_SUFFIXES, DocumentSource, expand_sources

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
_JOB_ERROR = "job_spec"


def _fail(message: str) -> PydanticCustomError:
    # The message goes through the context: pydantic formats `{...}` in templates, and a
    # user's value may contain braces.
    return PydanticCustomError(_JOB_ERROR, "{message}", {"message": message})


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

    Existence is not checked here (see `check_paths`): a spec loads on any machine.
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


class GenerationSettings(_Strict):
    """Sampling settings of every question (greedy by default): the job's `generation:`."""

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
    # A document of at most this many tokens, with fewer questions than batch_size, is pooled:
    # its rows prefill their whole prompts and decode in full batches across documents, since a
    # short document prompt is cheap to prefill again and its own batch would be mostly empty.
    # 0: never.
    pool_max_tokens: StrictInt = Field(2048, ge=0)


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
            errors = [_raised_again(err) for err in e.errors()]
        else:
            if not problems:
                return spec
            errors = []
        errors += [{"type": _fail(message), "loc": loc, "input": data} for loc, message in problems]
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
            raise _fail(f"must be {_SAFE_TEXT}, got {show_value(value)}{hint}")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, (str, Path)):
            return value  # pydantic says "expected a string"
        if isinstance(value, str) and builtin.is_builtin(value):
            try:
                builtin.builtin_name(value)  # refuses an unknown NAME
            except ConfigError as e:
                raise _fail(e.message) from None
            return value
        path = _resolve(value, info)
        if isinstance(value, str) and hub_repo(value) and not os.path.exists(path):
            return value  # `org/name`, no such folder: a Hugging Face repo id (engine.models)
        return path

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

    @property
    def model_is_builtin(self) -> bool:
        return builtin.is_builtin(self.model)

    def sources(self) -> list[DocumentSource]:
        """The `documents:` entries for `salabatch.jobs.documents.iter_documents`."""
        return [entry.to_source() for entry in self.documents]


def _with_defaults(data: Any) -> Any:
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
    return problems


def _raised_again(err: ErrorDetails) -> InitErrorDetails:
    """A pydantic error as `ValidationError.from_exception_data` takes it, to raise it again
    beside more: pydantic's own types go by name, the job's own need their message."""
    kind = _fail(err["msg"]) if err["type"] == _JOB_ERROR else err["type"]
    again: InitErrorDetails = {"type": kind, "loc": err["loc"], "input": err["input"]}
    if "ctx" in err:
        again["ctx"] = err["ctx"]
    return again


# ---- reading a job file --------------------------------------------------------------------------


def load_job(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    requests: str | Path | None = None,
    output: str | Path | None = None,
    check_files: bool = False,
) -> JobSpec:
    """Read, override and validate a job file.

    overrides: `key.sub=value` strings (see `apply_override`), applied in order before validation.
    requests, output: paths given on the command line (`--requests`, `-o`): relative to the
        current directory, they replace `requests:` / `output.path`.
    check_files: also run `check_paths` (documents, model and requests exist).
    Raises JobSpecError for a file that cannot be read or parsed, JobValidationError (listing
    every mistake, each with its YAML line or "(from the command line)") for one that does not
    validate.
    """
    data, root = _parse_yaml(_read_job_file(path), path)
    errors = _duplicate_keys(root)
    set_paths, override_errors = _command_line(data, overrides, requests, output)
    errors += override_errors

    def note(loc: Loc) -> str:
        if any(tuple(str(p) for p in loc[: len(s)]) == s for s in set_paths):
            return " (from the command line)"
        line = _line_of(root, loc)
        return f" (line {line})" if line else ""

    base_dir = Path(path).expanduser().absolute().parent
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as e:
        raise JobValidationError(path, [*errors, *_error_lines(e, note=note)]) from None
    if errors:
        raise JobValidationError(path, errors)
    if check_files and (problems := check_paths(spec)):
        raise JobValidationError(path, problems)
    return spec


def _command_line(
    data: dict[str, Any],
    overrides: Sequence[str],
    requests: str | Path | None,
    output: str | Path | None,
) -> tuple[list[tuple[str, ...]], list[str]]:
    """Apply the command line's `--set`, `--requests` and `-o` to the job data in place: (the
    key parts each one set, the overrides that could not be applied)."""
    set_paths: list[tuple[str, ...]] = []
    errors: list[str] = []
    for override in overrides:
        try:
            set_paths.append(apply_override(data, override))
        except JobSpecError as e:
            errors.append(e.message)
    if requests is not None:
        data["requests"] = os.path.abspath(os.path.expanduser(requests))
        set_paths.append(("requests",))
    if output is not None:
        section = data.get("output")
        section = dict(section) if isinstance(section, dict) else {}
        data["output"] = {**section, "path": os.path.abspath(os.path.expanduser(output))}
        set_paths.append(("output", "path"))
    return set_paths, errors


def requests_job(
    requests: str | Path, model: str | None = None, overrides: Sequence[str] = ()
) -> JobSpec:
    """A job for `salabatch run --requests FILE` without a job file: named after the file, the
    model from `model` or else the one model every request names; results under ./results."""
    path = Path(os.path.expanduser(requests)).absolute()
    data: dict[str, Any] = {
        "name": slug(path.stem) or "requests",
        "model": _requests_model(path) if model is None else model,
        "requests": str(path),
    }
    for override in overrides:
        apply_override(data, override)
    try:
        return JobSpec.model_validate(data, context={"base_dir": Path.cwd()})
    except ValidationError as e:
        raise JobValidationError(path, _error_lines(e)) from None


def _requests_model(path: Path) -> str:
    """The one model every request of an OpenAI batch file names."""
    names = set()
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                body = json.loads(line).get("body") or {}
                names.add(body.get("model"))
    except (OSError, ValueError, AttributeError) as e:
        raise JobSpecError(f"cannot read the model from the requests ({e})", path=path) from None
    names.discard(None)
    if len(names) != 1:
        raise JobSpecError(
            "give --model: the requests name "
            + (f"several models ({', '.join(sorted(map(str, names)))})" if names else "none"),
            path=path,
        )
    return names.pop()


# ---- YAML, with line numbers for the messages ----------------------------------------------------


def _read_job_file(path: str | Path) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobSpecError("job file not found", path=path) from None
    except IsADirectoryError:
        raise JobSpecError("is a folder, not a job file", path=path) from None
    except UnicodeDecodeError as e:
        reason = f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}"
        raise JobSpecError(reason, path=path) from None
    except OSError as e:
        raise JobSpecError(f"cannot read job file: {e.strerror or e}", path=path) from None


def _parse_yaml(text: str, path: str | Path) -> tuple[dict[str, Any], yaml.Node]:
    """(data, node tree) of a job file: the tree keeps line numbers for the error messages."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and start and (not mark or start.line != mark.line):
            problem += f" ({context} at line {start.line + 1})"
        raise JobSpecError(f"invalid YAML{where}: {problem}", path=path) from None
    finally:
        loader.dispose()
    if data is None:
        raise JobSpecError("job file is empty (expected name:, model:, documents:, …)", path=path)
    if not isinstance(data, dict):
        got = "a list" if isinstance(data, list) else show_value(data)
        raise JobSpecError(
            f"expected a mapping (name:, model:, …) at the top, got {got}", path=path
        )
    return data, root


def _line_of(root: yaml.Node, loc: Loc) -> int | None:
    """1-based line of `loc` in the YAML tree, or of its deepest part present (a missing field
    points at the mapping that lacks it); None for the top level."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((kv for kv in node.value if kv[0].value == part), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _duplicate_keys(node: yaml.Node, loc: Loc = (), seen: set[int] | None = None) -> list[str]:
    """Keys given twice in one mapping: safe_load silently keeps the last one."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias: checked where its anchor is
        return []
    seen.add(id(node))
    errors: list[str] = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            name, line = key.value, key.start_mark.line + 1
            if isinstance(key, yaml.ScalarNode) and name != "<<":
                if name in first:
                    where = render_loc((*loc, name))
                    errors.append(
                        f"{where}: duplicate key (line {line}; first at line {first[name]})"
                    )
                else:
                    first[name] = line
            errors += _duplicate_keys(value, (*loc, str(name)), seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            errors += _duplicate_keys(item, (*loc, index), seen)
    return errors


# ---- --set overrides -----------------------------------------------------------------------------


def apply_override(data: dict[str, Any], override: str) -> tuple[str, ...]:
    """Apply one `--set key.sub=value` to the job data in place; return the key's parts.

    Keys are dotted; list items are numbered from 0, as `questions.0.text` or `questions[0].text`.
    Missing mappings on the way are created. The value is read as YAML when it is a number,
    true/false, null, a quoted string, a [list] or a {mapping}; anything else is the text as
    given (so `system=Answer briefly: no lists #1` stays whole). `key=` sets null.
    Raises JobSpecError naming the override when it cannot be applied.
    """

    def fail(reason: str) -> JobSpecError:
        return JobSpecError(f"--set {override!r}: {reason}")

    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep:
        raise fail("expected key=value, e.g. engine.batch_size=4")
    parts = tuple(re.sub(r"\[(\d+)\]", r".\1", key).split("."))
    if not key or any(not p or "[" in p or "]" in p for p in parts):
        raise fail("expected a dotted key such as generation.max_tokens or questions[0].text")
    value = _override_value(raw, fail)

    # Containers on the way are copied: YAML aliases share them with other places.
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = render_loc(tuple(int(p) if p.isdigit() else p for p in parts[:depth]))
        if isinstance(node, dict):
            slot: Any = part
        elif isinstance(node, list):
            if not part.isdigit():
                raise fail(f"{where} is a list: give an item number, e.g. {where}[0]")
            slot = int(part)
            if slot >= len(node):
                raise fail(f"{where} has {len(node)} items (numbered from 0)")
        else:
            raise fail(f"{where} is {show_value(node)}, not a mapping or a list")
        if last:
            node[slot] = value
            break
        child = node.get(slot) if isinstance(node, dict) else node[slot]
        if child is None:
            child = {}
        elif isinstance(child, (dict, list)):
            child = type(child)(child)
        node[slot] = child
        node = child
    return parts


def _override_value(raw: str, fail: Callable[[str], JobSpecError]) -> Any:
    structured = raw.lstrip()[:1] in ("[", "{")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        if structured:
            raise fail(f"invalid YAML value: {getattr(e, 'problem', None) or e}") from None
        return raw
    if structured or raw.lstrip()[:1] in ("'", '"'):
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return raw  # plain text: YAML would cut `#...` comments or read `a: b` as a mapping


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


def _error_lines(error: ValidationError, *, note: Callable[[Loc], str] | None = None) -> list[str]:
    """One `location: message` line per error of a JobSpec validation (an unknown field gets the
    close match and the allowed ones); `note(loc)` is appended (load_job adds the YAML line)."""
    lines = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        lines.append(f"{render_loc(loc)}: {_message(err)}{note(loc) if note else ''}")
    return lines


def _message(err: ErrorDetails) -> str:
    kind, value = err["type"], err.get("input")
    if kind == "missing":
        return "field required"
    if kind == "extra_forbidden":
        return _unknown_field(tuple(err["loc"]))
    if kind == _JOB_ERROR:
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
    """`location: message` lines for what the job names but the disk lacks: the model folder,
    the requests file, an output path that is a folder, document paths and globs (as
    `iter_documents` would report them, every entry). Empty when all is there."""
    return path_problems(spec)[0]


def path_problems(spec: JobSpec) -> tuple[list[str], int | None]:
    """(`check_paths(spec)`, number of distinct document files or None when the documents have
    problems)."""
    problems: list[str] = []
    if not spec.model_is_builtin and hub_repo(spec.model) is None:  # a Hub id resolves at run
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
    document_problems, n_files = _document_problems(spec.sources())
    return problems + document_problems, n_files


def _document_problems(sources: list[DocumentSource]) -> tuple[list[str], int | None]:
    """Problems of the `documents:` entries, and their number of distinct files (None when an
    entry names nothing)."""
    try:
        files = expand_sources(sources)
    except JobSpecError:
        # expand_sources stops at the first bad entry: expand each alone to report them all.
        problems = [_entry_problem(index, source) for index, source in enumerate(sources)]
        return [p for p in problems if p is not None], None
    problems = []
    for file in files:  # only a file named directly can have an unsupported type
        if file.path.suffix.lower() not in SUPPORTED_SUFFIXES:
            where = render_loc(("documents", sources.index(file.source), "path"))
            supported = " ".join(SUPPORTED_SUFFIXES)
            kind = file.path.suffix or "(none)"
            problems.append(f"{where}: unsupported file type {kind} (supported: {supported})")
    return problems, len(files)


def _entry_problem(index: int, source: DocumentSource) -> str | None:
    """What is wrong with `documents[index]` alone, or None."""
    try:
        expand_sources([source])
    except JobSpecError as e:
        # The error names the field of the entry's place in a one-entry list: keep the field
        # (path or glob), and locate it at the entry's real place.
        field = (e.field or "path").rpartition(".")[2]
        shown = "" if e.path is None or e.path in e.message else f": {e.path}"
        return f"{render_loc(('documents', index, field))}: {e.message}{shown}"
    return None


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
    return effective_generation(spec, question).model_dump(mode="json")
