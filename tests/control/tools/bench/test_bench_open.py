"""The benchmark's open engine is reachable from the benchmark only.

``control.tools.bench.open_peer.OpenService`` serves without governance (no revocation or release
checks, no ledger, no watcher) so that ``bench engine`` can measure what governance costs. These
tests hold the line around it: the committed model repository's engine model builds the governed
service; only the bench imports the open engine and only it builds derived repositories;
``serve`` and ``triton-host`` launch the committed repository whatever their options and
environment say; and the switch that once turned governance off in production is gone.
No benchmark numbers are asserted here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from backend.serving.service import IncomingRequest, LoraService
from backend.triton.glue import TritonGlue
from control.app.registry import Registry
from control.app.serving_steps import RegistrySteps
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, Outcome
from control.contracts.tickets import TicketSigner
from control.contracts.wire import ENGINE_MODEL, TICKET_PARAM
from control.gateway.ticket_office import TicketOffice
from control.ops.triton_server import (
    MODEL_REPOSITORY,
    REPO_ROOT,
    TritonInstall,
    TritonProcess,
    free_ports,
)
from control.tools.bench.open_peer import (
    OpenGlue,
    OpenService,
    open_engine_model_source,
    open_repository,
)
from projections.routing import RoutingView
from tests.integration.conftest import ACTOR, provision

PRODUCTION_PACKAGES = ("backend", "control", "projections", "model_repository")
# The only production-tree importers allowed for each bench-only module.
ALLOWED_IMPORTERS = {
    "control.tools.bench.open_peer": {"control/tools/bench/engine.py"},
    "control.ops.model_repositories": {"control/tools/bench/open_peer.py"},
    "control.tools.bench.engine": {"control/cli/benches.py"},
}
# Split so that this file does not itself carry the name it searches for.
OLD_SWITCH = "LORAPLANE_BENCH_" + "UNGOVERNED"


def _sources(*roots: str) -> Iterator[tuple[str, str]]:
    for root in roots:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            yield path.relative_to(REPO_ROOT).as_posix(), path.read_text()


def _imported_modules(source: str) -> set[str]:
    """Every module a source imports, at any depth: import statements, from-imports (with
    ``from backend import bench_open`` counted as ``control.tools.bench.open_peer``), and
    ``importlib.import_module``/``__import__`` calls with a literal name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


# -- static: who can reach the open engine ---------------------------------------------------

def test_only_the_bench_imports_the_open_engine_and_derived_repositories() -> None:
    importers: dict[str, set[str]] = {module: set() for module in ALLOWED_IMPORTERS}
    for path, source in _sources(*PRODUCTION_PACKAGES):
        for module in _imported_modules(source) & set(ALLOWED_IMPORTERS):
            importers[module].add(path)
    assert importers == {m: allowed & importers[m] for m, allowed in ALLOWED_IMPORTERS.items()}
    assert importers["control.tools.bench.open_peer"] == {"control/tools/bench/engine.py"}


def test_committed_engine_model_builds_the_governed_glue() -> None:
    source = (MODEL_REPOSITORY / ENGINE_MODEL / "1" / "model.py").read_text()
    imports = _imported_modules(source)
    assert "backend.triton.glue.TritonGlue" in imports
    assert not any("bench" in m for m in imports)
    assert "OpenGlue" not in source and "OpenService" not in source


def test_open_repository_differs_from_the_committed_one_in_the_engine_glue_only(
        tmp_path: Path) -> None:
    repo = open_repository(tmp_path / "open")
    committed = sorted(p.relative_to(MODEL_REPOSITORY) for p in MODEL_REPOSITORY.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    derived = sorted(p.relative_to(repo) for p in repo.rglob("*") if p.is_file())
    assert derived == committed
    engine_model = Path(ENGINE_MODEL, "1", "model.py")
    for rel in committed:
        if rel != engine_model:
            assert (repo / rel).read_bytes() == (MODEL_REPOSITORY / rel).read_bytes(), rel
    assert (repo / engine_model).read_text() == open_engine_model_source()
    assert "control.tools.bench.open_peer.OpenGlue" in _imported_modules(open_engine_model_source())


def test_the_old_governance_switch_is_gone_from_code_images_and_tests() -> None:
    roots = (*PRODUCTION_PACKAGES, "tests")
    mentions = [path for path, source in _sources(*roots) if OLD_SWITCH in source]
    mentions += [p.relative_to(REPO_ROOT).as_posix()
                 for p in sorted((REPO_ROOT / "docker").rglob("*"))
                 if p.is_file() and OLD_SWITCH in p.read_text(errors="replace")]
    assert mentions == []


# -- the services themselves -----------------------------------------------------------------

@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bench-open-home")
    settings = Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}")
    settings.ensure_dirs()
    reg, _kit, _keys, digests = provision(settings, kit_dir)
    signer, _ = TicketSigner.load_or_create(settings.keys_dir)
    reg.record_signing_key(signer.kid, signer.public_b64, actor=ACTOR)
    routing = RoutingView(make_engine(settings.db_url))
    return {"settings": settings, "registry": reg, "digests": digests,
            "base": routing.bases()[0].digest, "office": TicketOffice(settings, routing, signer)}


def _service(glue: type[TritonGlue], home: dict[str, Any], host: str,
             monkeypatch: pytest.MonkeyPatch) -> LoraService:
    """What ``glue``'s ``make_service`` builds, with the old switch set in the environment."""
    monkeypatch.setenv(OLD_SWITCH, "1")
    # make_service reads nothing of the instance; the rest of the glue needs a running Triton.
    return glue.make_service(object.__new__(glue), home["settings"], home["base"], host=host,
                             prefix_cache_bytes=0, steps=RegistrySteps)


def test_production_glue_serves_the_governed_service_whatever_the_environment(
        home: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    service = _service(TritonGlue, home, "governed-host", monkeypatch)
    try:
        assert type(service) is LoraService
    finally:
        service.close()


def test_open_service_skips_governance_and_ledger_the_governed_one_keeps_both(
        home: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Revoke an adapter, then ask both services for it with a ticket issued before: the
    governed one refuses it and records the refusal; the open one serves it and records
    nothing. This is why the open engine must stay out of every production path."""
    office: TicketOffice = home["office"]
    token = office.issue("globex", "globex-gamma").token
    ask = IncomingRequest(text="Hello", parameters={TICKET_PARAM: token}, max_tokens=4)
    reg: Registry = home["registry"]
    reg.revoke(home["digests"]["gamma"], "bench-open test", actor=ACTOR)
    ledger = Ledger(make_engine(home["settings"].db_url))

    governed = _service(TritonGlue, home, "governed-host", monkeypatch)
    opened = _service(OpenGlue, home, "open-host", monkeypatch)
    try:
        assert isinstance(opened, OpenService)
        [refused] = governed.handle([ask])
        [served] = opened.handle([ask])
        assert not refused.ok and refused.outcome == Outcome.REJECTED
        assert served.ok and served.adapter_digest == home["digests"]["gamma"]
        # the same ticket again: remembered, not verified afresh, still served
        [again] = opened.handle([ask])
        assert again.ok and again.text == served.text
    finally:
        governed.close()
        opened.close()
    rows = ledger.query()
    assert [r.reason for r in rows if r.host == "governed-host"] == ["revoked"]
    assert [r for r in rows if r.host == "open-host"] == []


# -- what serve and triton-host launch ---------------------------------------------------------

LAUNCHED: list[TritonProcess] = []


class _RecordedTriton(TritonProcess):
    """A TritonProcess that records what it would launch (in LAUNCHED) instead of launching."""

    def start(self) -> None:
        LAUNCHED.append(self)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        pass


@pytest.mark.parametrize("verb", ["serve", "triton-host"])
def test_serve_and_triton_host_cannot_be_told_another_repository(
        verb: str, home: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import control.cli.main
    import control.cli.ops
    import control.ops.serve

    command = next(c for c in control.cli.main.app.registered_commands if c.name == verb)
    assert command.callback is not None
    options = list(command.callback.__annotations__)
    assert not [o for o in options if "repo" in o or "model" in o], options

    started: list[Any] = []

    def run_briefly(dep: Any) -> None:
        started.append(dep)
        try:
            dep.start()
        finally:
            dep.stop()

    LAUNCHED.clear()
    monkeypatch.setattr(control.ops.serve, "TritonProcess", _RecordedTriton)
    monkeypatch.setattr(control.cli.ops, "run_until_stopped", run_briefly)  # serve's too
    settings: Settings = home["settings"]
    free = free_ports(4)
    ports = ["--http-port", str(free[0]), "--grpc-port", str(free[1]),
             "--metrics-port", str(free[2])]
    if verb == "serve":
        ports += ["--gateway-port", str(free[3])]
    env = {"LORAPLANE_HOME": str(settings.home), "LORAPLANE_DB_URL": settings.db_url,
           OLD_SWITCH: "1", "LORAPLANE_MODEL_REPOSITORY": str(settings.home)}
    result = CliRunner().invoke(control.cli.main.app, [verb, *ports], env=env)
    assert result.exit_code == 0, result.output
    [dep] = started
    assert dep.model_repository is None
    [triton] = LAUNCHED
    assert triton.model_repository == MODEL_REPOSITORY
    argv = triton.command(TritonInstall(Path("tritonserver"), Path("backends")))
    assert f"--model-repository={MODEL_REPOSITORY}" in argv


def test_median_interval_is_the_sign_test_interval() -> None:
    from control.tools.bench.engine import median_interval

    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0, 1 - 2 / 32)
    low, high, coverage = median_interval([float(x) for x in range(15, 0, -1)])
    assert (low, high) == (4.0, 12.0) and 0.96 < coverage < 0.97
