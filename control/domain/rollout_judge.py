"""Judging a canary: per-metric sequential analysis of the evidence a step has gathered so far.

Each window adds its figures (the target's and the stable release's over the same seconds, from
the request ledger and tenant feedback) to the step's :class:`Evidence`; the judge then reads the
whole step's evidence, never one window alone. Metrics are judged separately, and any one of them
can fail the canary; none stands in for another:

- **hard failures** act on the event: more identity mismatches than
  ``max_identity_mismatches`` or failed loads of the target's adapter (capacity refusals aside)
  than ``max_load_failures`` roll back at once, whatever the counts of anything else. A target
  that received :data:`ALL_REFUSED_AFTER` requests in the step and served none rolls back too
  (fail closed: a canary that cannot serve is not a canary still deciding);
- **errors** (served requests that ended ``ok``) and **feedback** (ratings that say success),
  target against stable: rolled back when the target is significantly worse, at level
  ``policy.test_alpha``; they let the step advance once the target is significantly not worse
  than ``margin_pp`` below stable, at level ``1 - power`` (feedback gates only once both arms
  hold ``min_ratings`` ratings; errors need ``min_requests`` served per arm);
- **refusals** (the target's requests that were not served: refused, cancelled) against
  stable's: rolled back when significantly worse. A request still running when its window is
  judged counts in no rate: its outcome is not known yet (``--settle`` longer than most
  requests take keeps those few);
- **latency**: the share of the target's ok requests slower than ``max_p95_ratio`` times the
  stable release's p95 in the same window; under "the target's p95 is within that bound" the
  share is at most 5 %, so the canary is rolled back when it is significantly above 5 %.

Bounds come from :mod:`control.domain.sequential` (confidence sequences: valid at every look).
When nothing is concluded the step collects more (``wait``); once its deadline passes it is
``inconclusive`` (the rollout pauses and raises an alert). A paused rollout is still judged:
every rule that rolls back still does; only advancing waits for an operator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from control.contracts.ledger import ReleaseWindow
from control.domain.rollout_policy import RolloutPolicy
from control.domain.sequential import SCALES, Bounds, Tally, difference_bounds, rate_bounds

# A target that got this many requests in a step and served none rolls back (fail closed).
ALL_REFUSED_AFTER = 20
# p95: at most this share of requests may be slower than the 95th percentile.
P95_TAIL = 0.05


class Decision(StrEnum):
    """What a window's judgement decided."""

    ADVANCE = "advance"
    COMPLETE = "complete"  # advance to 100 %: the last step
    WAIT = "wait"  # nothing concluded yet: collect more
    INCONCLUSIVE = "inconclusive"  # the step's deadline passed undecided: pause and alert
    ROLL_BACK = "roll_back"
    HOLD = "hold"  # recorded by rollouts before the sequential analysis; never decided now


class MetricState(StrEnum):
    """A metric's state after a window."""

    WORSE = "worse"  # significantly worse: roll back
    NOT_WORSE = "not_worse"  # significantly not worse than the margin: may advance
    COLLECTING = "collecting"  # not concluded
    NO_DATA = "no_data"


def served(w: ReleaseWindow) -> int:
    """Requests that reached the engine and ended there (not refused, not cancelled)."""
    return w.ok + w.failed + w.identity_mismatches


def ledger_success(w: ReleaseWindow) -> float | None:
    return w.ok / served(w) if served(w) else None


def feedback_success(w: ReleaseWindow) -> float | None:
    return w.successes / w.rated if w.rated else None


def figures(w: ReleaseWindow) -> dict[str, Any]:
    """A release's window figures as an event records them: the counts and the rates."""
    return {**asdict(w), "ledger_success_rate": ledger_success(w),
            "feedback_success_rate": feedback_success(w)}


@dataclass(frozen=True)
class WindowFigures:
    """What one window showed. ``slow``/``timed``: the target's ok requests slower than
    ``max_p95_ratio`` times the baseline's p95 in the window, and those with a latency at all
    (0/0 when the baseline had no ok request to take a p95 from); ``load_failures``: failed
    loads of the target's adapter other than capacity refusals (``ReleaseWindow.load_failures``
    counts those too); ``target_running``/``baseline_running``: each arm's requests still
    running when the window was judged (not refused: their outcome is to come)."""

    target: ReleaseWindow
    baseline: ReleaseWindow
    slow: int = 0
    timed: int = 0
    load_failures: int = 0
    target_running: int = 0
    baseline_running: int = 0


_NONE = Tally()  # frozen: one instance serves every empty default


def _pair(data: Any) -> tuple[Tally, Tally]:
    return Tally.from_json(data[0]), Tally.from_json(data[1])


@dataclass(frozen=True)
class Evidence:
    """Everything a step has seen so far (its windows summed): per metric, the target's and the
    baseline's tallies; the hard-failure counts; the target's requests that ended (served or
    refused) and those served."""

    errors: tuple[Tally, Tally] = (_NONE, _NONE)
    feedback: tuple[Tally, Tally] = (_NONE, _NONE)
    refusals: tuple[Tally, Tally] = (_NONE, _NONE)
    latency: Tally = _NONE
    identity_mismatches: int = 0
    load_failures: int = 0
    requests: int = 0
    served: int = 0

    def add(self, f: WindowFigures) -> Evidence:
        t, b = f.target, f.baseline
        # Requests whose outcome is known: served, or refused (not still running).
        ended_t = max(served(t), t.requests - f.target_running)
        ended_b = max(served(b), b.requests - f.baseline_running)
        return Evidence(
            errors=(self.errors[0] + Tally(t.ok, served(t)),
                    self.errors[1] + Tally(b.ok, served(b))),
            feedback=(self.feedback[0] + Tally(t.successes, t.rated),
                      self.feedback[1] + Tally(b.successes, b.rated)),
            refusals=(self.refusals[0] + Tally(served(t), ended_t),
                      self.refusals[1] + Tally(served(b), ended_b)),
            latency=self.latency + Tally(f.timed - f.slow, f.timed),
            identity_mismatches=self.identity_mismatches + t.identity_mismatches,
            load_failures=self.load_failures + f.load_failures,
            requests=self.requests + ended_t, served=self.served + served(t))

    def to_json(self) -> dict[str, Any]:
        return {"errors": [x.to_json() for x in self.errors],
                "feedback": [x.to_json() for x in self.feedback],
                "refusals": [x.to_json() for x in self.refusals],
                "latency": self.latency.to_json(),
                "identity_mismatches": self.identity_mismatches,
                "load_failures": self.load_failures, "requests": self.requests,
                "served": self.served}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Evidence:
        return cls(errors=_pair(data["errors"]), feedback=_pair(data["feedback"]),
                   refusals=_pair(data["refusals"]), latency=Tally.from_json(data["latency"]),
                   identity_mismatches=int(data["identity_mismatches"]),
                   load_failures=int(data["load_failures"]), requests=int(data["requests"]),
                   served=int(data["served"]))


@dataclass(frozen=True)
class MetricResult:
    """One metric after a window: its tallies, its bounds (``rollback``: at the rollback
    test's level; ``advance``: at ``1 - power``) and its state."""

    name: str
    state: MetricState
    target: Tally
    baseline: Tally | None
    rollback: Bounds | None
    advance: Bounds | None
    gating: bool  # whether this metric must be not-worse for the step to advance
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state.value, "target": self.target.to_json(),
                "baseline": None if self.baseline is None else self.baseline.to_json(),
                "rollback_bounds": None if self.rollback is None else self.rollback.to_json(),
                "advance_bounds": None if self.advance is None else self.advance.to_json(),
                "gating": self.gating, "why": self.why}


@dataclass(frozen=True)
class Verdict:
    """A window's judgement. ``hard``: it rolls back for a hard failure (the target cannot
    serve correctly), not for a statistic: its sessions must not stay on it."""

    decision: Decision
    reasons: list[str]
    evidence: Evidence
    metrics: dict[str, MetricResult] = field(default_factory=dict)
    hard: bool = False

    def metrics_json(self) -> dict[str, Any]:
        return {name: m.to_json() for name, m in self.metrics.items()}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _pp(x: float) -> str:
    return f"{100 * x:+.1f} points"


def compare(name: str, target: Tally, baseline: Tally, *, alpha: float, beta: float,
            margin: float, gate_from: int | None) -> MetricResult:
    """A two-arm success metric: worse when the upper bound of (target - baseline) at
    ``alpha`` is below 0; not worse when its lower bound at ``beta`` is above ``-margin`` and
    both arms hold ``gate_from`` trials (None: this metric never lets a step advance)."""
    gating = gate_from is not None and min(target.total, baseline.total) >= gate_from
    # Rolling back answers "worse at all?", for regressions of any size: every scale. Advancing
    # answers "worse by the margin?": the margin's own scale is the sharpest.
    down = difference_bounds(target, baseline, alpha, margin, SCALES)
    up = difference_bounds(target, baseline, beta, margin)
    if down is None or up is None:
        return MetricResult(name, MetricState.NO_DATA, target, baseline, None, None, gating,
                            f"{name}: no " + ("target" if not target.total else "baseline")
                            + " data yet")
    rates = (f"{name}: {_pct(target.rate)} of {target.total} vs stable {_pct(baseline.rate)} "
             f"of {baseline.total}")
    if down.high < 0:
        return MetricResult(name, MetricState.WORSE, target, baseline, down, up, gating,
                            f"{rates}: significantly worse (difference at most "
                            f"{_pp(down.high)}, alpha {alpha:.2g})")
    if gating and up.low > -margin:
        return MetricResult(name, MetricState.NOT_WORSE, target, baseline, down, up, gating,
                            f"{rates}: not worse than {_pp(-margin)} (difference at least "
                            f"{_pp(up.low)})")
    return MetricResult(name, MetricState.COLLECTING, target, baseline, down, up, gating,
                        f"{rates}: difference {_pp(down.estimate)}, between {_pp(up.low)} "
                        f"and {_pp(down.high)}")


def latency(slow_free: Tally, *, alpha: float, ratio: float) -> MetricResult:
    """The latency guard: worse when the share of the target's requests within ``ratio`` times
    stable's p95 is significantly below 95 % (its p95 is then above that bound)."""
    within = 1.0 - P95_TAIL
    bounds = rate_bounds(slow_free, alpha, P95_TAIL, SCALES)
    if bounds is None:
        return MetricResult("latency", MetricState.NO_DATA, slow_free, None, None, None, False,
                            "latency: no timed target request beside a stable p95 yet")
    slow = slow_free.total - slow_free.good
    what = (f"latency: {slow} of {slow_free.total} target requests slower than "
            f"{ratio:g}x stable's p95")
    if bounds.high < within:
        return MetricResult("latency", MetricState.WORSE, slow_free, None, bounds, None, False,
                            f"{what}: its p95 is significantly above the bound (slow share at "
                            f"least {_pct(1 - bounds.high)}, alpha {alpha:.2g})")
    return MetricResult("latency", MetricState.COLLECTING, slow_free, None, bounds, None, False,
                        what)


def hard_failures(policy: RolloutPolicy, identity_mismatches: int,
                  load_failures: int) -> list[str]:
    """Why the hard-failure rules roll back now (empty: they do not)."""
    out = []
    if identity_mismatches > policy.max_identity_mismatches:
        out.append(f"identity mismatches: {identity_mismatches} (at most "
                   f"{policy.max_identity_mismatches} allowed)")
    if load_failures > policy.max_load_failures:
        out.append(f"load failures: {load_failures} failed loads of the target's adapter (at "
                   f"most {policy.max_load_failures} allowed)")
    return out


def judge_window(policy: RolloutPolicy, test_alpha: float, before: Evidence,
                 window: WindowFigures, *, last_step: bool, paused: bool = False,
                 past_deadline: bool = False) -> Verdict:
    """Add ``window`` to the step's evidence ``before`` and decide (see the module notes).

    ``test_alpha``: the level of each statistical rollback test (``policy.test_alpha``);
    ``last_step``: the next step is 100 %, so advancing completes the rollout; ``paused``: the
    rollout may roll back but not advance; ``past_deadline``: the window ends after the step's
    deadline, so a step still undecided is inconclusive."""
    ev = before.add(window)
    metrics = {
        "errors": compare("errors", *ev.errors, alpha=test_alpha, beta=policy.beta,
                          margin=policy.margin, gate_from=policy.min_requests),
        "feedback": compare("feedback", *ev.feedback, alpha=test_alpha, beta=policy.beta,
                            margin=policy.margin, gate_from=policy.min_ratings),
        "refusals": compare("refusals", *ev.refusals, alpha=test_alpha, beta=policy.beta,
                            margin=policy.margin, gate_from=None),
        "latency": latency(ev.latency, alpha=test_alpha, ratio=policy.max_p95_ratio),
    }

    def verdict(decision: Decision, reasons: list[str], hard: bool = False) -> Verdict:
        return Verdict(decision, reasons, ev, metrics, hard)

    hard = hard_failures(policy, ev.identity_mismatches, ev.load_failures)
    if ev.requests >= ALL_REFUSED_AFTER and ev.served == 0:
        hard.append(f"refusals: none of the target's {ev.requests} requests in this step was "
                    "served")
    worse = [m.why for m in metrics.values() if m.state == MetricState.WORSE]
    if hard or worse:
        return verdict(Decision.ROLL_BACK, hard + worse, hard=bool(hard))
    errors, feedback = metrics["errors"], metrics["feedback"]
    gates = [errors] + ([feedback] if feedback.gating else [])
    summary = [m.why for m in metrics.values()]
    if all(m.state == MetricState.NOT_WORSE for m in gates):
        if paused:
            return verdict(Decision.WAIT, ["paused: would advance", *summary])
        return verdict(Decision.COMPLETE if last_step else Decision.ADVANCE, summary)
    if not errors.gating:
        summary.insert(0, f"errors: {min(x.total for x in ev.errors)} served requests on the "
                          f"smaller arm, {policy.min_requests} needed to advance")
    if past_deadline and not paused:
        return verdict(Decision.INCONCLUSIVE,
                       [f"step deadline ({policy.step_deadline_s:g} s) passed undecided",
                        *summary])
    return verdict(Decision.WAIT, summary)
