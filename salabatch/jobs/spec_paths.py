"""What a job names but the disk lacks: the model folder, the requests file, the output path,
the documents' paths and globs. Kept apart from the models so a spec loads on any machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from salabatch.errors import JobSpecError
from salabatch.jobs.documents import SUPPORTED_SUFFIXES, DocumentSource, expand_sources
from salabatch.jobs.job_yaml import render_loc
from salabatch.models import hub_repo

if TYPE_CHECKING:
    from salabatch.jobs.spec import JobSpec


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
