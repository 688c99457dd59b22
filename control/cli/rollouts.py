"""CLI verbs of automatic canary rollouts (``control.domain.rollout``).

``loraplane alias rollout ALIAS TARGET --steps 1,10,50,100 --window 60s``  start one
``loraplane rollout status ALIAS [--watch]``     where it stands: steps, windows, decisions
``loraplane rollout pause|resume ALIAS``         stop advancing (still judged) / carry on
``loraplane rollout abort ALIAS --reason ...``   end it and roll it back
``loraplane rollout controller``                 the controller alone (``serve`` and
                                                 ``control-plane`` run it already)

Starting a rollout records it; the controller inside ``serve`` or ``control-plane`` drives it.
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import os
import re
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from control.cli.base import (
    alias_app,
    console,
    emit,
    err_console,
    errors,
    existing_settings,
    registry,
    rollout_app,
    settings,
    state,
)
from control.contracts.digests import short

if TYPE_CHECKING:
    from control.app.rollouts import RolloutDesk
    from control.domain import Rollout

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: str) -> float:
    """``60s``, ``1.5s``, ``500ms``, ``2m``, ``1h`` or plain seconds."""
    m = _DURATION.match(value)
    if m is None:
        raise typer.BadParameter("expected a duration like 60s, 500ms or 2m")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_steps(value: str) -> list[int]:
    """``1,10,50,100``: per cents of sessions (checked by the domain)."""
    try:
        return [int(p) for p in value.split(",") if p.strip()]
    except ValueError:
        raise typer.BadParameter("expected whole per cents separated by commas, e.g. "
                                 "1,10,50,100") from None


def _desk(existing: bool = False) -> "RolloutDesk":
    # the rollout commands (eventsourcing): only the rollout verbs load them
    from control.app.rollouts import RolloutDesk

    return RolloutDesk(registry(existing=existing))


def _summary(r: "Rollout") -> dict[str, Any]:
    return {"alias": r.alias, "number": r.number, "status": r.status.value, "target": r.target,
            "baseline": r.baseline, "steps": r.steps, "step": r.step + 1, "percent": r.percent,
            "window_s": r.window_s, "policy": r.policy.to_json(), "reasons": r.reasons}


@alias_app.command("rollout")
def alias_rollout(
    alias: str,
    target: Annotated[str, typer.Argument(help="Release digest, or adapter digest (its release).")],
    steps: Annotated[str, typer.Option(help="Per cents of sessions, ending at 100.")
                     ] = "1,10,50,100",
    window: Annotated[str, typer.Option(help="Length of each judged window (60s, 2m, ...).")
                      ] = "60s",
    alpha: Annotated[float | None, typer.Option(
        help="Chance that a canary as good as stable is rolled back, over the whole rollout "
             "(default 0.02).")] = None,
    power: Annotated[float | None, typer.Option(
        help="Chance that a step does NOT advance a canary worse than stable by the margin "
             "(default 0.95).")] = None,
    margin: Annotated[float | None, typer.Option(
        help="Non-inferiority margin in points of success rate: a step advances once the "
             "canary is shown to be no more than this below stable (default 3).")] = None,
    min_requests: Annotated[int | None, typer.Option(
        help="Served requests per arm a step needs before it can advance (default 100).")
    ] = None,
    min_ratings: Annotated[int | None, typer.Option(
        help="Ratings per arm from which feedback must also show the canary not worse "
             "(default 100).")] = None,
    deadline: Annotated[str | None, typer.Option(
        help="A step undecided after this pauses as inconclusive, with an alert (default "
             "1h).")] = None,
    max_p95_ratio: Annotated[float | None, typer.Option(
        help="Roll back when the canary's p95 latency is significantly above this multiple of "
             "stable's (default 1.5).")] = None,
    max_load_failures: Annotated[int | None, typer.Option(
        help="Failed loads of the target's adapter tolerated before it rolls back at once "
             "(default 0).")] = None,
    settle: Annotated[str | None, typer.Option(
        help="Wait after a window ends before judging it, feedback arrives late (default 2s).")
    ] = None,
    sessions: Annotated[str, typer.Option(
        help="On rollback, sessions bound to the target: repin (to stable), end, or drain "
             "(not after a hard failure).")] = "repin",
) -> None:
    """Start an automatic canary of TARGET on ALIAS: the controller probes the target, moves
    the alias step by step, weighs the evidence of each step against the stable release with
    sequential tests, and advances, rolls back, or pauses at the step's deadline on its own."""
    # the domain's policy (eventsourcing): only when this verb runs
    from control.domain import RolloutPolicy, Sessions

    try:
        choice = Sessions(sessions)
    except ValueError:
        raise typer.BadParameter("--sessions is repin, end or drain") from None
    given: dict[str, Any] = {
        "alpha": alpha, "power": power, "margin_pp": margin, "min_requests": min_requests,
        "min_ratings": min_ratings, "max_p95_ratio": max_p95_ratio,
        "max_load_failures": max_load_failures,
        "step_deadline_s": None if deadline is None else parse_duration(deadline),
        "settle_s": None if settle is None else parse_duration(settle)}
    with errors():
        policy = RolloutPolicy(sessions=choice,
                               **{k: v for k, v in given.items() if v is not None})
        r = _desk().start(alias, target, steps=parse_steps(steps),
                          window_s=parse_duration(window), policy=policy, actor=state.actor)
    emit(_summary(r), lambda: console.print(
        f"{alias}: rollout #{r.number} of release {short(r.target)} started (steps "
        f"{','.join(map(str, r.steps))}, windows of {r.window_s:g} s, alpha "
        f"{r.policy.alpha:g}, power {r.policy.power:g}, margin {r.policy.margin_pp:g} points); "
        f"the controller in `loraplane serve` / `control-plane` drives it: `loraplane rollout "
        f"status {alias} --watch`"))


@rollout_app.command("status")
def rollout_status(
    alias: str,
    watch: Annotated[bool, typer.Option("--watch", help="Keep the view live until it ends.")
                     ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes (--watch).")
                        ] = 0.5,
) -> None:
    """Where the alias's latest rollout stands: steps, every window's figures and decision."""
    # the status view and its data: only this verb pays for them
    from control.tools.rollout_view import render
    from control.tools.rollout_view import rollout_status as status_data

    with errors():
        desk = _desk(existing=True)
        data = status_data(desk, desk.current(alias))
    if state.json or not watch:
        emit(data, lambda: console.print(render(data)))
        return
    # rich's live display: only --watch draws one
    from rich.live import Live

    with errors(), Live(render(data), refresh_per_second=4) as live:
        try:
            while data["status"] not in ("completed", "rolled_back"):
                time.sleep(interval)
                data = status_data(desk, desk.current(alias))
                live.update(render(data))
        except KeyboardInterrupt:
            pass


@rollout_app.command("pause")
def rollout_pause(
    alias: str,
    reason: Annotated[str, typer.Option(help="Why (recorded).")] = "",
) -> None:
    """Stop advancing the alias's rollout; its canary keeps its share and is still judged
    (every rollback rule still applies)."""
    with errors():
        r = _desk().pause(alias, reason, actor=state.actor)
    emit(_summary(r), lambda: console.print(f"{alias}: rollout #{r.number} paused at "
                                            f"{r.percent}%"))


@rollout_app.command("resume")
def rollout_resume(
    alias: str,
    reason: Annotated[str, typer.Option(help="Why (recorded).")] = "",
) -> None:
    """Carry on a paused rollout: the step gets a new deadline. If its baseline was revoked,
    the canary is compared with the alias's stable release from now on."""
    with errors():
        r = _desk().resume(alias, reason, actor=state.actor)
    emit(_summary(r), lambda: console.print(f"{alias}: rollout #{r.number} resumed at "
                                            f"{r.percent}%"))


@rollout_app.command("abort")
def rollout_abort(
    alias: str,
    reason: Annotated[str, typer.Option(help="Why (recorded; required).")],
) -> None:
    """End the alias's rollout and roll it back: the canary is cleared, the target's sessions
    re-pinned or drained per the policy, in one transaction."""
    with errors():
        r = _desk().abort(alias, reason, actor=state.actor)
    emit(_summary(r), lambda: console.print(f"{alias}: rollout #{r.number} aborted and rolled "
                                            "back to the stable release"))


@rollout_app.command("controller")
def rollout_controller(
    triton: Annotated[list[str] | None, typer.Option(
        help="A Triton host (host:port of its HTTP endpoint; POOL=host:port for a host of a "
             "dedicated pool) to probe; repeatable; added to $LORAPLANE_TRITON_URLS.")] = None,
) -> None:
    """Run the rollout controller alone until interrupted (serve and control-plane run one)."""
    # the controller and the deployment's settings names: only this verb loads them
    from control.cli.database import require_schema
    from control.contracts.telemetry import configure_logging
    from control.ops.rollout_controller import run_until_signalled
    from control.ops.serve import TRITON_URLS_ENV

    configure_logging()
    hosts = [u.strip() for u in os.environ.get(TRITON_URLS_ENV, "").split(",") if u.strip()]
    hosts += list(triton or [])
    with errors():
        require_schema(settings())
        if not hosts:
            raise ValueError(f"no Triton host to probe: pass --triton HOST:PORT or set "
                             f"{TRITON_URLS_ENV}")
    err_console.print(f"rollout controller probing {', '.join(hosts)}; Ctrl-C to stop")
    raise typer.Exit(run_until_signalled(existing_settings(), hosts))
