"""CLI verbs of base-model upgrades (``control.tools.upgrade``), registered on the typer apps of
control.cli.base:

``loraplane base upgrade plan NEW_BASE``   gate every approved adapter on NEW_BASE (shadow
                                           engine) and record the adapter x base matrix
``loraplane base upgrade show NEW_BASE``   a recorded plan's matrix
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from typing import Annotated, Any

import typer

from control.cli.base import (
    console,
    emit,
    err_console,
    errors,
    registry,
    settings,
    state,
    upgrade_app,
)
from control.contracts.digests import short


@upgrade_app.command("plan")
def upgrade_plan(
    new_base: Annotated[str, typer.Argument(help="The new base: a registered base's digest "
                                                 "or name.")],
    http: Annotated[str, typer.Option(help="The live deployment's Triton HTTP host:port.")
                    ] = "127.0.0.1:8000",
    grpc: Annotated[str, typer.Option(help="Its Triton gRPC host:port.")] = "127.0.0.1:8001",
    base: Annotated[str | None, typer.Option(
        help="The base to upgrade from, the one the live deployment serves (default: the only "
             "base with approved adapters).")] = None,
    device: Annotated[str | None, typer.Option(
        help="The Triton hosts' device, for the memory plan (default: this machine's).")
    ] = None,
) -> None:
    """Gate every approved (canary or stable) adapter of the served base on NEW_BASE, on a
    shadow Triton host that serves no tenant and is stopped afterwards; print the adapter x
    {old base, new base} matrix and record it (UpgradePlanRecorded). Adapters that pass get a
    release on the new base (point their alias at it to move them); the others stay on their
    verified old combination. Needs the deployment's home and database."""
    # the plan (gate, registry, Triton launcher): only this verb pays for it
    from control.tools.gate import GateTarget
    from control.tools.upgrade import plan_upgrade

    with errors():
        result = plan_upgrade(GateTarget(settings(), http, grpc, base=base, device=device),
                              new_base, actor=state.actor,
                              progress=_quiet if state.json else
                              lambda m: err_console.print(f"[dim]{m}[/dim]"))
    data = result.to_json()
    emit(data, lambda: _matrix(data))


@upgrade_app.command("show")
def upgrade_show(
    new_base: Annotated[str, typer.Argument(help="The new base: digest or name.")],
    base: Annotated[str | None, typer.Option(
        help="The base upgraded from (default: the only one with approved adapters).")] = None,
    number: Annotated[int | None, typer.Option(help="Which plan (default: the latest).")
                      ] = None,
) -> None:
    """A recorded upgrade plan's matrix (full values with --json)."""
    # the registry and the projections (eventsourcing, SQLAlchemy): only when a verb runs
    from control.app.upgrades import UpgradeDesk
    from control.tools.upgrade import from_base_of
    from projections.routing import RoutingView

    with errors():
        reg = registry(existing=True)
        to = reg.base(new_base).digest
        frm = from_base_of(RoutingView(reg.follower.engine), to, base)
        plan = UpgradeDesk(reg).get(frm, to, number)
    data = {"from_base": plan.from_base, "to_base": plan.to_base, "number": plan.number,
            "tokenizer": plan.tokenizer, "template": plan.template,
            "status": plan.status.value, "reason": plan.reason, "shadow": plan.shadow,
            "adapters": plan.adapters, "cells": plan.cells}
    emit(data, lambda: _matrix(data))


def _matrix(data: dict[str, Any]) -> None:
    """The adapter x {old base, new base} table, then how to move the passing aliases."""
    from rich.table import Table

    t = Table(title=f"upgrade {short(data['from_base'])} -> {short(data['to_base'])} "
                    f"(plan {data['number']}, {data['status']})")
    for col in ("adapter", "alias", "state", f"old base {short(data['from_base'])}",
                f"new base {short(data['to_base'])}", "new release"):
        t.add_column(col, overflow="fold")
    for c in data["cells"]:
        old, new = c["old"], c["new"]
        evidence = ("external" if old["external"] else "gate") if old["evidence"] else "none"
        old_cell = f"{_rate(old['success_rate'])} ({evidence}; release {_short(old['release'])})"
        verdict = new["verdict"]
        shown = {"passed": "[green]passed[/green]", "failed": "[red]failed[/red]"}.get(
            verdict, f"[yellow]{verdict}[/yellow]")
        why = "; ".join(new["failures"][:2])
        new_cell = f"{shown} {_rate(new['success_rate'])}" + (f": {why}" if why else "")
        t.add_row(short(c["adapter"]), f"{c['alias']} ({c['tenant']})", c["state"], old_cell,
                  new_cell, _short(new["release"]))
    console.print(t)
    moving = [c for c in data["cells"] if c["new"]["release"]]
    if moving:
        console.print("move a passing alias (and back with `loraplane alias rollback ALIAS`):")
        for c in moving:
            console.print(f"  loraplane alias point {c['alias']} {c['new']['release']}")
    if data.get("shadow", {}).get("started"):
        console.print(f"shadow engine {data['shadow']['host']}: "
                      f"{'stopped' if data['shadow'].get('stopped') else 'NOT STOPPED'}")


def _quiet(_message: str) -> None:
    """Progress under --json: stdout is the one JSON line."""


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _short(d: str | None) -> str:
    return short(d) if d else "-"
