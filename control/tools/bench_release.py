"""``loraplane bench release``: how often the rollout judge is wrong, measured by simulation.

Each simulated rollout is a real :class:`control.domain.rollout.Rollout` driven the way the
controller drives one: ``next_action``, ``enter_step`` with a passing probe, and
``record_window`` with a window's figures, so every decision comes from the very functions the
controller calls (the sequential judge, the evidence kept per step, the deadlines). Only the
traffic is simulated: each window holds ``per_window`` requests, each sent to the canary with
the step's share (a binomial draw, as hashing sessions does), each a success with its arm's
success rate. The scenarios, side by side in one run:

- ``equal``: canary and stable both at 95 % success: every rollback is a false one;
- ``regressed_5pp``: the canary at 90 %: every rollback is a detection, anything else a miss;
- each of those twice, success read from tenant feedback (every request rated) and from the
  ledger (engine errors, no ratings);
- ``p95_10x``: equal success, every canary request ten times slower than stable's p95.

For contrast the run also replays the rule this project used before (each window alone, point
estimates, roll back when more than 1 point below stable, advance at 20 requests) on the same
kind of traffic (``before``).

Rates come with their count and a Wilson 95 % interval; a goal is met only when the whole
interval meets it (0 false rollbacks in 300 rollouts is an interval of 0-1.3 %, not "0 %").
Requests per arm are counted until the first step's decision (advance or roll back).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from control.contracts.ledger import ReleaseWindow
from control.domain.rollout import (
    Decision,
    Enter,
    Judge,
    ProbeReport,
    Rollout,
    RolloutPolicy,
    Sleep,
    WindowFigures,
)
from control.domain.rollout_policy import FULL, Sessions

QUICK_ROLLOUTS = 300  # per scenario: enough for an interval of about +-2 points at 95 %
FULL_ROLLOUTS = 2000
STEPS = [10, 50, 100]
WINDOW_S = 60.0
PER_WINDOW = 200
BASELINE_SUCCESS = 0.95
REGRESSION = 0.05
# With equal latency, the share of canary requests slower than 1.5x stable's p95 (a tail a
# little thinner than the 5 % the p95 itself leaves above it).
EQUAL_SLOW_SHARE = 0.01
Z95 = 1.959964

_T = "sha256:" + "7" * 64
_B = "sha256:" + "5" * 64
_PROBE = ProbeReport(hosts=["simulated"], requests=2, ok=2)
ACTOR = "bench-release"


@dataclass(frozen=True)
class Scenario:
    name: str
    target_success: float
    source: str  # "feedback": every request ok and rated; "ledger": ok or failed, unrated
    slow_share: float = EQUAL_SLOW_SHARE
    regressed: bool = False  # a rollback is a detection (else a false rollback)


SCENARIOS = (
    Scenario("equal", BASELINE_SUCCESS, "feedback"),
    Scenario("regressed_5pp", BASELINE_SUCCESS - REGRESSION, "feedback", regressed=True),
    Scenario("equal_ledger", BASELINE_SUCCESS, "ledger"),
    Scenario("regressed_5pp_ledger", BASELINE_SUCCESS - REGRESSION, "ledger", regressed=True),
    Scenario("p95_10x", BASELINE_SUCCESS, "feedback", slow_share=1.0, regressed=True),
)


@dataclass(frozen=True)
class Outcome:
    status: str  # completed | rolled_back | inconclusive
    first_decision: str | None  # the first step's: advance, complete, roll_back, inconclusive
    target_requests: int  # in the first step, until its decision
    baseline_requests: int
    windows: int


def wilson(count: int, n: int) -> dict[str, float]:
    """The rate ``count / n`` with its Wilson score 95 % interval."""
    if n == 0:
        return {"rate": math.nan, "low": 0.0, "high": 1.0}
    p = count / n
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return {"rate": p, "low": max(0.0, centre - half), "high": min(1.0, centre + half)}


def _arm(rng: Any, n: int, success: float, source: str, *, slow: float = 0.0,
         ) -> tuple[ReleaseWindow, int, int]:
    """One arm's window of ``n`` requests: its figures, then (slow, timed) requests."""
    good = int(rng.binomial(n, success)) if n else 0
    if source == "feedback":
        w = ReleaseWindow(requests=n, ok=n, rated=n, successes=good)
        ok = n
    else:
        w = ReleaseWindow(requests=n, ok=good, failed=n - good)
        ok = good
    w = replace(w, p95_latency_s=0.1 if ok else None)  # what "slow" is measured against
    return w, (int(rng.binomial(ok, slow)) if ok else 0), ok


def simulate(policy: RolloutPolicy, scenario: Scenario, rng: Any, *,
             steps: list[int] | None = None, per_window: int = PER_WINDOW,
             window_s: float = WINDOW_S) -> Outcome:
    """One rollout of ``scenario`` under ``policy``, driven as the controller drives one."""
    r = Rollout.start(alias="bench", number=1, owner="bench", target=_T, target_adapter=_T,
                      baseline=_B, baseline_adapter=_B, steps=steps or STEPS, window_s=window_s,
                      policy=policy, now=0.0, actor=ACTOR)
    now, windows = 0.0, 0
    first: str | None = None
    arms = (0, 0)
    while not r.finished:
        action = r.next_action(now)
        if isinstance(action, Enter):
            r.enter_step(action.index, _PROBE, now, ACTOR)
            if action.percent >= FULL:
                r.complete(now, ACTOR)
        elif isinstance(action, Judge):
            n_t = int(rng.binomial(per_window, r.percent / 100))
            target, slow, timed = _arm(rng, n_t, scenario.target_success, scenario.source,
                                       slow=scenario.slow_share)
            baseline, _, _ = _arm(rng, per_window - n_t, BASELINE_SUCCESS, scenario.source)
            step = r.step
            v = r.record_window(action.start, action.end,
                                WindowFigures(target, baseline, slow=slow, timed=timed),
                                0, ACTOR)
            windows += 1
            if step == 0 and first is None and v.decision != Decision.WAIT:
                first = v.decision.value
                arms = (v.evidence.refusals[0].total, v.evidence.refusals[1].total)
            if v.decision == Decision.ROLL_BACK:
                r.roll_back(v.reasons, Sessions.REPIN, True, ACTOR)
            elif v.decision == Decision.INCONCLUSIVE:
                return Outcome("inconclusive", first, *arms, windows)
        elif isinstance(action, Sleep):
            now = action.until
        else:
            break
    return Outcome(r.status.value, first, *arms, windows)


def simulate_before(scenario: Scenario, rng: Any, *, steps: list[int] | None = None,
                    per_window: int = PER_WINDOW, min_requests: int = 20,
                    max_drop_pp: float = 1.0, max_windows: int = 60) -> str:
    """The rule before the sequential analysis, for contrast: each window alone, roll back when
    success is more than ``max_drop_pp`` points below stable's, advance at ``min_requests``."""
    for share in (steps or STEPS)[:-1]:
        for _ in range(max_windows):
            n_t = int(rng.binomial(per_window, share / 100))
            if n_t < min_requests:
                continue
            t = rng.binomial(n_t, scenario.target_success) / n_t
            b = rng.binomial(per_window - n_t, BASELINE_SUCCESS) / (per_window - n_t)
            if 100 * (b - t) > max_drop_pp + 1e-9:
                return "rolled_back"
            break
        else:
            return "inconclusive"
    return "completed"


def _spread(values: list[int]) -> dict[str, float]:
    if not values:
        return {"median": math.nan, "p95": math.nan, "count": 0}
    ordered = sorted(values)
    return {"median": statistics.median(ordered),
            "p95": ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)], "count": len(ordered)}


def run_bench(*, rollouts: int = QUICK_ROLLOUTS, seed: int = 21,
              policy: RolloutPolicy | None = None,
              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Simulate ``rollouts`` rollouts of every scenario (see the module notes); returns
    {"scenarios", "goals", "met", "setup"}."""
    import numpy as np  # the simulation's binomial draws: only this bench needs them

    if rollouts < 10:
        raise ValueError("rollouts must be at least 10 per scenario")
    policy = policy or RolloutPolicy()
    started = time.monotonic()
    scenarios: dict[str, Any] = {}
    for i, sc in enumerate(SCENARIOS):
        progress(f"{sc.name}: {rollouts} rollouts")
        rng = np.random.default_rng([seed, i])
        outcomes = [simulate(policy, sc, rng) for _ in range(rollouts)]
        before = [simulate_before(sc, rng) for _ in range(rollouts)]
        count = {s: sum(1 for o in outcomes if o.status == s)
                 for s in ("completed", "rolled_back", "inconclusive")}
        decided = [o for o in outcomes if o.first_decision in ("advance", "complete")] \
            if not sc.regressed else [o for o in outcomes if o.first_decision == "roll_back"]
        scenarios[sc.name] = {
            "target_success": sc.target_success, "baseline_success": BASELINE_SUCCESS,
            "source": sc.source, "rollouts": rollouts,
            **{s: {"count": c, **wilson(c, rollouts)} for s, c in count.items()},
            "first_step_rolled_back": wilson(
                sum(1 for o in outcomes if o.first_decision == "roll_back"), rollouts),
            "requests_per_arm_first_step": {
                "target": _spread([o.target_requests for o in decided]),
                "baseline": _spread([o.baseline_requests for o in decided]),
                "decision": "roll_back" if sc.regressed else "advance"},
            "windows": _spread([o.windows for o in outcomes]),
            "before": {s: wilson(sum(1 for b in before if b == s), rollouts)
                       for s in ("completed", "rolled_back", "inconclusive")},
        }
    eq, bad = scenarios["equal"], scenarios["regressed_5pp"]
    goals = {
        "false_rollback_equal": {"rate": eq["rolled_back"], "goal": "<= 0.02",
                                 "met": eq["rolled_back"]["high"] <= 0.02},
        "false_rollback_equal_ledger": {
            "rate": scenarios["equal_ledger"]["rolled_back"], "goal": "<= 0.02",
            "met": scenarios["equal_ledger"]["rolled_back"]["high"] <= 0.02},
        "detection_5pp": {"rate": bad["rolled_back"], "goal": ">= 0.90",
                          "met": bad["rolled_back"]["low"] >= 0.90},
        "detection_5pp_ledger": {
            "rate": scenarios["regressed_5pp_ledger"]["rolled_back"], "goal": ">= 0.90",
            "met": scenarios["regressed_5pp_ledger"]["rolled_back"]["low"] >= 0.90},
    }
    return {
        "scenarios": scenarios, "goals": goals,
        "met": {k: g["met"] for k, g in goals.items()},
        "setup": {"rollouts_per_scenario": rollouts, "seed": seed, "steps": STEPS,
                  "window_s": WINDOW_S, "requests_per_window": PER_WINDOW,
                  "policy": policy.to_json(), "test_alpha": policy.test_alpha(len(STEPS) - 1),
                  "interval": "Wilson score, 95 %", "seconds": time.monotonic() - started},
    }
