"""Reading a job: a job file (YAML, with `--set`, `--requests`, `-o` and `--model` from the command
line) or a bare OpenAI Batch requests file becomes a `JobSpec`; then what the job names but the
disk lacks.

`load_job(path, overrides)` reads a job file with the safe YAML loader (`job_yaml`), applies the
command line and validates it (`models`). Every mistake is reported at once, as one
`JobValidationError` (exit code 2) with a `location: message` line each
(`questions[2].text: field required (line 7)`): a job left running overnight should not stop at
3 a.m. on a typo, nor on the second typo after the first is fixed. `check_paths` then reports the
model folder, requests file, output path, documents and globs the disk lacks, located the same
way (`read_job` gives the note that locates them); `validate` and `run` ask it before anything
loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from salabatch.errors import JobSpecError, JobValidationError, OutputError
from salabatch.files import same_file
from salabatch.jobs.ingest.documents import DocumentSource, SourceFile, expand_sources
from salabatch.jobs.results.export import is_batch_output
from salabatch.jobs.results.read import check_final
from salabatch.jobs.spec.errors import Loc, error_lines, render_loc
from salabatch.jobs.spec.job_yaml import (
    apply_override,
    line_of,
    parse_yaml,
    read_job_file,
)
from salabatch.jobs.spec.models import DocumentEntry, JobSpec, slug
from salabatch.models import hub_repo, is_builtin

# What follows a location in an error line: " (line 7)", " (from the command line)" or "".
Note = Callable[[Loc], str]


def load_job(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    requests: str | Path | None = None,
    output: str | Path | None = None,
    model: str | None = None,
    check_files: bool = False,
) -> JobSpec:
    """Read, override and validate a job file.

    overrides: `key.sub=value` strings (see `apply_override`), applied in order before validation.
    requests, output: paths given on the command line (`--requests`, `-o`): relative to the
        current directory, they replace `requests:` / `output.path`.
    model: `--model`: a folder relative to the current directory, a Hub repo id or builtin:NAME
        (see `command_line_model`), replacing `model:`.
    check_files: also run `check_paths` (documents, model and requests exist).
    Raises JobSpecError for a file that cannot be read or parsed, JobValidationError (listing
    every mistake, each with its YAML line or "(from the command line)") for one that does not
    validate.
    """
    spec, note = read_job(
        path, overrides, requests=requests, output=output, model=model, documents=check_files
    )
    if check_files and (problems := check_paths(spec, note=note)):
        raise JobValidationError(path, problems)
    return spec


def read_job(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    requests: str | Path | None = None,
    output: str | Path | None = None,
    model: str | None = None,
    documents: bool = False,
) -> tuple[JobSpec, Note]:
    """`load_job` without `check_files`, and the note that follows a location of the job in an
    error line (its line in the file, or "(from the command line)"), for `check_paths`. With
    `documents`, a job that does not validate also lists what the disk lacks for its
    `documents:` entries that do (`check_paths` lists it for a job that validates), so that one
    listing holds every mistake the run would stop on."""
    data, root, errors = parse_yaml(read_job_file(path), path)
    set_paths, override_errors = _command_line(data, overrides, requests, output, model)
    errors += override_errors

    def note(loc: Loc) -> str:
        if _set_by(loc, set_paths):
            return " (from the command line)"
        line = line_of(root, loc)
        return f" (line {line})" if line else ""

    base_dir = Path(path).expanduser().absolute().parent
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as e:
        found = [*errors, *error_lines(e, JobSpec, note=note)]
        if documents:
            found += _entry_lines(data, base_dir, note)
        raise JobValidationError(path, found) from None
    if errors:
        raise JobValidationError(path, errors)
    return spec, note


def _entry_lines(data: object, base_dir: Path, note: Note) -> list[str]:
    """The disk's problems with the `documents:` entries of job data that are valid alone."""
    entries = data.get("documents") if isinstance(data, dict) else None
    lines = []
    for index, raw in enumerate(entries if isinstance(entries, list) else []):
        try:
            entry = DocumentEntry.model_validate(raw, context={"base_dir": base_dir})
        except ValidationError:
            continue  # its own mistakes are listed
        if (problem := _entry_problem(index, entry.to_source())) is not None:
            loc, message = problem
            lines.append(f"{render_loc(loc)}: {message}{note(loc)}")
    return lines


def _command_line(
    data: dict[str, Any],
    overrides: Sequence[str],
    requests: str | Path | None,
    output: str | Path | None,
    model: str | None,
) -> tuple[list[tuple[str, ...]], list[str]]:
    """Apply the command line's `--set`, `--requests`, `-o` and `--model` to the job data in
    place: (the key parts each one set, the overrides that could not be applied)."""
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
    if model is not None:
        data["model"] = command_line_model(model)
        set_paths.append(("model",))
    return set_paths, errors


def _set_by(loc: Loc, set_paths: Sequence[tuple[str, ...]]) -> bool:
    """Whether the command line set `loc` (it, or a field above it)."""
    return any(tuple(str(p) for p in loc[: len(s)]) == s for s in set_paths)


def command_line_model(model: str) -> str:
    """`--model` as the job's `model:` takes it: a folder relative to the current directory
    (not to the job file, as `model:` is), or a Hub repo id or builtin:NAME as given."""
    if is_builtin(model) or (hub_repo(model) is not None and not os.path.lexists(model)):
        return model
    return os.path.abspath(os.path.expanduser(model))


def requests_job(
    requests: str | Path,
    model: str | None = None,
    overrides: Sequence[str] = (),
    *,
    output: str | Path | None = None,
) -> tuple[JobSpec, Note]:
    """A job for `salabatch run --requests FILE` without a job file: named after the file, the
    model from `model` or else the one model every request names; results under ./results
    unless `output` (`-o`, relative to the current directory) says where. → (the job, the
    note that follows a location in an error line, as `read_job`'s: "(from the command line)",
    or "(the model the requests name)"), for `check_paths`."""
    path = Path(os.path.expanduser(requests)).absolute()
    data: dict[str, Any] = {"name": slug(path.stem) or "requests"}
    if model is None:
        data["model"] = _requests_model(path)
    set_paths, errors = _command_line(data, overrides, path, output, model)

    def note(loc: Loc) -> str:
        if _set_by(loc, set_paths):
            return " (from the command line)"
        return " (the model the requests name)" if loc[:1] == ("model",) else ""

    try:
        spec = JobSpec.model_validate(data, context={"base_dir": Path.cwd()})
    except ValidationError as e:
        raise JobValidationError(path, [*errors, *error_lines(e, JobSpec, note=note)]) from None
    if errors:
        raise JobValidationError(path, errors)
    return spec, note


def _requests_model(path: Path) -> str:
    """The one model every request of an OpenAI batch file names."""
    if problem := _requests_problem(path):
        raise JobSpecError(problem, path=path)
    names = set()
    try:  # lines end at a newline only, as a run reads them (str.splitlines ends more: U+2028)
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise JobSpecError(f"cannot read the model from the requests ({e})", path=path) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except (ValueError, RecursionError) as e:
            where = f" ({e.msg} at column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
            raise JobSpecError(
                f"line {number}: not valid JSON{where}, so the model it names is unknown; fix "
                "the line or give --model",
                path=path,
            ) from None
        body = request.get("body") if isinstance(request, dict) else None
        names.add(body.get("model") if isinstance(body, dict) else None)
    names.discard(None)
    if len(names) != 1:
        raise JobSpecError(
            "give --model: the requests name "
            + (f"several models ({', '.join(sorted(map(str, names)))})" if names else "none"),
            path=path,
        )
    return names.pop()


def _requests_problem(path: Path) -> str | None:
    """Why the requests file cannot be used, or None: it must be a regular file (a FIFO would
    wait for a writer forever) with a request line."""
    if path.is_file():
        return None if _has_line(path) else _NO_LINES
    if path.is_dir():
        return "a folder (expected a .jsonl file)"
    return "not a regular file" if os.path.lexists(path) else "no such file"


_NO_LINES = "no request lines in it"


def _has_line(path: Path) -> bool:
    """Whether the file holds a line that is not blank (read a block at a time; a file that
    cannot be read says so when the run reads it)."""
    try:
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                if block.strip():
                    return True
    except OSError:
        return True
    return False


def batch_output(spec: JobSpec, beside: bool = False) -> tuple[JobSpec, Path | None]:
    """(the spec whose output.path is the Parquet results, the OpenAI Batch output file or
    None). An output.path ending in .jsonl is Batch output, its results beside it in
    .parquet; `beside` (`--requests` without `-o`): Batch output beside the results too."""
    path = spec.output.path
    if path.suffix.lower() == ".jsonl":
        results = spec.output.model_copy(update={"path": path.with_suffix(".parquet")})
        return spec.model_copy(update={"output": results}), path
    return spec, path.with_suffix(".jsonl") if beside else None


# ---- what the disk lacks -----------------------------------------------------------------------


def check_paths(
    spec: JobSpec, *, batch_beside: bool = False, note: Note | None = None
) -> list[str]:
    """`location: message` lines for what the job names but the disk lacks or holds in its
    way: the model folder, the requests file, the cache folder, the output files (see
    `_output_problems`; `batch_beside` as in `batch_output`), document paths and globs (as
    `iter_documents` would report them, every entry). Empty when all is there. `note` (from
    `read_job`) follows each location with its line in the job file."""
    return path_problems(spec, batch_beside=batch_beside, note=note)[0]


def path_problems(
    spec: JobSpec, *, batch_beside: bool = False, note: Note | None = None
) -> tuple[list[str], list[SourceFile] | None]:
    """(`check_paths(spec)`, the distinct document files or None when the documents have
    problems)."""
    problems: list[tuple[Loc, str]] = []
    if not spec.model_is_builtin and hub_repo(spec.model) is None:  # a Hub id resolves at run
        model = Path(spec.model)
        if not os.path.exists(model):
            problems.append((("model",), f"no such folder: {model}"))
        elif not os.path.isdir(model):
            problems.append((("model",), f"not a folder: {model} (expected a checkpoint folder)"))
        elif not os.path.isfile(model / "config.json"):
            message = f"no config.json in {model} (expected a checkpoint folder)"
            problems.append((("model",), message))
    if spec.requests is not None and (problem := _requests_problem(spec.requests)):
        if problem == _NO_LINES:
            problems.append((("requests",), f"no request lines in {spec.requests}"))
        else:
            problem = problem.replace(" (expected a .jsonl file)", "")
            message = f"{problem}: {spec.requests} (expected a .jsonl file)"
            problems.append((("requests",), message))
    if spec.cache.enabled and (blocked := _not_a_folder(spec.cache.dir)) is not None:
        problems.append((("cache", "dir"), f"{blocked} is not a folder"))
    results, batch = batch_output(spec, batch_beside)
    for problem in _output_problems(results.output.path, batch, spec.requests):
        problems.append((("output", "path"), problem))
    document_problems, files = _document_problems(spec.sources())
    problems += document_problems
    lines = [
        f"{render_loc(loc)}: {message}{note(loc) if note else ''}" for loc, message in problems
    ]
    return lines, files


def _output_problems(results: Path, batch: Path | None, requests: Path | None) -> list[str]:
    """What stops a run from writing its results (Parquet) and Batch output (.jsonl) files,
    found before anything is loaded: a folder there, the requests file itself, a file that is
    not what salabatch wrote there earlier (a run replaces only its own results and Batch
    output, never someone else's file)."""
    problems = []
    for path, kind in ((results, "results"), (batch, "batch")):
        if path is None:
            continue
        if os.path.isdir(path):
            problems.append(f"is a folder: {path} (expected a file path)")
            continue
        if not os.path.lexists(path):
            blocked = _not_a_folder(path.parent)
            if blocked is not None and not any(str(blocked) in p for p in problems):
                problems.append(f"cannot make the folder of {path}: {blocked} is not a folder")
            continue
        if requests is not None and same_file(path, requests):
            problems.append(f"{path} is the requests file; refusing to overwrite the input")
        elif not os.path.isfile(path):
            problems.append(f"{path} is not a regular file")
        elif kind == "batch" and not is_batch_output(path):
            problems.append(
                f"{path} exists and is not salabatch's OpenAI Batch output; refusing to "
                "overwrite it: choose another output path or move the file away"
            )
        elif kind == "results":
            try:
                check_final(path)
            except OutputError as e:
                problems.append(
                    f"{path}: {e.message}; refusing to overwrite it: choose another output "
                    "path or move the file away"
                )
    return problems


def _not_a_folder(folder: Path) -> Path | None:
    """The nearest of `folder` and its parents that exists, where it is not a folder (a file,
    a dangling link) and so no output can be made under it; else None."""
    for path in (folder, *folder.parents):
        if os.path.lexists(path):
            return None if os.path.isdir(path) else path
    return None


def _document_problems(
    sources: list[DocumentSource],
) -> tuple[list[tuple[Loc, str]], list[SourceFile] | None]:
    """Problems of the `documents:` entries, and their distinct files (None when an entry
    names nothing). A file that will be an error document (unknown type, unreadable folder)
    is no problem of the job: the run reports it as error rows."""
    try:
        files = expand_sources(sources)
    except JobSpecError:
        # expand_sources stops at the first bad entry: expand each alone to report them all.
        problems = [_entry_problem(index, source) for index, source in enumerate(sources)]
        return [p for p in problems if p is not None], None
    return [], files


def _entry_problem(index: int, source: DocumentSource) -> tuple[Loc, str] | None:
    """What is wrong with `documents[index]` alone, or None."""
    try:
        expand_sources([source])
    except JobSpecError as e:
        # The error names the field of the entry's place in a one-entry list: keep the field
        # (path or glob), and locate it at the entry's real place.
        field = (e.field or "path").rpartition(".")[2]
        shown = "" if e.path is None or e.path in e.message else f": {e.path}"
        return ("documents", index, field), f"{e.message}{shown}"
    return None
