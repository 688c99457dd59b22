"""``loraplane base upgrade plan NEW_BASE``: every approved adapter of the served base, gated on a
new base by a shadow engine that serves no tenant, and the adapter x {old base, new base} matrix.

What runs, in order:

1. the plan is recorded as started (``UpgradePlanStarted``: the bases, the approved adapters,
   canary or stable, of the old base, and the shadow host's ledger id) before anything runs;
2. each adapter's fit on the new base is checked with registration's own checks on its stored
   bytes (``UpgradeDesk.fits``): one that does not fit (another hidden size, say) is
   ``incompatible`` and is not gated; one without a golden task set is ``not_gated``;
3. if any adapter is left, a shadow engine starts: a Triton host like any other
   (``control.ops.serve.Deployment``, role ``triton``) serving the new base
   (``LORAPLANE_BASE_DIGEST``) on ports of its own, on loopback, under a host id of its own so
   its ledger rows are told apart. No gateway routes to it (it is in no
   ``LORAPLANE_TRITON_URLS``), and a tenant's ticket names the old base, which it refuses (the
   gate checks that too); the only tickets it serves are the ones the gate signs. It runs in a
   process of its own that the kernel signals when the plan dies, SIGKILL included
   (``control.tools.shadow_host``): nothing of it outlives its plan;
4. the gate runs on it for each adapter (``control.tools.gate.OnNewBase``): its golden tasks on
   the new combination, compared with its release on the old base, which the live deployment
   serves at the same time; each report is recorded on the adapter for the new combination;
5. the shadow engine is stopped, whatever happened (and the record says whether every process
   of it is gone, as checked, not assumed), and the plan records the matrix
   (``UpgradePlanRecorded``), with a release on the new combination for each adapter that
   passed, in one transaction; a run that broke off records ``UpgradePlanAbandoned`` instead.

Nothing moves: the aliases point where they did. An operator moves a passing alias with the
existing commands, once Triton hosts serve the new base: ``alias point ALIAS RELEASE`` (or
``alias canary`` / ``alias rollout``) to the cell's release, and back with ``alias rollback``.
A release on the new base is a target only while a passing gate report vouches for its
combination (``Adapter.verified_on``), so a failed adapter's gate release cannot be pointed at.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from control.app.upgrades import UpgradeDesk
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.domain import (
    Adapter,
    BaseUpgrade,
    CellVerdict,
    NewSide,
    OldSide,
    Release,
    UpgradeCell,
    is_approved,
)
from control.ops.serve import Ports
from control.ops.triton_server import TritonProcess
from control.tools.gate import GATE_ACTOR, Gate, GateTarget, GateUnavailable, OnNewBase
from control.tools.shadow_host import ShadowHost
from projections.follower import open_registry
from projections.routing import RoutingView

SHADOW_PREFIX = "upgrade-shadow-"


@dataclass(frozen=True)
class PlanResult:
    """A finished plan: the recorded aggregate, its matrix, the shadow host and the run time."""

    plan: BaseUpgrade
    cells: list[UpgradeCell]
    shadow: dict[str, Any]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """The plan as ``--json`` prints it: every value of every cell."""
        return {"from_base": self.plan.from_base, "to_base": self.plan.to_base,
                "number": self.plan.number, "tokenizer": self.plan.tokenizer,
                "template": self.plan.template, "status": self.plan.status.value,
                "shadow": self.shadow, "seconds": round(self.seconds, 3),
                "cells": [c.to_json() for c in self.cells]}


def from_base_of(routing: RoutingView, to_base: str, given: str | None) -> str:
    """The base an upgrade starts from: ``given``, else the only base other than ``to_base``
    that has approved (canary or stable) adapters."""
    if given is not None:
        return given
    bases = {a.base_digest for a in routing.adapters() if is_approved(a.state)} - {to_base}
    if len(bases) != 1:
        raise ValueError("no base has approved adapters to upgrade" if not bases else
                         "approved adapters are on several bases: choose the one to upgrade "
                         "from with --base")
    return bases.pop()


def plan_upgrade(target: GateTarget, new_base: str, *, actor: str = GATE_ACTOR,
                 from_base: str | None = None, shadow_ports: Ports | None = None,
                 progress: Callable[[str], None] = lambda _m: None,
                 ready_timeout_s: float = TritonProcess.READY_TIMEOUT_S,
                 on_shadow: Callable[[dict[str, Any]], None] | None = None) -> PlanResult:
    """Plan the upgrade of the adapters of ``target``'s base (or ``from_base``) to
    ``new_base`` (a registered base, by digest or name); see the module notes. ``target`` is
    the live deployment (its home, database and Triton addresses, as for the gate).
    ``on_shadow``: called with the shadow's addresses once it answers, before any gate runs
    (a test sends tenants' tickets there)."""
    t0 = time.monotonic()
    settings = target.settings
    registry = open_registry(settings)
    try:
        desk = UpgradeDesk(registry)
        to = registry.base(new_base).digest
        routing = RoutingView(make_engine(settings.db_url))
        frm = from_base_of(routing, to, from_base or target.base)
        approved = desk.approved([a.digest for a in routing.adapters()], frm)
        host_id = SHADOW_PREFIX + secrets.token_hex(4)
        plan = desk.start(frm, to, [a.digest for a in approved], shadow_host=host_id,
                          actor=actor)
        progress(f"plan {plan.number}: {len(approved)} approved adapter(s) on the new base")
        try:
            cells, shadow = _run(desk, plan, approved, target, settings, shadow_ports,
                                 progress, actor, ready_timeout_s, on_shadow)
            desk.record(plan, cells, shadow, actor=actor)
        except BaseException as e:
            # A plan that broke off says so on the record (Ctrl-C included), then fails.
            desk.abandon(desk.get(plan.from_base, plan.to_base, plan.number),
                         f"{type(e).__name__}: {e}", actor=actor)
            raise
        return PlanResult(plan, plan.matrix(), shadow, time.monotonic() - t0)
    finally:
        registry.close()


def _run(desk: UpgradeDesk, plan: BaseUpgrade, approved: list[Adapter], target: GateTarget,
         settings: Settings, ports: Ports | None, progress: Callable[[str], None], actor: str,
         ready_timeout_s: float, on_shadow: Callable[[dict[str, Any]], None] | None
         ) -> tuple[list[UpgradeCell], dict[str, Any]]:
    cells: dict[str, UpgradeCell] = {}
    to_gate: list[tuple[Adapter, OldSide, Release]] = []
    for a in approved:
        replaced = desk.replaced_release(a)
        old = _old_side(a, replaced)
        not_fit = desk.fits(a, plan.to_base)
        if not_fit:
            cells[a.digest] = _cell(a, old, NewSide(CellVerdict.INCOMPATIBLE, failures=not_fit))
        elif a.golden_set is None:
            cells[a.digest] = _cell(a, old, NewSide(CellVerdict.NOT_GATED, failures=[
                "no golden task set: record one (adapter golden DIGEST FILE)"]))
        elif replaced is None:
            cells[a.digest] = _cell(a, old, NewSide(CellVerdict.NOT_GATED, failures=[
                "no release on its own base to compare with"]))
        else:
            to_gate.append((a, old, replaced))
    shadow: dict[str, Any] = {"host": plan.shadow_host, "started": False}
    if to_gate:
        host = ShadowHost(settings, plan.to_base, plan.shadow_host,
                          ports or Ports.free(),
                          actor=actor, ready_timeout_s=ready_timeout_s, progress=progress)
        shadow.update(started=True, started_at=time.time())
        try:
            with host as up:
                shadow.update(http=up["http"], grpc=up["grpc"], tenant_http=up["tenant_http"],
                              tenant_grpc=up["tenant_grpc"], pid=up["pid"],
                              ready_at=time.time())
                progress(f"shadow host {plan.shadow_host} ready: http {up['http']}, grpc "
                         f"{up['grpc']}; tenants' addresses http {up['tenant_http']}, grpc "
                         f"{up['tenant_grpc']} (process {up['pid']})")
                if on_shadow is not None:
                    on_shadow(dict(shadow))
                on_host = GateTarget(settings, up["http"], up["grpc"], up["metrics"],
                                     base=plan.to_base, device=target.device,
                                     host_id=plan.shadow_host)
                for a, old, replaced in to_gate:
                    progress(f"gating {a.digest} ({a.alias}) on the new base")
                    cells[a.digest] = _gated(desk, a, old, replaced, on_host, target, actor)
        finally:
            # Whether every process of the shadow is gone, checked (ShadowHost.stop).
            shadow.update(stopped_at=time.time(), stopped=host.stop())
    return [cells[a.digest] for a in approved], shadow


def _gated(desk: UpgradeDesk, a: Adapter, old: OldSide, replaced: Release,
           on_shadow: GateTarget, live: GateTarget, actor: str) -> UpgradeCell:
    try:
        result = Gate(on_shadow, desk.registry, actor=actor).run(
            a.digest, OnNewBase(on_shadow.base or "", replaced.digest, live))
    except GateUnavailable as e:
        return _cell(a, old, NewSide(CellVerdict.NOT_GATED, failures=[str(e)]))
    f = result.report["figures"]
    return _cell(a, replace(old, success_rate=f["stable_success_rate"]), NewSide(
        CellVerdict.PASSED if result.passed else CellVerdict.FAILED,
        report=result.report_digest, success_rate=f["success_rate"],
        failures=result.failures))


def _old_side(a: Adapter, replaced: Release | None) -> OldSide:
    evidence = replaced.evaluation_report_digest if replaced is not None else None
    gated = {str(r["report"]) for r in a.gate_reports.values()}
    return OldSide(release=replaced.digest if replaced is not None else None,
                   evidence=evidence, external=evidence is not None and evidence not in gated)


def _cell(a: Adapter, old: OldSide, new: NewSide) -> UpgradeCell:
    return UpgradeCell(adapter=a.digest, tenant=a.tenant, alias=a.alias, state=str(a.state),
                       old=old, new=new)


__all__ = ["PlanResult", "from_base_of", "plan_upgrade"]
