"""A base-model upgrade planned through the real tritonserver: the kit's alpha, beta and gamma,
stable on the kit's base, gated on ``base-v2`` (the main base further trained) by a shadow
engine, while tenants keep calling the live deployment.

Asserted: the matrix (alpha and beta pass on the new base and get a release there; gamma fails
its golden tasks there and stays on its old combination, nothing of it moving), each side's
golden count against what the kit's build measured with PEFT (an oracle independent of the
engine and the gate); that tenants' tickets, sent to the shadow host itself over HTTP and gRPC
while it runs, are refused, and that every tenant request of the run landed on the live host;
that no process of the shadow host is left afterwards, and none when its plan is SIGKILLed; that
an alias moves to its new-base release and back with the existing commands; and that ``base-b``
(another hidden size) is incompatible for all three, with no shadow engine started for it.

Runs on a deployment of its own: it registers more bases, which the shared stack's tests do not
expect.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from control.app.gate_desk import GateDesk
from control.app.registry import Registry
from control.contracts.ledger import Ledger, Outcome
from control.contracts.synthetic import GATE_TENANT
from control.contracts.tickets import GENERIC_REFUSAL
from control.domain import CellVerdict, PlanStatus
from control.ops.clients import TritonRefused, generate, infer_with, request_ticket
from control.ops.serve import Deployment, Ports
from control.tools.gate import GateTarget
from control.tools.kit import KitManifest
from control.tools.upgrade import PlanResult, plan_upgrade
from tests import REPO
from tests.integration.conftest import ACTOR, ROUTES, provision, sqlite_home

pytestmark = pytest.mark.triton

FAMILIES = {"acme-alpha": "alpha", "acme-beta": "beta", "globex-gamma": "gamma"}
# How far the engine's golden count may be from the kit's PEFT count, in tasks: greedy decoding
# may tip on a near tie between fp32 paths, and a kit built before golden sets refused repeated
# prompts measured one task that the set now draws again (KitManifest.golden_set).
PEFT_TOLERANCE_TASKS = 2


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
        golden = kit.golden_set(kit_dir, family)
        desk.record_golden_set(digests[family], golden, actor=ACTOR)
    bases = {"base": kit.base_digest}
    for name, path in (("base-v2", kit.base_v2_path), ("base-b", kit.base_b_path)):
        bases[name] = reg.register_base(kit_dir / path, kit_dir / kit.tokenizer_path,
                                        name=f"tiny-llama-{name}", actor=ACTOR)
    dep = Deployment(settings, Ports.free(),
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


def _claims(ticket: str, keys_dir: Path | None = None) -> dict[str, Any]:
    """A ticket's claims, unverified; its sealed arm opened with the signing keys under
    ``keys_dir`` when given (the ticket tells a tenant no arm)."""
    from control.app.key_ring import held_seal_keys
    from control.contracts.tickets import unverified_claims

    return unverified_claims(ticket, held_seal_keys(keys_dir) if keys_dir else None)


@dataclass
class AtTheShadow:
    """Tenants' own tickets (from the gateway, for every route they are granted) sent to the
    shadow host while it runs, before any gate: what each got back."""

    sent: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, w: World, shadow: dict[str, Any]) -> None:
        for tenant, alias, _name in ROUTES:
            status, body = request_ticket(w.deployment.gateway_url, w.keys[tenant], alias)
            assert status == 200, body
            ticket = str(body["ticket"])
            for protocol, url in (("http", shadow["tenant_http"]),
                                  ("grpc", shadow["tenant_grpc"])):
                got: dict[str, Any] = {"tenant": tenant, "alias": alias, "protocol": protocol,
                                       "jti": _claims(ticket)["jti"], "at": time.time()}
                try:
                    answer = generate(url, "Hello there", ticket, protocol=protocol,
                                      max_tokens=4)
                    got.update(served=True, adapter_digest=answer.adapter_digest)
                except TritonRefused as e:
                    got.update(served=False, status=e.status, message=e.message)
                self.sent.append(got)


@pytest.fixture(scope="module")
def planned(world: World) -> tuple[PlanResult, TenantTraffic, AtTheShadow]:
    at_shadow = AtTheShadow()
    with TenantTraffic(world) as traffic:
        result = plan_upgrade(world.target, world.bases["base-v2"], actor=ACTOR,
                              progress=lambda m: print("plan:", m),
                              on_shadow=lambda shadow: at_shadow(world, shadow))
    print(f"plan run: {result.seconds:.1f} s; tenant requests meanwhile: "
          f"{len(traffic.ticket_ids)} ({traffic.answers} answered)")
    for c in result.cells:
        print("cell:", json.dumps(c.to_json(), sort_keys=True))
    return result, traffic, at_shadow


def _cells(result: PlanResult, world: World) -> dict[str, Any]:
    by_digest = {c.adapter: c for c in result.cells}
    return {family: by_digest[world.digests[family]] for family in FAMILIES.values()}


def test_the_matrix_alpha_and_beta_pass_on_the_new_base_gamma_fails_and_stays(
        planned: tuple[PlanResult, TenantTraffic, AtTheShadow], world: World) -> None:
    result, _, _ = planned
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
        assert f["mismatch_refused"] == f["mismatch_tried"] == 8  # old-base tickets included
        assert f["misattributions"] == 0 and f["authorization_errors"] == 0
        assert cell.old.external  # the kit stack released them on external reports
        # Each side's golden count against the kit's own PEFT measurement of the same tasks on
        # the same bases (kit.json base_v2_golden): not a figure the plan copied from the gate.
        family = next(f for f, d in world.digests.items() if d == cell.adapter)
        old_peft, new_peft = world.kit.base_v2_golden[family]
        assert cell.old.success_rate is not None and cell.new.success_rate is not None
        assert abs(round(cell.old.success_rate * 60) - old_peft) <= PEFT_TOLERANCE_TASKS
        assert abs(round(cell.new.success_rate * 60) - new_peft) <= PEFT_TOLERANCE_TASKS
        if cell.new.verdict == CellVerdict.PASSED:
            release = reg.release_manifest(cell.new.release or "")
            assert (release.adapter_digest, release.base_digest) == (
                cell.adapter, world.bases["base-v2"])
            assert release.evaluation_report_digest == cell.new.report
    gamma = cells["gamma"]
    # It falls below the old base's rate and the floor. Whether it also misses the margin over
    # the base alone depends on how much of gamma the kit's base-v2 edit leaves (the build only
    # asks for a loss of 10 tasks or more; kit.json's base_v2_golden: 2 of 60 on one CPU, 9 on
    # another), so that rule is judged here from the figures its report carries.
    failed = {line.split(":")[0] for line in gamma.new.failures}
    assert {"success_rate", "min_success_rate"} <= failed
    assert failed <= {"success_rate", "min_success_rate", "gain_over_base"}
    g = GateDesk(reg).gate_report(gamma.new.report or "")["figures"]
    assert ("gain_over_base" in failed) == (g["success_rate"] - g["base_success_rate"] < 0.1)
    # nothing of gamma moved: no release on the new base, its alias where it was
    assert gamma.new.release is None and not gamma.moves
    assert reg.alias("globex-gamma").stable == gamma.old.release
    for family, alias in (("alpha", "acme-alpha"), ("beta", "acme-beta")):
        assert reg.alias(alias).stable == cells[family].old.release  # the plan moves nothing


def test_tenants_tickets_sent_to_the_shadow_host_are_refused(
        planned: tuple[PlanResult, TenantTraffic, AtTheShadow], world: World) -> None:
    """Each tenant route's own ticket, from the gateway, sent to the shadow host itself over
    HTTP and gRPC (the previous version of this test only ever connected to the live host)."""
    result, traffic, at_shadow = planned
    assert len(at_shadow.sent) == 2 * len(ROUTES)
    for got in at_shadow.sent:
        assert got["served"] is False, got
        assert got["message"] == GENERIC_REFUSAL, got
    # the shadow host's ledger holds each of them as refused for naming the old base, before
    # its ticket was verified (no ticket id: nothing of a tenant's ticket was trusted)
    ledger = Ledger(world.registry.follower.engine)
    first, last = at_shadow.sent[0]["at"] - 1, at_shadow.sent[-1]["at"] + 5
    refused = [r for r in ledger.query(since=first, until=last)
               if r.host == result.plan.shadow_host and r.ticket_id is None]
    assert len(refused) >= len(at_shadow.sent)
    assert all(r.outcome == Outcome.REJECTED and r.reason == "base" for r in refused)
    shadow_rows = [r for r in ledger.query(since=result.shadow["started_at"] - 1)
                   if r.host == result.plan.shadow_host]
    tenant_tickets = {g["jti"] for g in at_shadow.sent} | set(traffic.ticket_ids)
    assert not {r.ticket_id for r in shadow_rows} & tenant_tickets
    assert not [r for r in shadow_rows if r.outcome == Outcome.OK and r.tenant != GATE_TENANT]
    # the tenants' own requests meanwhile: every one of them on the live host
    assert len(traffic.ticket_ids) >= 3 and traffic.answers >= 3
    tenant_rows = [r for r in ledger.query(since=result.shadow["started_at"] - 5)
                   if r.ticket_id in set(traffic.ticket_ids)]
    assert tenant_rows and {r.host for r in tenant_rows} == {socket.gethostname()}


def _shadow_processes(host_id: str) -> list[int]:
    """Live processes of the shadow host ``host_id``: tritonserver and its stubs (their
    environment names it as LORAPLANE_HOST_ID) and the shadow host process (its command line
    does). Found from /proc, not from what the plan says it stopped."""
    mark = f"LORAPLANE_HOST_ID={host_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rpartition(b")")[2].split()[0] == b"Z":
                    continue  # exited, not yet reaped: nothing runs
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if mark in environ or host_id.encode() in cmdline:
            found.append(int(entry))
    return found


def _closed(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1.0)
        try:
            s.connect((host, int(port)))
        except OSError:
            return True
    return False


def test_the_shadow_host_is_gone_afterwards(
        planned: tuple[PlanResult, TenantTraffic, AtTheShadow]) -> None:
    result, _, _ = planned
    shadow = result.shadow
    assert shadow["started"] and shadow["stopped_at"] >= shadow["ready_at"] >= shadow["started_at"]
    assert _shadow_processes(result.plan.shadow_host) == []
    for address in (shadow["http"], shadow["grpc"]):
        host, port = address.rsplit(":", 1)
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(1.0)
            s.connect((host, int(port)))
    recorded = result.plan.shadow
    assert recorded["host"] == result.plan.shadow_host and recorded["stopped"] is True


def test_a_passing_alias_moves_to_the_new_base_and_back_with_the_existing_commands(
        planned: tuple[PlanResult, TenantTraffic, AtTheShadow], world: World) -> None:
    result, _, _ = planned
    reg = world.registry
    alpha = _cells(result, world)["alpha"]
    gateway, key = world.deployment.gateway_url, world.keys["acme"]
    assert reg.point_alias("acme-alpha", alpha.new.release or "", actor=ACTOR)
    try:
        deadline = time.monotonic() + 5
        while True:  # the gateway's routing sees the move within its refresh interval
            status, body = request_ticket(gateway, key, "acme-alpha")
            claims = (_claims(str(body["ticket"]), reg.settings.keys_dir) if status == 200
                      else {})
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
        planned: tuple[PlanResult, TenantTraffic, AtTheShadow], world: World) -> None:
    from typer.testing import CliRunner

    from control.cli.main import app

    result, _, _ = planned
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


def test_a_sigkilled_plan_leaves_no_shadow_host_behind(world: World) -> None:
    """Issue 21: a plan killed with SIGKILL (no handler, no cleanup) used to leave its shadow
    tritonserver running with nothing to reap it. The shadow is found from /proc (the host id in
    its environment, its ports on tritonserver's command line), not from what the plan says."""
    settings = world.registry.settings
    before = set(_shadow_hosts())
    plan = subprocess.Popen(
        [sys.executable, "-m", "control.cli.main", "--home", str(settings.home), "base",
         "upgrade", "plan", world.bases["base-v2"], "--http", world.target.http_url, "--grpc",
         world.target.grpc_url, "--base", world.bases["base"]],
        cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "LORAPLANE_DB_URL": settings.db_url, "COLUMNS": "300"})
    host_id = ""
    try:
        assert plan.stderr is not None
        for line in plan.stderr:  # the plan's progress: gating starts once its shadow answers
            if line.strip().startswith("gating ") and "on the new base" in line:
                break
        new = set(_shadow_hosts()) - before
        assert len(new) == 1, f"the plan's shadow host not found ({new})"
        host_id = new.pop()
        running = _shadow_processes(host_id)
        ports = _triton_ports(running)
        assert running and len(ports) == 3, (running, ports)
        plan.send_signal(signal.SIGKILL)
        plan.wait(10)
        deadline = time.monotonic() + 60
        while _shadow_processes(host_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _shadow_processes(host_id)
        print(f"shadow {host_id}: {len(running)} processes, {len(left)} left "
              f"{60 - max(0.0, deadline - time.monotonic()):.1f} s after the plan's SIGKILL")
        assert left == []
        assert all(_closed(f"127.0.0.1:{p}") for p in ports), ports
    finally:
        if plan.poll() is None:
            plan.kill()
        for pid in _shadow_processes(host_id) if host_id else []:
            os.kill(pid, signal.SIGKILL)  # only if the test failed: leave the machine clean


def _shadow_hosts() -> list[str]:
    """Host ids of running shadow hosts (``upgrade-shadow-...`` in a process's environment)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            found |= {v.split(b"=", 1)[1].decode() for v in environ
                      if v.startswith(b"LORAPLANE_HOST_ID=upgrade-shadow-")}
    return sorted(found)


def _triton_ports(pids: list[int]) -> list[int]:
    """The HTTP, gRPC and metrics ports on the command line of tritonserver among ``pids``."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args and args[0].endswith("tritonserver"):
            return [int(a.split("=", 1)[1]) for a in args
                    if a.split("=", 1)[0] in ("--http-port", "--grpc-port", "--metrics-port")]
    return []
