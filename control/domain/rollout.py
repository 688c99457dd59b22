"""The ``Rollout`` aggregate: a canary that advances and rolls back on its own.

A rollout moves one alias from its stable release (the *baseline*) to a *target* release through
steps of traffic share (``1, 10, 50, 100`` per cent of sessions). Each step is entered only after
the target was preloaded and health-probed on the hosts. From the first step on, the canary is
judged window after window of ``window_s`` seconds, with no gap: each window starts where the last
one ended, across step changes and pauses, until the rollout finishes, so every request the
canary serves falls in a judged window. Each window's figures join the current step's evidence,
and the judge (:mod:`control.domain.rollout_judge`, with the policy of
:mod:`control.domain.rollout_policy`) decides from the step's whole evidence:

- ``roll_back``: a hard failure (identity mismatch, failed load of the target's adapter, every
  request refused) or a metric significantly worse than stable's;
- ``advance`` (``complete`` when the next step is 100 %): every gating metric significantly
  not worse than the margin; the next step is then due (probe, then the alias moves);
- ``wait``: nothing concluded, or paused (a paused rollout is still judged and still rolls
  back; it only does not advance);
- ``inconclusive``: the step's deadline passed undecided: the rollout pauses and records an
  alert (``RolloutAlerted``), and an operator resumes (a new deadline) or aborts it.

Alerts (``RolloutAlerted``) are also recorded when a window went unjudged much longer than its
policy allows (no controller was running), and when the baseline is revoked: the rollout then
pauses instead of discarding a canary that did nothing wrong; resuming it compares the canary
with the alias's stable release of then (``RolloutRebased``, fresh evidence).

The aggregate holds what has happened and what is due next (:meth:`Rollout.next_action`); it
never reads a clock, a database or a host: the controller (``control.ops.rollout_controller``)
brings the time, the probe reports and the ledger figures. That is also why a controller killed
at any point resumes correctly: what is due next follows from the recorded events alone, and
:meth:`Rollout.enter_step` refuses any step but the next one, so no step is repeated or skipped
(two controllers racing collide on the event store's version index instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate, event

from control.domain.errors import DomainError, IllegalTransition
from control.domain.ids import NAMESPACE
from control.domain.names import check_actor, check_name
from control.domain.rollout_judge import (
    Decision,
    Evidence,
    Verdict,
    WindowFigures,
    figures,
    judge_window,
)
from control.domain.rollout_policy import FULL, RolloutPolicy, Sessions, check_steps
from control.domain.rollout_probe import ProbeReport

__all__ = [
    "FULL", "Action", "AlertKind", "Decision", "Enter", "Evidence", "Idle", "Judge",
    "ProbeReport", "Rollout", "RolloutPolicy", "RolloutStatus", "Sessions", "Sleep",
    "Verdict", "WindowFigures", "check_steps", "judge_window", "rollout_id",
]


class RolloutStatus(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    ROLLED_BACK = "rolled_back"
    COMPLETED = "completed"


FINISHED = frozenset({RolloutStatus.ROLLED_BACK, RolloutStatus.COMPLETED})


class AlertKind(StrEnum):
    """Why a rollout called for an operator (``RolloutAlerted``)."""

    INCONCLUSIVE = "inconclusive"  # the step's deadline passed undecided; the rollout paused
    UNJUDGED = "unjudged"  # a window went unjudged longer than the policy allows
    BASELINE_REVOKED = "baseline_revoked"  # the stable release compared with was revoked


def rollout_id(alias: str, number: int) -> UUID:
    """The id of the ``number``-th rollout (from 1) of ``alias``: two processes starting the
    same one collide on the event store's unique index."""
    return uuid5(NAMESPACE, f"rollout:{alias}#{number}")


# -- what is due next ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Enter:
    """Probe the target, then enter step ``index`` (``percent``) and move the alias."""

    index: int
    percent: int


@dataclass(frozen=True)
class Judge:
    """The window ``[start, end)`` is over and settled: judge it."""

    start: float
    end: float


@dataclass(frozen=True)
class Sleep:
    """Nothing is due before ``until``."""

    until: float


@dataclass(frozen=True)
class Idle:
    """Finished, or paused before any step: nothing to do until an operator acts."""


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
        latency: dict[str, Any]  # {"slow", "timed"}: the target's requests beside stable's p95
        load_failures: int  # failed loads of the target's adapter, capacity refusals aside
        decision: str
        reasons: list[str]
        evidence: dict[str, Any] | None  # the step's evidence with this window (None: v1)
        metrics: dict[str, Any]  # per metric: tallies, bounds, state
        actor: str

        # Version 2: the sequential analysis. A version 1 window was judged alone: it carries
        # no evidence and no per-metric bounds, and its success source and load-failure run
        # are no longer part of any rule.
        class_version = 2

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            state.pop("success_source", None)
            state.pop("load_failure_streak", None)
            state["latency"] = {}
            state["load_failures"] = 0
            state["evidence"] = None
            state["metrics"] = {}

    class RolloutPaused(Aggregate.Event):
        alias: str
        reason: str
        actor: str

    class RolloutResumed(Aggregate.Event):
        alias: str
        reason: str
        resumed_at: float
        actor: str

    class RolloutAlerted(Aggregate.Event):
        alias: str
        kind: str  # an AlertKind
        message: str
        at: float
        actor: str

    class RolloutRebased(Aggregate.Event):
        """The canary is compared with another stable release from now on (the one it was
        compared with was revoked); the step's evidence starts afresh."""

        alias: str
        baseline: str
        baseline_adapter: str | None
        reason: str
        at: float
        actor: str

    class RolloutAborted(Aggregate.Event):
        alias: str
        reason: str
        actor: str

    class RolloutRolledBack(Aggregate.Event):
        alias: str
        reasons: list[str]
        sessions: str  # what became of sessions bound to the target: drain | repin | end
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
        self.evidence = Evidence()  # the current step's, all its windows summed
        self.advance_due = False  # the evidence let the step advance; the next one is due
        self.deadline_at: float | None = None  # the current step's, by window end time
        self.baseline_lost = False  # the baseline was revoked; resuming rebases
        self.unjudged_alerted: float | None = None  # when an outage was last alerted
        self.alerts: list[dict[str, Any]] = []
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

    @property
    def test_alpha(self) -> float:
        """The level of each statistical rollback test of this rollout (the policy's alpha
        split over its judged steps and metrics)."""
        return self.policy.test_alpha(len(self.steps) - 1)

    def due_at(self) -> float | None:
        """When the open window is due to be judged (None: no window open)."""
        if self.window_start is None:
            return None
        return self.window_start + self.window_s + self.policy.settle_s

    def unjudged_for(self, now: float) -> float | None:
        """How long past its due time the open window is, when that is longer than the policy
        allows (None otherwise): nothing has been judging this canary."""
        due = self.due_at()
        if self.finished or due is None or now - due <= self.policy.max_unjudged_s:
            return None
        return now - due

    def next_action(self, now: float) -> Action:
        """What is due at ``now``, from the recorded events alone: a settled window first
        (paused or not), then the next step when one is due and the rollout runs."""
        if self.finished:
            return Idle()
        due = self.due_at()
        if due is not None and now >= due:
            assert self.window_start is not None
            return Judge(self.window_start, self.window_start + self.window_s)
        if self._step_due():
            return Enter(self.step + 1, self.steps[self.step + 1])
        return Idle() if due is None else Sleep(due)

    def _step_due(self) -> bool:
        return (self.status == RolloutStatus.RUNNING and not self.baseline_lost
                and self.step + 1 < len(self.steps) and (self.step == -1 or self.advance_due))

    # -- the controller's moves ----------------------------------------------------------------

    def _check_running(self) -> None:
        if self.status != RolloutStatus.RUNNING:
            raise IllegalTransition(f"the rollout is {self.status.value}")

    def _check_unfinished(self) -> None:
        if self.finished:
            raise IllegalTransition(f"the rollout is {self.status.value}")

    def enter_step(self, index: int, probe: ProbeReport, now: float, actor: str) -> None:
        """Record that step ``index`` began (its probe passed); only the next step may begin,
        and only once the last one's evidence let it advance."""
        self._check_running()
        if not self._step_due() or index != self.step + 1:
            raise IllegalTransition(
                f"step {index + 1} is not due: the rollout is at step {self.step + 1} of "
                f"{len(self.steps)}" + ("" if self.advance_due or self.step < 0
                                        else ", still being judged"))
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
        self.advance_due = False
        self.evidence = Evidence()
        self.deadline_at = entered_at + self.policy.step_deadline_s
        if percent >= FULL:
            self.window_start = None  # the last step completes the rollout at once
        elif self.window_start is None:
            # The first judged window opens with the first share; later steps carry on with
            # the window already open, so the time between steps is judged too.
            self.window_start = entered_at

    def record_probe_failure(self, index: int, probe: ProbeReport, actor: str) -> bool:
        """Record a failed probe before step ``index``; True when the rollout must now roll
        back (a decisive failure, or the policy's attempts used up)."""
        self._check_running()
        if not self._step_due() or index != self.step + 1:
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

    def record_window(self, start: float, end: float, window: WindowFigures, host_busy: int,
                      actor: str) -> Verdict:
        """Judge the open window with the step's evidence and record figures and decision;
        returns the verdict. The window must be the one :meth:`next_action` said was due. An
        ``inconclusive`` decision also pauses the rollout and records an alert."""
        self._check_unfinished()
        if self.window_start is None or start != self.window_start or (
                end != self.window_start + self.window_s):
            raise IllegalTransition("that window is not the one open")
        paused = self.status == RolloutStatus.PAUSED
        v = judge_window(
            self.policy, self.test_alpha, self.evidence, window,
            last_step=self.step + 1 == len(self.steps) - 1, paused=paused,
            past_deadline=(not self.advance_due and self.deadline_at is not None
                           and end >= self.deadline_at))
        actor = check_actor(actor)
        self._window_evaluated(
            alias=self.alias, step=self.step, percent=self.percent,
            window=self.windows_in_step + 1, start=start, end=end,
            target=figures(window.target), baseline=figures(window.baseline),
            host_busy=host_busy, latency={"slow": window.slow, "timed": window.timed},
            load_failures=window.load_failures, decision=v.decision.value, reasons=v.reasons,
            evidence=v.evidence.to_json(), metrics=v.metrics_json(), actor=actor)
        if v.decision == Decision.INCONCLUSIVE:
            why = f"step {self.step + 1} ({self.percent}%) inconclusive at its deadline"
            self._paused(alias=self.alias, reason=why, actor=actor)
            self._alerted(alias=self.alias, kind=AlertKind.INCONCLUSIVE.value,
                          message=f"{why}: " + "; ".join(v.reasons[1:]), at=end, actor=actor)
        return v

    @event(RolloutWindowEvaluated)
    def _window_evaluated(self, alias: str, step: int, percent: int, window: int, start: float,
                          end: float, target: dict[str, Any], baseline: dict[str, Any],
                          host_busy: int, latency: dict[str, Any], load_failures: int,
                          decision: str, reasons: list[str], evidence: dict[str, Any] | None,
                          metrics: dict[str, Any], actor: str) -> None:
        self.windows_in_step = window
        self.last_decision = Decision(decision)
        self.reasons = list(reasons)
        advanced = decision in (Decision.ADVANCE, Decision.COMPLETE)
        self.advance_due = self.advance_due or advanced
        if evidence is None:
            # Version 1: each window judged alone, and advancing closed the step's window.
            self.window_start = end if decision in (Decision.WAIT, Decision.HOLD) else None
            return
        self.evidence = Evidence.from_json(evidence)
        self.window_start = end  # windows follow on, whatever was decided

    # -- alerts -----------------------------------------------------------------------------

    def alert_unjudged(self, now: float, actor: str) -> bool:
        """Record that the open window went unjudged longer than the policy allows (once per
        outage: windows that began before the last such alert are being caught up); True when
        recorded."""
        late = self.unjudged_for(now)
        if late is None or (self.unjudged_alerted is not None
                            and self.window_start is not None
                            and self.window_start < self.unjudged_alerted):
            return False  # this outage was alerted already: the windows are being caught up
        self._alerted(alias=self.alias, kind=AlertKind.UNJUDGED.value,
                      message=f"window from {self.window_start:.3f} was due {late:.0f} s ago "
                              f"and nothing judged it (is a rollout controller running?); the "
                              f"canary held {self.percent}% meanwhile", at=now,
                      actor=check_actor(actor))
        return True

    def lose_baseline(self, message: str, now: float, actor: str) -> None:
        """The baseline (the stable release compared with) was revoked: pause and alert. The
        canary is not rolled back for what its baseline did."""
        self._check_unfinished()
        if self.baseline_lost:
            raise IllegalTransition("the rollout's baseline was already recorded as revoked")
        actor = check_actor(actor)
        if self.status == RolloutStatus.RUNNING:
            self._paused(alias=self.alias, reason=message, actor=actor)
        self._alerted(alias=self.alias, kind=AlertKind.BASELINE_REVOKED.value, message=message,
                      at=now, actor=actor)

    @event(RolloutAlerted)
    def _alerted(self, alias: str, kind: str, message: str, at: float, actor: str) -> None:
        self.alerts.append({"kind": kind, "message": message, "at": at})
        if kind == AlertKind.BASELINE_REVOKED:
            self.baseline_lost = True
        elif kind == AlertKind.UNJUDGED:
            self.unjudged_alerted = at

    # -- operators ----------------------------------------------------------------------------

    def pause(self, reason: str, actor: str) -> None:
        """Stop advancing; the alias stays where it is (the canary keeps its share) and every
        window is still judged: the rollout still rolls back on its own."""
        self._check_running()
        self._paused(alias=self.alias, reason=reason, actor=check_actor(actor))

    @event(RolloutPaused)
    def _paused(self, alias: str, reason: str, actor: str) -> None:
        self.status = RolloutStatus.PAUSED

    def resume(self, reason: str, now: float, actor: str, *,
               baseline: tuple[str, str | None] | None = None) -> None:
        """Carry on: the step gets a new deadline from ``now``. A rollout whose baseline was
        revoked needs ``baseline`` (release digest, adapter digest): the alias's stable release
        now, which the canary is compared with from here on, with fresh evidence."""
        if self.status != RolloutStatus.PAUSED:
            raise IllegalTransition("only a paused rollout can be resumed")
        actor = check_actor(actor)
        if self.baseline_lost:
            if baseline is None:
                raise IllegalTransition(
                    "the stable release this rollout compared against was revoked: point the "
                    "alias at a servable stable release, then resume (or abort the rollout)")
            if baseline[0] == self.target:
                raise IllegalTransition("the alias's stable release is the target itself")
            self._rebased(alias=self.alias, baseline=baseline[0], baseline_adapter=baseline[1],
                          reason=reason, at=now, actor=actor)
        self._resumed(alias=self.alias, reason=reason, resumed_at=now, actor=actor)

    @event(RolloutRebased)
    def _rebased(self, alias: str, baseline: str, baseline_adapter: str | None, reason: str,
                 at: float, actor: str) -> None:
        self.baseline = baseline
        self.baseline_adapter = baseline_adapter
        self.baseline_lost = False
        self.evidence = Evidence()  # the open window is judged against the new baseline

    @event(RolloutResumed)
    def _resumed(self, alias: str, reason: str, resumed_at: float, actor: str) -> None:
        self.status = RolloutStatus.RUNNING
        if self.step >= 0:
            self.deadline_at = resumed_at + self.policy.step_deadline_s

    def abort(self, reason: str, actor: str) -> None:
        """An operator ends the rollout; the caller rolls it back in the same transaction."""
        self._check_unfinished()
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
        done with the sessions bound to the target."""
        self._check_unfinished()
        self._rolled_back(alias=self.alias, reasons=list(reasons),
                          sessions=Sessions(sessions).value, canary_cleared=canary_cleared,
                          actor=check_actor(actor))

    @event(RolloutRolledBack)
    def _rolled_back(self, alias: str, reasons: list[str], sessions: str, canary_cleared: bool,
                     actor: str) -> None:
        self.status = RolloutStatus.ROLLED_BACK
        self.window_start = None
        self.advance_due = False
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
