"""No import circles in the package: two modules that import each other, directly or through
others, are one concept cut in two (STYLE.md, house habit 15).

Every module is parsed (never imported), and every import counts wherever it stands: at the top,
inside a function (deferred) or under `if TYPE_CHECKING:`. `from pkg import name` is an edge to
the module `pkg.name` when there is one, else to `pkg`; relative imports are resolved. A package's
`__init__` counts only where it is named, not as the parent of every submodule imported (Python
runs it first, but a package that imports its own submodules is the usual shape, not a circle).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from tests import REPO


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `root / package`."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def imported(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the module `name` (its file `path`) imports anywhere."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_known(alias.name, modules))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from ..x import y`: relative to this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else _known(base, modules))
    found.discard("")
    found.discard(name)
    return found


def _known(dotted: str, modules: set[str]) -> str:
    """The longest leading part of `dotted` that is one of `modules` ("" for none)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return ""


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    files = module_files(root, package)
    return {name: imported(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as a path that
    starts and ends at the same module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(_circle(graph, set(c)) for c in components)


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    first = min(component)
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == first:
                    return [*paths[node], first]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {first}")  # a component always has one


def test_the_package_has_no_import_circle():
    graph = import_graph(REPO, "salabatch")
    assert len(graph) > 50 and graph["salabatch.jobs.run.runner"]  # the parse found the tree
    found = [" -> ".join(circle) for circle in cycles(graph)]
    assert not found, "import circles (merge the modules, or move what both need down):\n" + (
        "\n".join(found)
    )


def test_the_engine_knows_no_job_cli_or_demo_model():
    graph = import_graph(REPO, "salabatch")
    above = ("salabatch.jobs", "salabatch.cli", "salabatch.demo", "salabatch.models")
    for name, targets in graph.items():
        if name.startswith("salabatch.engine"):
            assert not {t for t in targets if t.startswith(above)}, name


def test_circles_of_any_length_and_import_kind_are_found(tmp_path):
    """The checker itself, on a package whose circles hide in every way an import can."""
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from .sub.c import g\n",  # deferred and relative
        "sub/__init__.py": "",
        "sub/c.py": textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                import pkg.a
            """
        ),
        "d.py": "from pkg.e import x\n",
        "e.py": "from . import d\n",
        "ok.py": "import pkg.a\nfrom pkg import sub\n",  # into the circles, not part of one
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.e"] == {"pkg.d"}
    assert graph["pkg.ok"] == {"pkg.a", "pkg.sub"}
    assert cycles(graph) == [
        ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"],
        ["pkg.d", "pkg.e", "pkg.d"],
    ]
