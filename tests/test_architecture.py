"""The import rules the layout rests on (README, "Architecture"), beyond what ``lint-imports``
checks between layers: no module of control/, projections/ or backend/ reaches itself through its
imports, a project import deferred into a function says why on its line or the one above, and no
class is over 300 lines but the few listed with their reasons.

The import graph is grimp's (import-linter's own), with imports under ``TYPE_CHECKING`` included:
a cycle only the type checker sees is still a cycle in the design.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import grimp

from tests import REPO

PACKAGES = ("control", "projections", "backend")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    work: list[tuple[str, Iterator[str]]] = []  # the depth-first path, each with its children

    def enter(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        work.append((v, iter(sorted(graph.find_modules_directly_imported_by(v)))))

    for root in sorted(graph.modules):
        if root in index:
            continue
        enter(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    enter(w)
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(m)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph) == [["a.x", "a.y", "a.z"]]


def test_no_module_imports_itself_round_a_cycle() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def _deferred_project_imports(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line, source line, line above) of each project import inside a function body."""
    source = path.read_text()
    lines = source.splitlines()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.split(".")[0] in PACKAGES for n in names):
                yield node.lineno, "\n".join(lines[node.lineno - 1:node.end_lineno]), _above(
                    lines, node.lineno - 1)


def _above(lines: list[str], at: int) -> str:
    """The comment heading the run of imports (and blank lines) above line ``at`` (0-based)."""
    i = at - 1
    while i >= 0 and (not lines[i].strip() or lines[i].lstrip().startswith(("from ", "import "))):
        i -= 1
    return lines[i] if i >= 0 else ""


def test_every_deferred_project_import_says_why() -> None:
    unexplained = [
        f"{path.relative_to(REPO)}:{line}: {text.strip()}"
        for package in (*PACKAGES, "model_repository")
        for path in sorted((REPO / package).rglob("*.py"))
        for line, text, above in _deferred_project_imports(path)
        if "#" not in text and not above.strip().startswith("#")
    ]
    assert unexplained == [], "imports inside functions need a one-line reason:\n" + "\n".join(
        unexplained)


# A class over this many lines is a room to split (issue 22): its collaborators get modules of
# their own, typed against protocols rather than the class, so no cycle comes back.
MAX_CLASS_LINES = 300
# The justified exceptions, each with why. An event-sourced aggregate declares its events as
# nested classes and applies each in an ``@event`` method on the aggregate itself (the
# eventsourcing library's model): the events and their rules are one unit, and splitting them
# across classes would scatter the invariants the aggregate exists to keep together.
BIG_CLASSES = {
    "control/domain/rollout.py::Rollout": "aggregate: 11 nested events and their rules",
    "control/domain/adapter.py::Adapter": "aggregate: 11 nested events and their rules",
}


def _class_lengths() -> dict[str, int]:
    """``path::Class`` -> lines (decorators through the last line) of every class, nested ones
    too, in the project's packages."""
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    assert node.end_lineno is not None
                    found[f"{path.relative_to(REPO)}::{node.name}"] = node.end_lineno - first + 1
    return found


def test_no_class_is_over_the_line_limit_but_the_listed_ones() -> None:
    lengths = _class_lengths()
    over = {name: n for name, n in lengths.items()
            if n > MAX_CLASS_LINES and name not in BIG_CLASSES}
    assert over == {}, f"classes over {MAX_CLASS_LINES} lines (split them): {over}"


def test_the_allow_list_names_only_classes_still_over_the_limit() -> None:
    """An exception outlives its reason silently unless it is checked: once a listed class is
    split (or gone), its entry must go, so the limit applies to it again."""
    lengths = _class_lengths()
    stale = sorted(name for name in BIG_CLASSES if lengths.get(name, 0) <= MAX_CLASS_LINES)
    assert stale == [], f"remove from BIG_CLASSES: {stale}"
