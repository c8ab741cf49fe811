"""Reading a job: a job file (YAML, with `--set`, `--requests` and `-o` from the command line) or a
bare OpenAI Batch requests file becomes a `JobSpec`; then what the job names but the disk lacks.

`load_job(path, overrides)` reads a job file with the safe YAML loader (`job_yaml`), applies the
command line and validates it (`models`). Every mistake is reported at once, as one
`JobValidationError` (exit code 2) with a `location: message` line each
(`questions[2].text: field required (line 7)`): a job left running overnight should not stop at
3 a.m. on a typo, nor on the second typo after the first is fixed. `check_paths` then reports the
model folder, requests file, output path, documents and globs the disk lacks; `validate` and
`run` ask it before anything loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from salabatch.errors import JobSpecError, JobValidationError
from salabatch.jobs.ingest.documents import DEFAULT_SUFFIXES, DocumentSource, expand_sources
from salabatch.jobs.spec.errors import Loc, error_lines, render_loc
from salabatch.jobs.spec.job_yaml import (
    apply_override,
    line_of,
    parse_yaml,
    read_job_file,
)
from salabatch.jobs.spec.models import JobSpec, slug
from salabatch.models import hub_repo


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
    data, root, errors = parse_yaml(read_job_file(path), path)
    set_paths, override_errors = _command_line(data, overrides, requests, output)
    errors += override_errors

    def note(loc: Loc) -> str:
        if any(tuple(str(p) for p in loc[: len(s)]) == s for s in set_paths):
            return " (from the command line)"
        line = line_of(root, loc)
        return f" (line {line})" if line else ""

    base_dir = Path(path).expanduser().absolute().parent
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as e:
        raise JobValidationError(path, [*errors, *error_lines(e, JobSpec, note=note)]) from None
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
        raise JobValidationError(path, error_lines(e, JobSpec)) from None


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


# ---- what the disk lacks -----------------------------------------------------------------------


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
    for file in files:  # only a file named directly can have an unknown type
        if file.format is None:
            where = render_loc(("documents", sources.index(file.source), "path"))
            kind = file.path.suffix or "(none)"
            problems.append(
                f"{where}: unsupported file type {kind} (supported: {' '.join(DEFAULT_SUFFIXES)}, "
                "text files such as .rst .html .py; or give the entry a format: text, pdf or "
                "jsonl)"
            )
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
