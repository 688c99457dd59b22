"""What ``loraplane rollout status`` shows, and the demo too: a rollout read from its events.

:func:`rollout_status` is the plain data (``--json``): the rollout as it stands, every window's
figures and decision, every failed probe, and how it ended. :func:`render` draws that data for
people with rich: the steps as a progress line, the current window's countdown, and a table of
the windows, target beside baseline.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from control.contracts.digests import short
from control.domain import Rollout

if TYPE_CHECKING:
    from rich.console import RenderableType

    from control.app.rollouts import RolloutDesk

# How many windows the table shows (the newest); --json has them all.
SHOWN_WINDOWS = 12


def rollout_status(desk: RolloutDesk, rollout: Rollout) -> dict[str, Any]:
    """The rollout as plain data, from its recorded events (see the module notes)."""
    windows: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    ended: dict[str, Any] | None = None
    for name, fields in desk.history(rollout.id):
        fields = {k: v for k, v in fields.items() if k not in ("alias", "actor")} | {
            "actor": fields.get("actor")}
        if name == "RolloutWindowEvaluated":
            windows.append(fields)
        elif name == "RolloutProbeFailed":
            probes.append(fields)
        elif name == "RolloutStepEntered":
            steps.append(fields)
        elif name in ("RolloutRolledBack", "RolloutCompleted"):
            ended = {"event": name, **fields}
    return {
        "alias": rollout.alias, "number": rollout.number, "status": rollout.status.value,
        "owner": rollout.owner, "target": rollout.target,
        "target_adapter": rollout.target_adapter, "baseline": rollout.baseline,
        "baseline_adapter": rollout.baseline_adapter, "steps": rollout.steps,
        "step": rollout.step + 1, "percent": rollout.percent, "window_s": rollout.window_s,
        "window_start": rollout.window_start, "policy": rollout.policy.to_json(),
        "started_at": rollout.started_at, "reasons": rollout.reasons,
        "steps_entered": steps, "windows": windows, "failed_probes": probes, "ended": ended,
    }


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _success(side: dict[str, Any], source: str) -> str:
    return _rate(side.get(f"{source}_success_rate"))


def render(data: dict[str, Any], now: float | None = None) -> RenderableType:
    """The rollout of :func:`rollout_status` for a terminal."""
    # rich: drawn only for people (``--json`` never imports it)
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now is None else now
    status = data["status"]
    colour = {"running": "cyan", "paused": "yellow", "rolled_back": "red",
              "completed": "green"}[status]
    head = Text.assemble(
        (f"{data['alias']} rollout #{data['number']}: ", "bold"), (status, f"bold {colour}"),
        f"  release {short(data['target'])} from stable {short(data['baseline'])}, "
        f"windows of {data['window_s']:g} s")
    line = Text("steps  ")
    for i, pct in enumerate(data["steps"], start=1):
        if i < data["step"] or (i == data["step"] and status == "completed"):
            line.append(f"{pct}% ✓", "green")
        elif i == data["step"]:
            line.append(f"{pct}% ●", f"bold {colour}")
        else:
            line.append(f"{pct}%", "dim")
        if i < len(data["steps"]):
            line.append(" → ", "dim")
    parts: list[Any] = [head, line]
    if data["window_start"] is not None and status == "running":
        left = data["window_start"] + data["window_s"] - now
        number = 1 + sum(1 for w in data["windows"] if w["step"] == data["step"] - 1)
        parts.append(Text(f"window {number} of step {data['step']}: "
                          + (f"{left:.1f} s left" if left > 0 else "closed, being judged")))
    if data["reasons"]:
        parts.append(Text("why: " + "; ".join(data["reasons"]),
                          "red" if status == "rolled_back" else ""))
    table = Table(title="windows: target/stable (success from f=feedback, l=ledger)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    for col in ("step", "#", "requests", "success", "loads", "mism", "busy/oom", "p95",
                "decision"):
        table.add_column(col)
    for w in data["windows"][-SHOWN_WINDOWS:]:
        t, b, src = w["target"], w["baseline"], w["success_source"]
        table.add_row(
            f"{w['percent']}%", str(w["window"]), f"{t['requests']}/{b['requests']}",
            f"{_success(t, src)}/{_success(b, src)} {src[0]}", str(t["load_failures"]),
            str(t["identity_mismatches"]), f"{t['busy']}/{t['memory_refusals']}",
            f"{_seconds(t['p95_latency_s'])}/{_seconds(b['p95_latency_s'])}", w["decision"])
    parts.append(table)
    for p in data["failed_probes"][-3:]:
        parts.append(Text(f"probe before step {p['step'] + 1} failed (attempt {p['attempt']}): "
                          + "; ".join(p["reasons"]), "yellow"))
    return Group(*parts)
