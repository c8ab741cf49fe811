"""The job file as text: YAML read with its line numbers, keys given twice, `--set` overrides.

`load.load_job` reads a job with these: `parse_yaml` keeps the node tree so each validation
message can name its line (`line_of`); safe_load silently keeps the last of two equal keys, and
a double-quoted `"\ud800"` reads as a lone surrogate no tokenizer or Parquet file takes, so
`parse_yaml` reports both (`tree_problems`, on the tree as written: constructing the data
merges `<<` keys into it); `apply_override` edits the parsed data before validation.
`read_yaml`, the YAML part of `parse_yaml`, also reads the answer key of `inspect --expected`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from salabatch.errors import JobSpecError, not_utf8
from salabatch.jobs.spec.errors import Loc, render_loc, show_value

_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    """The safe loader with YAML 1.2's numbers, as people write them: `1e-3` is a float, `010`
    the integer 10 (`0o10` octal, `0x10` hex), `1_000` and `1:30` text. PyYAML's YAML 1.1
    rules read `1e-3` as text and `010` as 8, silently. A key written `on`, `no`, `~` is that
    text, not True, False or None (no field is named so: the error names the key as written;
    a JSON schema's property may be)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag in _KEY_AS_TEXT and not key.style:
                key.tag = _STR
        return super().construct_mapping(node, deep)


_STR = "tag:yaml.org,2002:str"
_KEY_AS_TEXT = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:null")


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    value = loader.construct_scalar(node)
    return int(value, 0) if value.lstrip("+-")[:2] in ("0o", "0x") else int(value, 10)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
_Loader.add_constructor(_INT, _construct_int)


class _TextLoader(yaml.SafeLoader):
    """The safe loader with every plain scalar but null read as the text written: an answer
    key's `010`, `1.50` or `yes` is that text, not 10, 1.5 or True."""


_TextLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag == "tag:yaml.org,2002:null"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def read_job_file(path: str | Path) -> str:
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


def parse_yaml(text: str, path: str | Path) -> tuple[dict[str, Any], yaml.Node, list[str]]:
    """(data, node tree, problems) of a job file: the tree keeps line numbers for the error
    messages; each key given twice in one mapping, and each text UTF-8 cannot hold, is one
    `location: message` line."""
    data, root, problems = read_yaml(text, path)
    if data is None or root is None:
        raise JobSpecError("job file is empty (expected name:, model:, documents:, …)", path=path)
    if not isinstance(data, dict):
        got = "a list" if isinstance(data, list) else show_value(data)
        raise JobSpecError(
            f"expected a mapping (name:, model:, …) at the top, got {got}", path=path
        )
    return _names_as_written(data, root), root, problems


def _names_as_written(data: dict[str, Any], root: yaml.Node) -> dict[str, Any]:
    """`data` with the job's name, and each question's id (or the whole question, a plain
    scalar), as written where YAML read a number: `name: 007` names `007`, not `7`; `id: 1e3`
    is `1e3`, not `1000.0`."""
    places: list[Loc] = [("name",)]
    questions = data.get("questions")
    if isinstance(questions, list):
        for i, question in enumerate(questions):
            places.append(
                ("questions", i, "id") if isinstance(question, dict) else ("questions", i)
            )
    for loc in places:
        steps = _walk(root, loc)
        node = steps[-1][1] if len(steps) == len(loc) else None  # None: a merge gave it, say
        if isinstance(node, yaml.ScalarNode) and node.tag in (_INT, _FLOAT) and not node.style:
            *at, last = loc
            holder: Any = data
            for part in at:
                holder = holder[part]
            holder[last] = node.value
    return data


def read_yaml(
    text: str, path: str | Path, *, as_text: bool = False
) -> tuple[Any, yaml.Node | None, list[str]]:
    """(data, node tree or None when empty, `tree_problems`) of one YAML document read by the
    safe loader, numbers as YAML 1.2 reads them (`as_text`: every plain scalar but null as
    text). Raises JobSpecError naming `path` and the line for text that is not YAML, a
    control character included (the loader refuses those before it reads a line)."""
    problems: list[str] = []
    try:
        loader = (_TextLoader if as_text else _Loader)(text)
    except yaml.YAMLError as e:
        raise JobSpecError(_yaml_problem(e, text), path=path) from None
    try:
        root = loader.get_single_node()
        if root is not None:
            # Before constructing: that flattens merge keys (`<<: *q`) into the tree, where a
            # merged key and the mapping's own override of it would look like a duplicate.
            problems = tree_problems(root)
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        raise JobSpecError(_yaml_problem(e, text), path=path) from None
    finally:
        loader.dispose()
    return data, root, problems


def _yaml_problem(e: yaml.YAMLError, text: str) -> str:
    """A YAML error on one line, with its line and column."""
    if isinstance(e, yaml.reader.ReaderError):
        # The reader refuses control characters before it reads a line: it gives an offset.
        line = text.count("\n", 0, e.position) + 1
        column = e.position - text.rfind("\n", 0, e.position)
        char = e.character if isinstance(e.character, int) else ord(e.character)
        return (
            f"invalid YAML at line {line}, column {column}: character U+{char:04X} is not "
            f'allowed; in a double-quoted string write it as "\\u{char:04x}"'
        )
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and start and (not mark or start.line != mark.line):
        problem += f" ({context} at line {start.line + 1})"
    return f"invalid YAML{where}: {problem}"


def line_of(root: yaml.Node, loc: Loc) -> int | None:
    """1-based line of `loc` in the YAML tree, or of its deepest part present (a missing field
    points at the mapping that lacks it); None for the top level."""
    steps = _walk(root, loc)
    return steps[-1][0] if steps else None


def _walk(root: yaml.Node, loc: Loc) -> list[tuple[int, yaml.Node]]:
    """(1-based line, node) of each part of `loc` the YAML tree as written holds, in order, up
    to the first it lacks (a mapping key's line is its key's)."""
    node, steps = root, []
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((kv for kv in node.value if kv[0].value == str(part)), None)
            if match is None:
                break
            steps.append((match[0].start_mark.line + 1, match[1]))
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            steps.append((node.value[part].start_mark.line + 1, node.value[part]))
        else:
            break
        node = steps[-1][1]
    return steps


def tree_problems(node: yaml.Node, loc: Loc = (), seen: set[int] | None = None) -> list[str]:
    """Keys given twice in one mapping (safe_load silently keeps the last one) and texts UTF-8
    cannot hold, each with its line."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias: checked where its anchor is
        return []
    seen.add(id(node))
    errors: list[str] = []
    if isinstance(node, yaml.ScalarNode) and (bad := not_utf8(node.value, from_bytes=False)):
        line = node.start_mark.line + 1
        errors.append(f"{render_loc(loc)}: not text UTF-8 can hold ({bad}) (line {line})")
    elif isinstance(node, yaml.MappingNode):
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
            errors += tree_problems(value, (*loc, str(name)), seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            errors += tree_problems(item, (*loc, index), seen)
    return errors


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
        value = yaml.load(raw, Loader=_Loader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as e:
        if structured:
            raise fail(f"invalid YAML value: {getattr(e, 'problem', None) or e}") from None
        return raw
    if structured or raw.lstrip()[:1] in ("'", '"'):
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return raw  # plain text: YAML would cut `#...` comments or read `a: b` as a mapping
