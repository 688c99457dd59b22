"""The demo's rollout: a degraded adapter fails the real gate, an operator overrides it with a
recorded break-glass, and its canary on a live alias rolls itself back.

The kit's ``alpha-degraded`` answers with the wrong marker (``" ALPHA sighs"``). It is registered
on ``acme-alpha`` with alpha's golden task set and goes through the evaluation gate on the
running deployment (``control.tools.gate``), which refuses it (its golden tasks, the floor, the
gain over the base alone); an external report saying it passed does not override that. The
operator then overrides the gate with ``break-glass`` (``BreakGlassUsed``: who, why, the failing
report), which puts it in canary, and it is rolled out in steps of 50 and 100 % with windows of
two seconds, while acme's traffic rates every answer by whether it starts with alpha's marker.
The controller the deployment runs probes the adapter, gives it half the sessions, judges the
first window against the stable release from that feedback, and rolls back: the canary is
cleared and the target's sessions are re-pinned to stable, in one transaction. The stable
release never moved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from control.app.key_ring import held_seal_keys
from control.app.registry import Registry
from control.app.rollouts import RolloutDesk
from control.contracts.digests import short
from control.domain import CANARY, DomainError, RolloutPolicy
from control.ops.serve import Deployment
from control.tools.canary_traffic import CanaryTraffic, Running
from control.tools.gate import GateTarget, run_gate
from control.tools.kit import KitManifest
from control.tools.rollout_view import render, rollout_status

ALIAS = "acme-alpha"
TARGET = "alpha-degraded"
POLICY = RolloutPolicy(min_requests=4, min_ratings=4, settle_s=0.5, probe_requests=2)
WINDOW_S = 2.0
TIMEOUT_S = 90.0


def show_rollback(reg: Registry, dep: Deployment, kit: KitManifest, kit_dir: Path,
                  api_key: str, step: Callable[[str], None], console: Console,
                  actor: str) -> dict[str, Any]:
    """Run the demo's rollout (see the module notes); returns what it showed."""
    assert dep.triton is not None
    digest = reg.register_adapter(kit_dir / kit.adapters[TARGET].path, tenant="acme",
                                  alias=ALIAS, actor=actor,
                                  golden=kit.golden_set(kit_dir, kit.adapters[TARGET].family))
    reg.promote(digest, actor=actor)  # -> candidate
    gate = run_gate(GateTarget(reg.settings, dep.triton.http_url, dep.triton.grpc_url,
                               f"http://{dep.triton.http_url.rsplit(':', 1)[0]}:"
                               f"{dep.ports.metrics}/metrics"), digest, actor=actor)
    figures = gate.report["figures"]
    step(f"the gate {'passed' if gate.passed else '[red]refused[/red]'} {TARGET} "
         f"({short(digest)}): golden {figures['success_rate']:.2f} against the stable "
         f"release's {figures['stable_success_rate']:.2f} and the base alone's "
         f"{figures['base_success_rate']:.2f}; failed: "
         + ", ".join(line.split(":")[0] for line in gate.failures))
    try:
        reg.advance(digest, external=True, to=CANARY, actor=actor,
                    evaluation={"producer": "demo", "suite": "demo-smoke", "passed": True})
        overridden = "[red]an external report overrode the gate[/red]"
    except DomainError as e:
        overridden = f"[yellow]refused as expected[/yellow]: an external report -> {e}"
    step(overridden)
    reg.break_glass(digest, to=CANARY, actor=actor,
                    reason="demo: show that the rollout controller rolls a bad canary back")
    step(f"break-glass by {actor}: {TARGET} in canary despite its failing gate report "
         "(BreakGlassUsed records who, why and the report overridden)")
    desk = RolloutDesk(reg)
    rollout = desk.start(ALIAS, digest, steps=[50, 100], window_s=WINDOW_S, policy=POLICY,
                         actor=actor)
    step(f"rollout of {TARGET} ({short(digest)}) on {ALIAS}: steps 50,100 %, windows of "
         f"{WINDOW_S:g} s; acme rates each answer by alpha's marker (POST /v1/feedback)")
    marker = kit.adapters["alpha"].marker
    started = time.monotonic()
    traffic = CanaryTraffic(dep.gateway_url, api_key, ALIAS, dep.triton.http_url, marker,
                            seal_keys=held_seal_keys(reg.settings.keys_dir))
    with Running(traffic, threads=3):
        while not desk.get(rollout.id).finished and time.monotonic() - started < TIMEOUT_S:
            time.sleep(0.1)
    done = desk.get(rollout.id)
    data = rollout_status(desk, done)
    console.print(render(data))
    rolled_back = done.status == "rolled_back"
    step(("[green]rolled back on its own[/green]" if rolled_back
          else f"[red]not rolled back ({done.status})[/red]")
         + f" after {time.monotonic() - started:.1f} s: {'; '.join(done.reasons)}")
    return {"rolled_back": rolled_back, "windows": len(data["windows"]),
            "reasons": done.reasons, "seen": {str(k): dict(v) for k, v in traffic.seen.items()},
            "gate": {"passed": gate.passed, "failures": gate.failures,
                     "report_digest": gate.report_digest},
            "external_report_refused": overridden.startswith("[yellow]")}
