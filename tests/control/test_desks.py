"""The registry's desks (issue 22): commands live in one desk per concern, and every desk goes
through the registry's small public surface (``control.app.unit_of_work.UnitOfWork``), never
through a private attribute of the registry.

The privacy rule is checked on the source: every module of ``control/app`` except the
registry's own is parsed, and any ``_name`` attribute read off something that is the registry
(``registry._x``, ``reg._x``, ``self.registry._x``, ``self._registry._x``, a local bound to one
of those, a parameter typed as the registry or its surface, ``getattr(registry, "_x")``) is a
violation.
"""

from __future__ import annotations

import ast
import base64
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from control.app.registry import Delegate, Registry
from control.contracts.config import Settings
from tests import REPO
from tests.fixtures_control import close_registry, sqlite_settings

APP = REPO / "control" / "app"
# What a desk may call the registry it is given (its parameters' annotations name these).
REGISTRY_TYPES = ("Registry", "UnitOfWork", "Records")
REGISTRY_NAMES = frozenset({"registry", "reg"})
REGISTRY_ATTRS = frozenset({"registry", "_registry"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _annotated_as_registry(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation)  # a string annotation unparses with its quotes
    return any(re.search(rf"\b{t}\b", text) for t in REGISTRY_TYPES)


def registry_private_accesses(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: expression`` for each private attribute read off the registry in
    ``source``."""
    tree = ast.parse(source, filename)
    names = set(REGISTRY_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            every = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            names.update(a.arg for a in every if _annotated_as_registry(a.annotation))

    def is_registry(expr: ast.expr) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in names
        return isinstance(expr, ast.Attribute) and expr.attr in REGISTRY_ATTRS

    # Locals bound to the registry (``reg = self.registry``), to a fixed point.
    while True:
        more = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AnnAssign)
                and node.value is not None and is_registry(node.value)
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)} - names
        if not more:
            break
        names |= more
    def reaches_in(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return _private(node.attr) and is_registry(node.value)
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                and is_registry(node.args[0]) and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _private(node.args[1].value))

    found = sorted((node.lineno, ast.unparse(node)) for node in ast.walk(tree)
                   if isinstance(node, ast.expr) and reaches_in(node))
    return [f"{filename}:{line}: {text}" for line, text in found]


def _desk_modules() -> list[Path]:
    return [p for p in sorted(APP.glob("*.py")) if p.name != "registry.py"]


def test_no_desk_reads_a_private_attribute_of_the_registry() -> None:
    modules = _desk_modules()
    assert {"tenants.py", "signing_keys.py", "catalogue.py", "lifecycle.py", "revocation.py",
            "aliases.py", "rollouts.py", "upgrades.py", "gate_desk.py",
            "sessions.py"} <= {p.name for p in modules}
    found = [v for p in modules
             for v in registry_private_accesses(p.read_text(), str(p.relative_to(REPO)))]
    assert found == [], "desks go through the registry's public surface:\n" + "\n".join(found)


def test_the_check_finds_every_way_of_reaching_in() -> None:
    """Each form the desks used before the split (22 reads then) is caught; public reads and
    the desks' own private helpers are not."""
    source = '''
class Desk:
    def __init__(self, registry, clock):
        self.registry = registry
        self._registry = registry
        self._clock = clock

    def a(self):
        self.registry._save(x, what="y")          # 1
        self._registry._get(Rollout, rid, "r")    # 2
        reg = self.registry
        reg._target_release(t, actor)             # 3
        here = reg
        here._exists(rid)                         # 4
        getattr(self.registry, "_follow")         # 5
        self.registry.commit(x, what="y")
        self._clock()
        self._helper()
        reg.__class__

def f(r: Registry, records: "UnitOfWork", other):
    r._release_servable(x)                        # 6
    records._base_info                            # 7
    registry._new_release(m, a)                   # 8
    other._private()
'''
    found = registry_private_accesses(source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "self.registry._save", "self._registry._get", "reg._target_release", "here._exists",
        "getattr(self.registry, '_follow')", "r._release_servable", "records._base_info",
        "registry._new_release"], found


def test_module_and_class_sizes() -> None:
    """registry.py under 600 lines and every class of control/app under 300."""
    assert len((APP / "registry.py").read_text().splitlines()) < 600
    big = []
    for path in sorted(APP.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None \
                    and node.end_lineno - node.lineno + 1 > 300:
                big.append(f"{path.name}:{node.name}: {node.end_lineno - node.lineno + 1}")
    assert big == []


def test_pin_is_the_domain_s_and_still_importable_from_sessions() -> None:
    from control.app.sessions import Pin as FromSessions
    from control.domain import Pin
    from control.domain.session import Pin as FromModule

    assert FromSessions is Pin is FromModule
    pin = Pin(tenant="acme", alias="chat", session="s1", release="r", expires_at=10.0,
              version=1)
    assert pin.key == ("acme", "chat", "s1") and pin.holds(9.0) and not pin.holds(10.0)


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    s = sqlite_settings(tmp_path / "home")
    s.ensure_dirs()
    yield s


@pytest.fixture
def registry(settings: Settings) -> Iterator[Registry]:
    from projections.follower import open_registry

    reg = open_registry(settings)
    yield reg
    close_registry(reg)


def test_every_historical_command_is_its_desk_s(registry: Registry) -> None:
    """``registry.NAME`` is the desk's bound command, with its docstring: the names callers
    outside control/app use keep working, and there is one implementation of each."""
    delegates = {n: d for n, d in vars(Registry).items() if isinstance(d, Delegate)}
    assert len(delegates) >= 25
    for name, delegate in delegates.items():
        desk = getattr(registry, delegate.desk)
        bound = getattr(registry, name)
        assert bound.__self__ is desk and bound.__func__ is getattr(type(desk), name), name
        assert delegate.__doc__ and delegate.__doc__ == getattr(type(desk), name).__doc__
    # The signing-key commands live on their own desk (the root of trust's home).
    assert registry.rotate_signing_key.__self__ is registry.signing_keys  # type: ignore[attr-defined]


def test_a_command_through_its_desk_and_through_the_registry_records_the_same(
        registry: Registry) -> None:
    """Both spellings run one command: each records one event through the unit of work, the
    projection shows both keys, and a second record of one kid is refused with nothing
    recorded."""
    key_a = base64.b64encode(b"a" * 32).decode()
    key_b = base64.b64encode(b"b" * 32).decode()
    top = registry.recorder.max_notification_id() or 0
    first = registry.record_signing_key("kid-a", key_a, actor="ops")
    second = registry.signing_keys.record_signing_key("kid-b", key_b, actor="ops")
    assert (first, second) == (top + 1, top + 2)
    assert registry.follower.routing().signing_keys() == {"kid-a": key_a, "kid-b": key_b}
    from control.domain import AlreadyExists

    with pytest.raises(AlreadyExists, match="kid-a"):
        registry.signing_keys.record_signing_key("kid-a", key_b, actor="ops")
    assert registry.recorder.max_notification_id() == top + 2
