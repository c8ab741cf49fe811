"""Reading a job file: YAML with the safe loader, `--set` overrides, errors with line numbers.

`load_job(path, overrides)` reads a job file, applies `--set key=value` overrides, validates it
(paths resolve against the job file's folder) and raises one `JobValidationError` (a
JobSpecError, exit code 2) listing every mistake, each with its YAML line or "(from the command
line)". `requests_job` builds a job for `salabatch run --requests FILE` without a job file, and
`validate_command` is `salabatch validate`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import ValidationError

from salabatch.errors import JobSpecError
from salabatch.jobs.spec import (
    CROSS_FIELD_ERROR,
    JobSpec,
    Loc,
    job_problems,
    render_loc,
    show_value,
    slug,
    with_defaults,
)
from salabatch.jobs.spec_check import (
    JobValidationError,
    check_paths,
    format_validation_error,
    path_problems,
)


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
    every mistake) for one that does not validate.
    """
    text = _read_job_file(path)
    data, root = _parse_yaml(text, path)
    errors = _duplicate_keys(root)

    set_paths: list[tuple[str, ...]] = []
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

    def note(loc: Loc) -> str:
        if any(tuple(str(p) for p in loc[: len(s)]) == s for s in set_paths):
            return " (from the command line)"
        line = _line_of(root, loc)
        return f" (line {line})" if line else ""

    base_dir = Path(path).expanduser().absolute().parent
    spec = None
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as e:
        errors += format_validation_error(e, note=note)
        if not any(err["type"] == CROSS_FIELD_ERROR for err in e.errors()):
            # Field errors stop the cross-field checks; run them on the raw data so one
            # `validate` shows everything.
            errors += [f"{render_loc(loc)}: {msg}{note(loc)}" for loc, msg in _raw_problems(data)]
    if errors:
        raise JobValidationError(path, errors)
    assert spec is not None
    if check_files and (problems := check_paths(spec)):
        raise JobValidationError(path, problems)
    return spec


def requests_job(
    requests: str | Path, model: str | None = None, overrides: Sequence[str] = ()
) -> JobSpec:
    """A job for `salabatch run --requests FILE` without a job file: named after the file, the
    model from `model` or else the one model every request names; results under ./results."""
    path = Path(os.path.expanduser(requests)).absolute()
    if model is None:
        names = set()
        try:
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    body = json.loads(line).get("body") or {}
                    names.add(body.get("model"))
        except (OSError, ValueError, AttributeError) as e:
            raise JobSpecError(
                f"cannot read the model from the requests ({e})", path=path
            ) from None
        names.discard(None)
        if len(names) != 1:
            raise JobSpecError(
                "give --model: the requests name "
                + (f"several models ({', '.join(sorted(map(str, names)))})" if names else "none"),
                path=path,
            )
        model = names.pop()
    data: dict[str, Any] = {
        "name": slug(path.stem) or "requests",
        "model": model,
        "requests": str(path),
    }
    for override in overrides:
        apply_override(data, override)
    try:
        return JobSpec.model_validate(data, context={"base_dir": Path.cwd()})
    except ValidationError as e:
        raise JobValidationError(path, format_validation_error(e)) from None


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


def _raw_problems(data: dict[str, Any]) -> list[tuple[Loc, str]]:
    """`job_problems` of unvalidated data (ids filled in as JobSpec does)."""
    filled = with_defaults(data)
    questions = filled.get("questions")
    questions = questions if isinstance(questions, list) else []
    ids = [(i, q["id"]) for i, q in enumerate(questions) if isinstance(q, dict) and "id" in q]
    ids = [(i, str(qid)) for i, qid in ids if isinstance(qid, (str, int)) and qid != ""]
    return job_problems(
        bool(filled.get("documents")),
        bool(questions),
        filled.get("requests") is not None,
        ids,
    )


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


# ---- salabatch validate --------------------------------------------------------------------------


def validate_command(path: str, overrides: Sequence[str] = (), *, check_files: bool = True) -> int:
    """`salabatch validate JOB.yaml [--set k=v]... [--schema-only]`: print a summary of the job
    and return 0, or print every mistake (`error: job.yaml: …`, one per line) and return 2.

    check_files: also check that documents, model and requests exist (`check_paths`).
    """
    try:
        spec = load_job(path, overrides)
        problems, n_files = path_problems(spec) if check_files else ([], None)
        if problems:
            raise JobValidationError(path, problems)
    except JobSpecError as e:
        click.echo(f"error: {e}", err=True)
        return e.exit_code

    entries = len(spec.documents)
    found = f", {n_files} file{'s' * (n_files != 1)}" if n_files is not None and entries else ""
    ids = [q.id for q in spec.questions]
    shown = ", ".join(ids[:10]) + (", …" if len(ids) > 10 else "")
    rows = {
        "name": spec.name,
        "model": spec.model,
        "documents": f"{entries} entr{'y' if entries == 1 else 'ies'}{found}",
        "questions": f"{len(ids)}" + (f": {shown}" if ids else ""),
        "requests": str(spec.requests) if spec.requests else "none",
        "output": str(spec.output.path),
    }
    click.echo(f"{path}: ok")
    for key, value in rows.items():
        click.echo(f"  {key:10s} {value}")
    return 0
