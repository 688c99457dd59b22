"""A base-model upgrade planned through the real tritonserver: the kit's alpha, beta and gamma,
stable on the kit's base, gated on ``base-v2`` (the main base further trained) by a shadow
engine, while tenants keep calling the live deployment.

Asserted: the matrix (alpha and beta pass on the new base and get a release there; gamma fails
its golden tasks there and stays on its old combination, nothing of it moving); that no tenant
ticket reached the shadow engine (every ledger row of the shadow host is one of the gate's
requests, and every tenant request of the run landed on the live host); that the shadow host is
gone afterwards; that an alias moves to its new-base release and back with the existing
commands; and that ``base-b`` (another hidden size) is incompatible for all three, with no
shadow engine started for it.

Runs on a deployment of its own: it registers more bases, which the shared stack's tests do not
expect.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from control.app.gate_desk import GateDesk
from control.app.registry import Registry
from control.contracts.golden import GoldenSet
from control.contracts.ledger import Ledger, Outcome
from control.domain import CellVerdict, PlanStatus
from control.ops.clients import TritonRefused, free_port, infer_with, request_ticket
from control.ops.gate import GateTarget
from control.ops.kit import KitManifest
from control.ops.serve import Deployment, Ports
from control.ops.upgrade import PlanResult, plan_upgrade
from tests.integration.conftest import ACTOR, ROUTES, provision, sqlite_home

pytestmark = pytest.mark.triton

FAMILIES = {"acme-alpha": "alpha", "acme-beta": "beta", "globex-gamma": "gamma"}


@dataclass
class World:
    registry: Registry
    deployment: Deployment
    kit_dir: Path
    kit: KitManifest
    keys: dict[str, str]
    digests: dict[str, str]
    bases: dict[str, str] = field(default_factory=dict)

    @property
    def target(self) -> GateTarget:
        triton = self.deployment.triton
        assert triton is not None
        return GateTarget(self.registry.settings, triton.http_url, triton.grpc_url,
                          f"http://127.0.0.1:{self.deployment.ports.metrics}/metrics",
                          base=self.bases["base"])


@pytest.fixture(scope="module")
def world(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    kit = KitManifest.load(kit_dir)
    if not kit.base_v2_path:
        pytest.skip("the kit predates base-v2: rebuild it (loraplane kit build)")
    settings = sqlite_home(tmp_path_factory, "upgrade")
    reg, kit, keys, digests = provision(settings, kit_dir)
    desk = GateDesk(reg)
    for family in FAMILIES.values():
        golden = GoldenSet.load(kit_dir / kit.golden[family].path)
        desk.record_golden_set(digests[family], golden, actor=ACTOR)
    bases = {"base": kit.base_digest}
    for name, path in (("base-v2", kit.base_v2_path), ("base-b", kit.base_b_path)):
        bases[name] = reg.register_base(kit_dir / path, kit_dir / kit.tokenizer_path,
                                        name=f"tiny-llama-{name}", actor=ACTOR)
    dep = Deployment(settings, Ports(free_port(), free_port(), free_port(), free_port()),
                     base=kit.base_digest, actor=ACTOR)
    dep.start()
    try:
        yield World(reg, dep, kit_dir, kit, keys, digests, bases)
    finally:
        dep.stop()


class TenantTraffic:
    """Tenants' requests through the gateway and the live host while the plan runs: the
    ticket ids they were issued, and the ledger must show each of them on the live host."""

    def __init__(self, w: World) -> None:
        self.w = w
        self.ticket_ids: list[str] = []
        self.answers = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import tritonclient.http as http  # the client library, as a tenant uses it

        assert self.w.deployment.triton is not None
        client = http.InferenceServerClient(self.w.deployment.triton.http_url)
        routes = [(t, a) for t, a, name in ROUTES if name is not None]
        i = 0
        while not self.stop.is_set():
            tenant, alias = routes[i % len(routes)]
            i += 1
            status, body = request_ticket(self.w.deployment.gateway_url, self.w.keys[tenant],
                                          alias)
            if status != 200:
                continue
            self.ticket_ids.append(_claims(str(body["ticket"]))["jti"])
            try:
                infer_with(client, "http", "Hello there", str(body["ticket"]), max_tokens=4)
                self.answers += 1
            except TritonRefused:
                pass
            self.stop.wait(0.3)
        client.close()

    def __enter__(self) -> TenantTraffic:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def _claims(ticket: str) -> dict[str, Any]:
    import base64

    body = ticket.split(".")[2]
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    return dict(json.loads(raw[:-64]))


@pytest.fixture(scope="module")
def planned(world: World) -> tuple[PlanResult, TenantTraffic]:
    with TenantTraffic(world) as traffic:
        result = plan_upgrade(world.target, world.bases["base-v2"], actor=ACTOR,
                              progress=lambda m: print("plan:", m))
    print(f"plan run: {result.seconds:.1f} s; tenant requests meanwhile: "
          f"{len(traffic.ticket_ids)} ({traffic.answers} answered)")
    for c in result.cells:
        print("cell:", json.dumps(c.to_json(), sort_keys=True))
    return result, traffic


def _cells(result: PlanResult, world: World) -> dict[str, Any]:
    by_digest = {c.adapter: c for c in result.cells}
    return {family: by_digest[world.digests[family]] for family in FAMILIES.values()}


def test_the_matrix_alpha_and_beta_pass_on_the_new_base_gamma_fails_and_stays(
        planned: tuple[PlanResult, TenantTraffic], world: World) -> None:
    result, _ = planned
    reg = world.registry
    assert result.plan.status == PlanStatus.RECORDED
    assert [c.adapter for c in result.cells] == result.plan.adapters
    assert set(result.plan.adapters) == set(world.digests.values())
    cells = _cells(result, world)
    assert {f: c.new.verdict for f, c in cells.items()} == {
        "alpha": CellVerdict.PASSED, "beta": CellVerdict.PASSED, "gamma": CellVerdict.FAILED}
    combination = GateDesk(reg).combination_on(world.bases["base-v2"])
    for cell in cells.values():
        adapter = reg.adapter(cell.adapter)
        report = GateDesk(reg).gate_report(cell.new.report or "")
        # each cell's report is the gate's, on the new combination, recorded on the adapter
        assert report["combination"] == {"base": combination.base,
                                         "tokenizer": combination.tokenizer,
                                         "template": combination.template}
        assert report["upgrade"]["replaces"] == cell.old.release == adapter.release
        assert report["upgrade"]["host"] == result.plan.shadow_host
        assert adapter.gate_reports[combination.key]["report"] == cell.new.report
        f = report["figures"]
        assert f["has_stable"] and f["stable_success_rate"] == cell.old.success_rate
        assert f["mismatch_refused"] == f["mismatch_tried"] == 8  # old-base tickets included
        assert f["misattributions"] == 0 and f["authorization_errors"] == 0
        assert cell.old.external  # the kit stack released them on external reports
        if cell.new.verdict == CellVerdict.PASSED:
            assert cell.new.success_rate is not None and cell.old.success_rate is not None
            assert cell.new.success_rate >= cell.old.success_rate
            release = reg.release_manifest(cell.new.release or "")
            assert (release.adapter_digest, release.base_digest) == (
                cell.adapter, world.bases["base-v2"])
            assert release.evaluation_report_digest == cell.new.report
    gamma = cells["gamma"]
    assert [line.split(":")[0] for line in gamma.new.failures] == ["success_rate"]
    assert gamma.new.success_rate is not None and gamma.old.success_rate is not None
    assert gamma.new.success_rate < gamma.old.success_rate
    # nothing of gamma moved: no release on the new base, its alias where it was
    assert gamma.new.release is None and not gamma.moves
    assert reg.alias("globex-gamma").stable == gamma.old.release
    for family, alias in (("alpha", "acme-alpha"), ("beta", "acme-beta")):
        assert reg.alias(alias).stable == cells[family].old.release  # the plan moves nothing


def test_no_tenant_ticket_reached_the_shadow_engine(
        planned: tuple[PlanResult, TenantTraffic], world: World) -> None:
    result, traffic = planned
    ledger = Ledger(world.registry.follower.engine)
    reports = [GateDesk(world.registry).gate_report(c.new.report or "") for c in result.cells]
    gate_tickets = {s["ticket_id"] for r in reports for s in r["requests"]}
    shadow = [r for r in ledger.query(since=result.shadow["started_at"] - 1)
              if r.host == result.plan.shadow_host]
    assert shadow, "the shadow host wrote no ledger row"
    # the gate's only: its tickets, or its mismatch tickets refused before verification
    assert {r.ticket_id for r in shadow if r.ticket_id} <= gate_tickets
    unverified = [r for r in shadow if r.ticket_id is None]
    assert all(r.outcome == Outcome.REJECTED and r.reason in ("base", "tokenizer")
               for r in unverified)
    assert len(unverified) == sum(1 for r in reports for s in r["requests"]
                                  if s["route"] in ("wrong_base", "wrong_tokenizer",
                                                    "old_base"))
    # the tenants' own requests meanwhile: every one of them on the live host
    assert len(traffic.ticket_ids) >= 3 and traffic.answers >= 3
    tenant_rows = [r for r in ledger.query(since=result.shadow["started_at"] - 5)
                   if r.ticket_id in set(traffic.ticket_ids)]
    assert tenant_rows and {r.host for r in tenant_rows} == {socket.gethostname()}
    assert not set(traffic.ticket_ids) & gate_tickets


def test_the_shadow_host_is_gone_afterwards(planned: tuple[PlanResult, TenantTraffic]) -> None:
    result, _ = planned
    shadow = result.shadow
    assert shadow["started"] and shadow["stopped"] is True
    assert shadow["stopped_at"] >= shadow["ready_at"] >= shadow["started_at"]
    for address in (shadow["http"], shadow["grpc"]):
        host, port = address.rsplit(":", 1)
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(1.0)
            s.connect((host, int(port)))
    recorded = result.plan.shadow
    assert recorded["host"] == result.plan.shadow_host and recorded["stopped"] is True


def test_a_passing_alias_moves_to_the_new_base_and_back_with_the_existing_commands(
        planned: tuple[PlanResult, TenantTraffic], world: World) -> None:
    result, _ = planned
    reg = world.registry
    alpha = _cells(result, world)["alpha"]
    gateway, key = world.deployment.gateway_url, world.keys["acme"]
    assert reg.point_alias("acme-alpha", alpha.new.release or "", actor=ACTOR)
    try:
        deadline = time.monotonic() + 5
        while True:  # the gateway's routing sees the move within its refresh interval
            status, body = request_ticket(gateway, key, "acme-alpha")
            claims = _claims(str(body["ticket"])) if status == 200 else {}
            if claims.get("base") == world.bases["base-v2"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert claims["release"] == alpha.new.release and claims["adapter"] == alpha.adapter
    finally:
        assert reg.rollback("acme-alpha", actor=ACTOR) == alpha.old.release


def test_a_base_of_another_shape_is_incompatible_and_starts_no_shadow(world: World) -> None:
    result = plan_upgrade(world.target, world.bases["base-b"], actor=ACTOR)
    assert result.shadow == {"host": result.plan.shadow_host, "started": False}
    assert {c.new.verdict for c in result.cells} == {CellVerdict.INCOMPATIBLE}
    for c in result.cells:
        assert c.new.report is None and c.new.release is None
        assert c.new.failures[0].startswith("shapes: ")
    print(f"base-b plan: {result.seconds:.2f} s")


def test_the_cli_prints_the_matrix_and_its_full_values_with_json(
        planned: tuple[PlanResult, TenantTraffic], world: World) -> None:
    from typer.testing import CliRunner

    from control.cli.main import app

    result, _ = planned
    settings = world.registry.settings
    env = {"LORAPLANE_DB_URL": settings.db_url, "COLUMNS": "300"}  # no wrapped lines

    def cli(*args: str) -> Any:
        return CliRunner().invoke(app, ["--home", str(settings.home), *args], env=env)

    shown = cli("--json", "base", "upgrade", "show", "tiny-llama-base-v2",
                "--base", world.bases["base"], "--number", str(result.plan.number))
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout.strip().splitlines()[-1])
    assert data["status"] == "recorded" and data["cells"] == [c.to_json() for c in result.cells]
    assert data["shadow"]["stopped"] is True
    human = cli("base", "upgrade", "show", world.bases["base-v2"], "--base",
                world.bases["base"], "--number", str(result.plan.number))
    assert human.exit_code == 0, human.output
    assert "passed" in human.stdout and "failed" in human.stdout
    moving = [c for c in result.cells if c.moves]
    for c in moving:
        assert f"loraplane alias point {c.alias} {c.new.release}" in human.stdout
    # a plan the CLI runs: base-b fits no adapter, so nothing is served and it is quick
    planned_b = cli("--json", "base", "upgrade", "plan", world.bases["base-b"], "--http",
                    world.target.http_url, "--grpc", world.target.grpc_url, "--base",
                    world.bases["base"])
    assert planned_b.exit_code == 0, planned_b.output
    out = json.loads(planned_b.stdout.strip().splitlines()[-1])
    assert {c["new"]["verdict"] for c in out["cells"]} == {"incompatible"}
    assert out["shadow"]["started"] is False
