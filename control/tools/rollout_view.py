"""What ``loraplane rollout status`` shows, and the demo too: a rollout read from its events.

:func:`rollout_status` is the plain data (``--json``): the rollout as it stands, its policy with
the level each statistical test runs at, the current step's evidence per metric with its bounds,
every window's figures and decision, every failed probe and alert, how it ended, and
``unjudged_s``: how long its open window has gone unjudged past what the policy allows (set only
then: no rollout controller is judging it). :func:`render` draws that data for people with rich:
the steps as a progress line, the policy, the step's metrics, alerts, and a table of the
windows, target beside baseline.
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


def rollout_status(desk: RolloutDesk, rollout: Rollout,
                   now: float | None = None) -> dict[str, Any]:
    """The rollout as plain data, from its recorded events (see the module notes)."""
    now = time.time() if now is None else now
    windows: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    alerts: list[dict[str, Any]] = []
    rebased: list[dict[str, Any]] = []
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
        elif name == "RolloutAlerted":
            alerts.append(fields)
        elif name == "RolloutRebased":
            rebased.append(fields)
        elif name in ("RolloutRolledBack", "RolloutCompleted"):
            ended = {"event": name, **fields}
    current = next((w for w in reversed(windows) if w["step"] == rollout.step), None)
    return {
        "alias": rollout.alias, "number": rollout.number, "status": rollout.status.value,
        "owner": rollout.owner, "target": rollout.target,
        "target_adapter": rollout.target_adapter, "baseline": rollout.baseline,
        "baseline_adapter": rollout.baseline_adapter, "steps": rollout.steps,
        "step": rollout.step + 1, "percent": rollout.percent, "window_s": rollout.window_s,
        "window_start": rollout.window_start, "policy": rollout.policy.to_json(),
        "test_alpha": rollout.test_alpha, "deadline_at": rollout.deadline_at,
        "advance_due": rollout.advance_due, "baseline_lost": rollout.baseline_lost,
        "unjudged_s": rollout.unjudged_for(now),
        "evidence": rollout.evidence.to_json(),
        "metrics": current["metrics"] if current is not None else {},
        "started_at": rollout.started_at, "reasons": rollout.reasons,
        "steps_entered": steps, "windows": windows, "failed_probes": probes,
        "alerts": alerts, "rebased": rebased, "ended": ended,
    }


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _tally(pair: list[int] | None) -> str:
    return "-" if not pair else f"{pair[0]}/{pair[1]}"


def _bounds(b: dict[str, float] | None) -> str:
    if b is None:
        return "-"
    return f"[{100 * b['low']:+.1f}, {100 * b['high']:+.1f}]"


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
    p = data["policy"]
    policy = Text(
        f"policy  alpha {p['alpha']:g} over the rollout (each test {data['test_alpha']:.2g}), "
        f"power {p['power']:g}, margin {p['margin_pp']:g} points, at least "
        f"{p['min_requests']} requests / {p['min_ratings']} ratings per arm, step deadline "
        f"{p['step_deadline_s']:g} s, p95 at most {p['max_p95_ratio']:g}x", "dim")
    parts: list[Any] = [head, line, policy]
    if data["window_start"] is not None and status in ("running", "paused"):
        left = data["window_start"] + data["window_s"] - now
        parts.append(Text(f"window open since {data['window_start']:.1f}: "
                          + (f"{left:.1f} s left" if left > 0 else "closed, being judged")
                          + ("; advancing: the next step is due" if data["advance_due"] else "")))
    if data["unjudged_s"] is not None:
        parts.append(Text(f"UNJUDGED for {data['unjudged_s']:.0f} s past its due time: is a "
                          "rollout controller running?", "bold red"))
    if data["reasons"]:
        parts.append(Text("why: " + "; ".join(data["reasons"]),
                          "red" if status == "rolled_back" else ""))
    if data["metrics"]:
        m = Table(title=f"step {data['step']}: evidence so far (target / stable; difference "
                        "bounds in points: rollback, advance)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col in ("metric", "target", "stable", "rollback bounds", "advance bounds",
                    "state"):
            m.add_column(col)
        for name, r in data["metrics"].items():
            m.add_row(name, _tally(r["target"]), _tally(r["baseline"]),
                      _bounds(r["rollback_bounds"]), _bounds(r["advance_bounds"]),
                      r["state"] + (" (gates)" if r["gating"] else ""))
        parts.append(m)
    table = Table(title="windows: target/stable", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    for col in ("step", "#", "requests", "ok", "feedback", "loads", "mism", "busy/oom", "p95",
                "decision"):
        table.add_column(col)
    for w in data["windows"][-SHOWN_WINDOWS:]:
        t, b = w["target"], w["baseline"]
        table.add_row(
            f"{w['percent']}%", str(w["window"]), f"{t['requests']}/{b['requests']}",
            f"{_rate(t['ledger_success_rate'])}/{_rate(b['ledger_success_rate'])}",
            f"{_rate(t['feedback_success_rate'])}/{_rate(b['feedback_success_rate'])}",
            str(w.get("load_failures", t["load_failures"])), str(t["identity_mismatches"]),
            f"{t['busy']}/{t['memory_refusals']}",
            f"{_seconds(t['p95_latency_s'])}/{_seconds(b['p95_latency_s'])}", w["decision"])
    parts.append(table)
    for a in data["alerts"][-3:]:
        parts.append(Text(f"alert ({a['kind']}): {a['message']}", "bold yellow"))
    for pr in data["failed_probes"][-3:]:
        parts.append(Text(f"probe before step {pr['step'] + 1} failed (attempt "
                          f"{pr['attempt']}): " + "; ".join(pr["reasons"]), "yellow"))
    return Group(*parts)
