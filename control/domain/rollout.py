"""The ``Rollout`` aggregate: a canary that advances and rolls back on its own, and its rules.

A rollout moves one alias from its stable release (the *baseline*) to a *target* release through
steps of traffic share (``1, 10, 50, 100`` per cent of sessions). Each step is entered only after
the target was preloaded and health-probed on the hosts; then each window of ``window_s`` seconds
is judged from the request ledger and tenant feedback, the target's figures beside the
baseline's over the same window, and the decision is an event with its figures and reasons:

- ``roll_back`` at once when the window shows any identity mismatch for the target (more than
  ``max_identity_mismatches``), when the target's task success rate is more than
  ``max_success_drop_pp`` percentage points below the baseline's, or when its adapter load
  failures were above ``max_load_failure_rate`` of its requests for ``load_failure_windows``
  windows in a row;
- ``hold`` while load failures are above the rate for fewer windows than that (no advance on a
  window that failed loads);
- ``wait`` when the window had too few target requests (``min_requests``) or no baseline
  traffic to compare with: nothing is concluded, the next window decides;
- ``advance`` to the next step, or ``complete`` when the next step is 100 % (the alias then
  points at the target, which graduates).

Why mismatches and load failures are judged on every window, however few its requests: each is
a hard failure of the serving path, not a statistic of answer quality, so one is evidence. The
success comparison needs enough requests to mean anything, hence ``min_requests``. A window with
no target request and no failed load says nothing about loads: the run of load-failure windows
neither grows nor resets on it.

Task success comes from tenant feedback where both sides hold at least ``min_ratings`` ratings
in the window (``source: feedback``); otherwise from the ledger, served requests that ended
``ok`` (``source: ledger``). Both sides are always judged from the same source, and every window
event names it.

The aggregate holds what has happened and what is due next (:meth:`Rollout.next_action`); it
never reads a clock, a database or a host: the controller (``control.ops.rollout_controller``)
brings the time, the probe reports and the ledger figures. That is also why a controller killed
at any point resumes correctly: what is due next follows from the recorded events alone, and
:meth:`Rollout.enter_step` refuses any step but the next one, so no step is repeated or skipped
(two controllers racing collide on the event store's version index instead).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate, event

from control.contracts.ledger import ReleaseWindow
from control.domain.errors import DomainError, IllegalTransition
from control.domain.ids import NAMESPACE
from control.domain.names import check_actor, check_name

FULL = 100  # per cent: the last step, where the alias points at the target


class RolloutStatus(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    ROLLED_BACK = "rolled_back"
    COMPLETED = "completed"


FINISHED = frozenset({RolloutStatus.ROLLED_BACK, RolloutStatus.COMPLETED})


class Decision(StrEnum):
    """What a window's figures decided."""

    ADVANCE = "advance"
    COMPLETE = "complete"  # advance to 100 %: the last step
    WAIT = "wait"  # too little traffic to conclude
    HOLD = "hold"  # load failures above the rate, not yet for long enough to roll back
    ROLL_BACK = "roll_back"


class Sessions(StrEnum):
    """What happens, on a rollback, to sessions already bound to the target."""

    DRAIN = "drain"  # they keep the target until they end or their pin's TTL passes
    REPIN = "repin"  # they are pinned to the stable release at once


class SuccessSource(StrEnum):
    FEEDBACK = "feedback"
    LEDGER = "ledger"


def rollout_id(alias: str, number: int) -> UUID:
    """The id of the ``number``-th rollout (from 1) of ``alias``: two processes starting the
    same one collide on the event store's unique index."""
    return uuid5(NAMESPACE, f"rollout:{alias}#{number}")


def check_steps(steps: list[int]) -> list[int]:
    """Steps are per cent of sessions, strictly increasing, from 1, ending at 100."""
    if (not isinstance(steps, list) or not steps
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)):
        raise DomainError("steps must be a list of whole per cents, e.g. 1,10,50,100")
    if any(s < 1 or s > FULL for s in steps):
        raise DomainError("every step must be between 1 and 100 per cent")
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise DomainError("steps must increase strictly, e.g. 1,10,50,100")
    if steps[-1] != FULL:
        raise DomainError("the last step must be 100 (where the alias points at the target)")
    return list(steps)


@dataclass(frozen=True)
class RolloutPolicy:
    """The rules a rollout is judged by; recorded whole in its started event.

    ``settle_s``: how long after a window's end it is judged, so that requests admitted near
    the end have finished and their tenants had a moment to rate them. ``probe_requests``: the
    health probe's requests per host before each step; ``probe_attempts``: probes that may fail
    (unreachable or unhealthy host) before the rollout rolls back (a probe that shows a load
    failure or an identity mismatch rolls back at once). ``max_p95_ratio`` and
    ``max_refusal_rate`` are off unless set: the target's p95 latency over the baseline's, and
    its busy and out-of-memory refusals over its requests.
    """

    max_success_drop_pp: float = 1.0
    max_load_failure_rate: float = 0.005
    load_failure_windows: int = 3
    max_identity_mismatches: int = 0
    min_requests: int = 20
    min_ratings: int = 10
    settle_s: float = 2.0
    probe_requests: int = 2
    probe_attempts: int = 3
    sessions: Sessions = Sessions.REPIN
    max_p95_ratio: float | None = None
    max_refusal_rate: float | None = None

    def __post_init__(self) -> None:
        def number(name: str, low: float, high: float = math.inf) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (
                    low <= v <= high) or math.isnan(v):
                raise DomainError(f"policy {name} must be a number from {low:g}"
                                  + ("" if high == math.inf else f" to {high:g}")
                                  + f", found {v!r}")

        def whole(name: str, low: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise DomainError(f"policy {name} must be a whole number of at least {low}, "
                                  f"found {v!r}")

        number("max_success_drop_pp", 0, 100)
        number("max_load_failure_rate", 0, 1)
        number("settle_s", 0, 3600)
        for name in ("load_failure_windows", "min_requests", "probe_requests",
                     "probe_attempts"):
            whole(name, 1)
        whole("max_identity_mismatches", 0)
        whole("min_ratings", 1)
        if self.max_p95_ratio is not None:
            number("max_p95_ratio", 1)
        if self.max_refusal_rate is not None:
            number("max_refusal_rate", 0, 1)
        try:
            object.__setattr__(self, "sessions", Sessions(self.sessions))
        except ValueError:
            raise DomainError("policy sessions must be drain or repin") from None

    def to_json(self) -> dict[str, Any]:
        """The policy as its started event records it."""
        return {**asdict(self), "sessions": self.sessions.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutPolicy:
        """The policy a started event recorded (fields it does not know are refused)."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise DomainError(f"unknown rollout policy fields: {', '.join(sorted(unknown))}")
        return cls(**data)


# -- judging a window ---------------------------------------------------------------------------

def served(w: ReleaseWindow) -> int:
    """Requests that reached the engine and ended there (not refused, not cancelled)."""
    return w.ok + w.failed + w.identity_mismatches


def ledger_success(w: ReleaseWindow) -> float | None:
    return w.ok / served(w) if served(w) else None


def feedback_success(w: ReleaseWindow) -> float | None:
    return w.successes / w.rated if w.rated else None


def load_failure_rate(w: ReleaseWindow) -> float | None:
    """Failed loads per target request in the window (1 when loads failed and no request got
    through to be counted); None when the window holds neither."""
    if w.requests:
        return min(1.0, w.load_failures / w.requests)
    return 1.0 if w.load_failures else None


def figures(w: ReleaseWindow) -> dict[str, Any]:
    """A release's window figures as an event records them: the counts and the rates."""
    return {**asdict(w), "ledger_success_rate": ledger_success(w),
            "feedback_success_rate": feedback_success(w),
            "load_failure_rate": load_failure_rate(w)}


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reasons: list[str]
    success_source: SuccessSource
    target_success: float | None
    baseline_success: float | None
    load_failure_streak: int


# Rates are ratios of counts: 98/100 against 99/100 must read as exactly one point apart, not
# as the 1.0000000000000009 that floating point makes of it.
_EPSILON_PP = 1e-9


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def judge_window(policy: RolloutPolicy, target: ReleaseWindow, baseline: ReleaseWindow,
                 streak: int, last_step: bool) -> Verdict:
    """Decide on one window (see the module notes for the rules and their order).

    ``streak``: windows in a row so far with load failures above the rate; ``last_step``: the
    next step is 100 %, so advancing completes the rollout."""
    use_feedback = target.rated >= policy.min_ratings and baseline.rated >= policy.min_ratings
    source = SuccessSource.FEEDBACK if use_feedback else SuccessSource.LEDGER
    rate = feedback_success if use_feedback else ledger_success
    t_success, b_success = rate(target), rate(baseline)

    def verdict(decision: Decision, *reasons: str) -> Verdict:
        return Verdict(decision, list(reasons), source, t_success, b_success, streak)

    if target.identity_mismatches > policy.max_identity_mismatches:
        return verdict(Decision.ROLL_BACK,
                       f"identity mismatches: {target.identity_mismatches} "
                       f"(at most {policy.max_identity_mismatches} allowed)")
    failing = load_failure_rate(target)
    if failing is not None:
        if failing > policy.max_load_failure_rate:
            streak += 1
            why = (f"load failures {_pct(failing)} of requests > "
                   f"{_pct(policy.max_load_failure_rate)} ({streak} of "
                   f"{policy.load_failure_windows} windows in a row)")
            if streak >= policy.load_failure_windows:
                return verdict(Decision.ROLL_BACK, why)
            return verdict(Decision.HOLD, why)
        streak = 0
    if target.requests < policy.min_requests:
        return verdict(Decision.WAIT, f"too few target requests: {target.requests} < "
                                      f"{policy.min_requests}")
    if t_success is None or b_success is None:
        side = "target" if t_success is None else "baseline"
        return verdict(Decision.WAIT, f"no {side} request to judge success by ({source})")
    drop_pp = 100 * (b_success - t_success)
    if drop_pp > policy.max_success_drop_pp + _EPSILON_PP:
        return verdict(Decision.ROLL_BACK,
                       f"success rate {_pct(t_success)} is {drop_pp:.1f} points below the "
                       f"baseline's {_pct(b_success)} (at most {policy.max_success_drop_pp:g} "
                       f"allowed; {source})")
    reasons = [f"success {_pct(t_success)} vs baseline {_pct(b_success)} ({source})"]
    if policy.max_p95_ratio is not None and target.p95_latency_s is not None and (
            baseline.p95_latency_s):
        ratio = target.p95_latency_s / baseline.p95_latency_s
        if ratio > policy.max_p95_ratio:
            return verdict(Decision.ROLL_BACK, f"p95 latency {ratio:.2f}x the baseline's "
                                               f"(at most {policy.max_p95_ratio:g}x)")
    refusals = target.busy + target.memory_refusals
    if policy.max_refusal_rate is not None and refusals / target.requests > (
            policy.max_refusal_rate):
        return verdict(Decision.ROLL_BACK,
                       f"busy and out-of-memory refusals {_pct(refusals / target.requests)} "
                       f"> {_pct(policy.max_refusal_rate)}")
    return verdict(Decision.COMPLETE if last_step else Decision.ADVANCE, *reasons)


# -- the probe before each step -------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeReport:
    """What preloading and probing the target on the hosts showed, before a step.

    ``requests``/``ok``: probe requests sent and answered ok by the target's own adapter (the
    answer's digest, read from the slot, equal to the target's); ``load_failures`` and
    ``identity_mismatches``: what the ledger recorded for the target while the probe ran;
    ``errors``: one short line per failed request (no tenant data: the probe is the owner's)."""

    hosts: list[str]
    requests: int
    ok: int
    load_failures: int = 0
    identity_mismatches: int = 0
    p95_latency_s: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.hosts) and self.requests > 0 and self.ok == self.requests and not (
            self.load_failures or self.identity_mismatches)

    @property
    def decisive(self) -> bool:
        """It failed for the target's own fault (a load failure, a mismatch): no retry."""
        return bool(self.load_failures or self.identity_mismatches)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def reasons(self) -> list[str]:
        """Why the probe failed (empty when it passed)."""
        out = []
        if not self.hosts:
            out.append("no Triton host to probe")
        if self.load_failures:
            out.append(f"load failures: {self.load_failures} failed loads of the target")
        if self.identity_mismatches:
            out.append(f"identity mismatches: {self.identity_mismatches}")
        if self.hosts and self.ok < self.requests:
            out.append(f"probe answered {self.ok} of {self.requests} requests"
                       + (f": {self.errors[0]}" if self.errors else ""))
        return out


# -- what is due next ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Enter:
    """Probe the target, then enter step ``index`` (``percent``) and move the alias."""

    index: int
    percent: int


@dataclass(frozen=True)
class Judge:
    """The window ``[start, end)`` of the current step is over and settled: judge it."""

    start: float
    end: float


@dataclass(frozen=True)
class Sleep:
    """Nothing is due before ``until``."""

    until: float


@dataclass(frozen=True)
class Idle:
    """Paused or finished: nothing to do until an operator acts."""


Action = Enter | Judge | Sleep | Idle


class Rollout(Aggregate):
    """One rollout of ``target`` on ``alias`` (the ``number``-th there), from ``baseline``."""

    class RolloutStarted(Aggregate.Created):
        alias: str
        number: int
        owner: str | None
        target: str  # release manifest digests
        target_adapter: str | None
        baseline: str
        baseline_adapter: str | None
        steps: list[int]
        window_s: float
        policy: dict[str, Any]
        started_at: float
        actor: str

    class RolloutStepEntered(Aggregate.Event):
        alias: str
        step: int  # index into steps
        percent: int
        probe: dict[str, Any]
        entered_at: float
        actor: str

    class RolloutProbeFailed(Aggregate.Event):
        alias: str
        step: int
        attempt: int
        probe: dict[str, Any]
        reasons: list[str]
        actor: str

    class RolloutWindowEvaluated(Aggregate.Event):
        alias: str
        step: int
        percent: int
        window: int  # the window's number within its step, from 1
        start: float
        end: float
        target: dict[str, Any]
        baseline: dict[str, Any]
        host_busy: int  # busy refusals before any ticket was read: no release to blame
        success_source: str
        decision: str
        reasons: list[str]
        load_failure_streak: int
        actor: str

    class RolloutPaused(Aggregate.Event):
        alias: str
        reason: str
        actor: str

    class RolloutResumed(Aggregate.Event):
        alias: str
        reason: str
        resumed_at: float
        actor: str

    class RolloutAborted(Aggregate.Event):
        alias: str
        reason: str
        actor: str

    class RolloutRolledBack(Aggregate.Event):
        alias: str
        reasons: list[str]
        sessions: str  # what became of sessions bound to the target: drain | repin
        canary_cleared: bool  # False: the alias never sent the target any traffic
        actor: str

    class RolloutCompleted(Aggregate.Event):
        alias: str
        completed_at: float
        actor: str

    @staticmethod
    def create_id(alias: str, number: int) -> UUID:
        return rollout_id(alias, number)

    @event(RolloutStarted)
    def __init__(self, alias: str, number: int, owner: str | None, target: str,
                 target_adapter: str | None, baseline: str, baseline_adapter: str | None,
                 steps: list[int], window_s: float, policy: dict[str, Any], started_at: float,
                 actor: str) -> None:
        self.alias = alias
        self.number = number
        self.owner = owner
        self.target = target
        self.target_adapter = target_adapter
        self.baseline = baseline
        self.baseline_adapter = baseline_adapter
        self.steps = list(steps)
        self.window_s = window_s
        self.policy = RolloutPolicy.from_json(policy)
        self.started_at = started_at
        self.status = RolloutStatus.RUNNING
        self.step = -1  # index of the step entered last; -1: none yet
        self.window_start: float | None = None  # start of the open window; None: none open
        self.windows_in_step = 0
        self.streak = 0  # windows in a row with load failures above the rate
        self.probe_failures = 0  # failed probes for the next step
        self.last_decision: Decision | None = None
        self.reasons: list[str] = []

    @classmethod
    def start(cls, *, alias: str, number: int, owner: str | None, target: str,
              target_adapter: str | None, baseline: str, baseline_adapter: str | None,
              steps: list[int], window_s: float, policy: RolloutPolicy, now: float,
              actor: str) -> Rollout:
        """A new rollout; the caller checked that ``baseline`` is the alias's stable release."""
        check_name("alias", alias)
        if target == baseline:
            raise IllegalTransition("the target is already the alias's stable release")
        if isinstance(window_s, bool) or not isinstance(window_s, int | float) or not (
                0.5 <= window_s <= 86_400):
            raise DomainError("the window must be from 0.5 s to one day")
        return cls(alias=alias, number=number, owner=owner, target=target,
                   target_adapter=target_adapter, baseline=baseline,
                   baseline_adapter=baseline_adapter, steps=check_steps(steps),
                   window_s=float(window_s), policy=policy.to_json(), started_at=now,
                   actor=check_actor(actor))

    # -- reading ----------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def percent(self) -> int:
        """The target's share of sessions now (0 before the first step)."""
        return self.steps[self.step] if self.step >= 0 else 0

    def next_action(self, now: float) -> Action:
        """What is due at ``now``, from the recorded events alone."""
        if self.status != RolloutStatus.RUNNING or (
                self.window_start is None and self.step + 1 >= len(self.steps)):
            return Idle()
        if self.window_start is None:  # no window open: the next step is due
            return Enter(self.step + 1, self.steps[self.step + 1])
        end = self.window_start + self.window_s
        due = end + self.policy.settle_s
        return Judge(self.window_start, end) if now >= due else Sleep(due)

    # -- the controller's moves ----------------------------------------------------------------

    def _check_running(self) -> None:
        if self.status != RolloutStatus.RUNNING:
            raise IllegalTransition(f"the rollout is {self.status.value}")

    def enter_step(self, index: int, probe: ProbeReport, now: float, actor: str) -> None:
        """Record that step ``index`` began (its probe passed); only the next step may begin."""
        self._check_running()
        if self.window_start is not None or index != self.step + 1 or index >= len(self.steps):
            raise IllegalTransition(
                f"step {index + 1} is not due: the rollout is at step {self.step + 1} of "
                f"{len(self.steps)}" + (" with a window open" if self.window_start else ""))
        if not probe.passed:
            raise IllegalTransition("a step begins only after its probe passed")
        self._step_entered(alias=self.alias, step=index, percent=self.steps[index],
                           probe=probe.to_json(), entered_at=now, actor=check_actor(actor))

    @event(RolloutStepEntered)
    def _step_entered(self, alias: str, step: int, percent: int, probe: dict[str, Any],
                      entered_at: float, actor: str) -> None:
        self.step = step
        self.windows_in_step = 0
        self.probe_failures = 0
        # The last step (100 %) has no window: the rollout completes with it.
        self.window_start = entered_at if percent < FULL else None

    def record_probe_failure(self, index: int, probe: ProbeReport, actor: str) -> bool:
        """Record a failed probe before step ``index``; True when the rollout must now roll
        back (a decisive failure, or the policy's attempts used up)."""
        self._check_running()
        if self.window_start is not None or index != self.step + 1:
            raise IllegalTransition(f"no probe is due for step {index + 1}")
        self._probe_failed(alias=self.alias, step=index, attempt=self.probe_failures + 1,
                           probe=probe.to_json(), reasons=probe.reasons(),
                           actor=check_actor(actor))
        return probe.decisive or self.probe_failures >= self.policy.probe_attempts

    @event(RolloutProbeFailed)
    def _probe_failed(self, alias: str, step: int, attempt: int, probe: dict[str, Any],
                      reasons: list[str], actor: str) -> None:
        self.probe_failures = attempt
        self.reasons = list(reasons)

    def record_window(self, start: float, end: float, target: ReleaseWindow,
                      baseline: ReleaseWindow, host_busy: int, actor: str) -> Verdict:
        """Judge the open window on its figures and record figures and decision; returns the
        verdict. The window must be the one :meth:`next_action` said was due."""
        self._check_running()
        if self.window_start is None or start != self.window_start or (
                end != self.window_start + self.window_s):
            raise IllegalTransition("that window is not the one open")
        last = self.step + 1 == len(self.steps) - 1
        v = judge_window(self.policy, target, baseline, self.streak, last_step=last)
        self._window_evaluated(
            alias=self.alias, step=self.step, percent=self.percent,
            window=self.windows_in_step + 1, start=start, end=end, target=figures(target),
            baseline=figures(baseline), host_busy=host_busy,
            success_source=v.success_source.value, decision=v.decision.value,
            reasons=v.reasons, load_failure_streak=v.load_failure_streak,
            actor=check_actor(actor))
        return v

    @event(RolloutWindowEvaluated)
    def _window_evaluated(self, alias: str, step: int, percent: int, window: int, start: float,
                          end: float, target: dict[str, Any], baseline: dict[str, Any],
                          host_busy: int, success_source: str, decision: str,
                          reasons: list[str], load_failure_streak: int, actor: str) -> None:
        self.windows_in_step = window
        self.streak = load_failure_streak
        self.last_decision = Decision(decision)
        self.reasons = list(reasons)
        # Waiting and holding open the next window right away; advancing closes the step.
        continuing = decision in (Decision.WAIT, Decision.HOLD)
        self.window_start = end if continuing else None

    # -- operators ----------------------------------------------------------------------------

    def pause(self, reason: str, actor: str) -> None:
        """Stop judging and advancing; the alias stays where it is (the canary keeps its
        share)."""
        self._check_running()
        self._paused(alias=self.alias, reason=reason, actor=check_actor(actor))

    @event(RolloutPaused)
    def _paused(self, alias: str, reason: str, actor: str) -> None:
        self.status = RolloutStatus.PAUSED

    def resume(self, reason: str, now: float, actor: str) -> None:
        """Carry on: a window open when the rollout was paused starts afresh at ``now`` (its
        traffic mixed paused and running time)."""
        if self.status != RolloutStatus.PAUSED:
            raise IllegalTransition("only a paused rollout can be resumed")
        self._resumed(alias=self.alias, reason=reason, resumed_at=now, actor=check_actor(actor))

    @event(RolloutResumed)
    def _resumed(self, alias: str, reason: str, resumed_at: float, actor: str) -> None:
        self.status = RolloutStatus.RUNNING
        if self.window_start is not None:
            self.window_start = resumed_at

    def abort(self, reason: str, actor: str) -> None:
        """An operator ends the rollout; the caller rolls it back in the same transaction."""
        if self.finished:
            raise IllegalTransition(f"the rollout is already {self.status.value}")
        if not reason.strip():
            raise DomainError("an abort needs a reason")
        self._aborted(alias=self.alias, reason=reason, actor=check_actor(actor))

    @event(RolloutAborted)
    def _aborted(self, alias: str, reason: str, actor: str) -> None:
        self.reasons = [f"aborted: {reason}"]

    def roll_back(self, reasons: list[str], sessions: Sessions, canary_cleared: bool,
                  actor: str) -> None:
        """Record the rollback: the alias no longer sends the target traffic (the caller
        clears its canary in the same transaction when it had one). ``sessions``: what was
        done with the sessions bound to the target, the policy's choice unless re-pinning was
        impossible (the caller says why in ``reasons``)."""
        if self.finished:
            raise IllegalTransition(f"the rollout is already {self.status.value}")
        self._rolled_back(alias=self.alias, reasons=list(reasons),
                          sessions=Sessions(sessions).value, canary_cleared=canary_cleared,
                          actor=check_actor(actor))

    @event(RolloutRolledBack)
    def _rolled_back(self, alias: str, reasons: list[str], sessions: str, canary_cleared: bool,
                     actor: str) -> None:
        self.status = RolloutStatus.ROLLED_BACK
        self.window_start = None
        self.reasons = list(reasons)

    def complete(self, now: float, actor: str) -> None:
        """Record the end: the last step (100 %) was entered; the caller points the alias at
        the target in the same transaction."""
        self._check_running()
        if self.step != len(self.steps) - 1:
            raise IllegalTransition("the rollout completes only once its last step began")
        self._completed(alias=self.alias, completed_at=now, actor=check_actor(actor))

    @event(RolloutCompleted)
    def _completed(self, alias: str, completed_at: float, actor: str) -> None:
        self.status = RolloutStatus.COMPLETED
