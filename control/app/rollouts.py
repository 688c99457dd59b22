"""Rollouts as commands: each move of a rollout and the alias moves that go with it, saved together.

The rules live in ``control.domain.rollout``; the controller that drives rollouts on time
(``control.ops.rollout_controller``) and the operator's verbs (``loraplane alias rollout``,
``loraplane rollout pause|resume|abort``) both act through :class:`RolloutDesk`, so every move is
recorded the same way:

- entering a step below 100 % records ``RolloutStepEntered`` and the alias's canary share
  (``AliasCanarySet``) in ONE transaction: no projection, gateway or auditor ever sees the one
  without the other;
- entering the last step (100 %) records the step, ``AliasPointed`` at the target (which clears
  the canary: it graduates), the adapter's promotion to stable and ``RolloutCompleted``, together;
- a rollback records the window (or probe, or abort) that caused it, ``AliasCanaryCleared`` (new
  traffic goes back to the stable release, which the rollout never moved), what became of the
  sessions pinned to the target and ``RolloutRolledBack``, together.

What becomes of the target's sessions on a rollback: re-pinned to the stable release
(``AliasSessionsRepinned``), drained (``AliasSessionsDrained``, only when the policy says so and
the rollback is not for a hard failure), or, when no servable stable release is there to re-pin
them to (the stable one was revoked under fallback ``none``, say), ended one by one
(``SessionEnded`` on each pin, same transaction): no session stays on a rolled-back target.
:meth:`RolloutDesk.sweep_sessions` ends pins a gateway recorded on the target just after.

Outside changes (:meth:`RolloutDesk.why_stop`): a target no longer servable, or an alias moved
by hand, rolls the rollout back; a revoked *baseline* only pauses it with an alert, and
resuming compares the canary with the alias's stable release of then.

The stable release is never touched by a rollout until it completes: its weights stay loaded and
its capacity stays where it was. Transactions go through the registry's own save
(``Registry.commit``), which saves several aggregates atomically and catches the projections up:
a rollout is a registry command like any other, kept in its own module because it is a family of
them.

Rollouts are numbered per alias (``rollout_id(alias, n)``, from 1); at most one is unfinished on
an alias at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate

from control.app.registry import Registry
from control.app.sessions import SessionPins
from control.domain import (
    CANARY,
    STABLE,
    Alias,
    AlreadyExists,
    Conflict,
    DomainError,
    IllegalTransition,
    NotFound,
    ProbeReport,
    Rollout,
    RolloutPolicy,
    Sessions,
    event_fields,
    rollout_id,
)
from control.domain.rollout import FULL, Decision, Verdict, WindowFigures

log = logging.getLogger("loraplane.rollouts")

_RETRIES = 5  # an operator's command racing the controller's save on the same rollout


@dataclass(frozen=True)
class Stop:
    """A reason found outside the windows to stop a rollout: ``roll_back``, or (False) pause
    it because its baseline was revoked. ``hard``: the target itself cannot be served."""

    reason: str
    roll_back: bool = True
    hard: bool = False


class RolloutDesk:
    """Starts rollouts and records each of their moves (see the module notes)."""

    def __init__(self, registry: Registry, clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.clock = clock

    # -- reading ------------------------------------------------------------------------------

    def get(self, rid: UUID) -> Rollout:
        """A rollout by id; NotFound if none."""
        return self.registry.load(Rollout, rid, "rollout")

    def history(self, rid: UUID) -> list[tuple[str, dict[str, Any]]]:
        """The rollout's events in recorded order, each as (event name, payload): what an
        auditor replays to see why each decision was taken."""
        return [(type(e).__name__, event_fields(e))
                for e in self.registry.repository.event_store.get(rid)]

    def latest_number(self, alias: str) -> int:
        """How many rollouts ``alias`` has had (0: none)."""
        n = 0
        while self.registry.exists(rollout_id(alias, n + 1)):
            n += 1
        return n

    def current(self, alias: str) -> Rollout:
        """The latest rollout of ``alias`` (finished or not); NotFound if it never had one."""
        n = self.latest_number(alias)
        if n == 0:
            raise NotFound("that alias has no rollout")
        return self.get(rollout_id(alias, n))

    # -- starting -----------------------------------------------------------------------------

    def start(self, alias: str, target: str, *, steps: list[int], window_s: float,
              policy: RolloutPolicy, actor: str) -> Rollout:
        """Record a rollout of ``target`` (a release digest, or an adapter digest: its release)
        on ``alias``, from the alias's stable release; the controller takes it from there.

        Refused (recording nothing) when the alias has no stable release, is operator-owned,
        has another canary or an unfinished rollout, or when the target is not servable
        (its adapter must be canary or stable) or not the owner's.
        """
        reg = self.registry
        route = reg.alias(alias)
        if route.owner is None:
            raise IllegalTransition("rollouts are for tenant aliases (an operator's base alias "
                                    "has no tenant to probe as)")
        if route.stable is None:
            raise IllegalTransition("the alias has no stable release to roll out from")
        release = reg.aliases.target_release(target, actor)
        if release.tenant is not None and release.tenant != route.owner:
            raise DomainError("release does not belong to the alias owner")
        if release.digest == route.stable:
            raise IllegalTransition("that release is already the alias's stable release")
        if route.canary is not None and route.canary != release.digest:
            raise IllegalTransition("the alias has another canary: clear it first "
                                    f"(`loraplane alias canary {alias} --clear`)")
        if not reg.release_servable(release):
            raise IllegalTransition("the target's adapter is not servable: promote it to "
                                    "canary first")
        number = self.latest_number(alias)
        if number and not self.get(rollout_id(alias, number)).finished:
            raise AlreadyExists(f"alias {alias!r} has a rollout in progress (number {number}): "
                                "abort it first")
        baseline = reg.release_manifest(route.stable)
        rollout = Rollout.start(
            alias=alias, number=number + 1, owner=route.owner, target=release.digest,
            target_adapter=release.adapter_digest, baseline=baseline.digest,
            baseline_adapter=baseline.adapter_digest, steps=steps, window_s=window_s,
            policy=policy, now=self.clock(), actor=actor)
        reg.commit(rollout, release if release.pending_events else None, what="rollout",
                  already=f"a rollout of alias {alias!r} was started concurrently")
        return rollout

    # -- the controller's moves -----------------------------------------------------------------

    def enter_step(self, rid: UUID, index: int, probe: ProbeReport, *, actor: str) -> Rollout:
        """Record step ``index`` (its probe passed) with the alias move it makes, in one
        transaction. The last step completes the rollout (see the module notes).

        When the alias was moved outside the rollout (its stable release is no longer the
        baseline) or the target stopped being servable, the rollout is rolled back instead,
        with that reason."""
        reg = self.registry
        rollout = self.get(rid)
        route = reg.alias(rollout.alias)
        release = reg.release_manifest(rollout.target)
        stop = _why_stop(self.registry, rollout, route)
        if stop is not None:
            self._stop(rollout, route, stop, actor)
            return rollout
        now = self.clock()
        rollout.enter_step(index, probe, now, actor)
        changed: list[Aggregate] = [rollout, route]
        percent = rollout.steps[index]
        if percent < FULL:
            if route.canary != release.digest or route.canary_percent != percent:
                route.set_canary(release, percent, True, actor)
        else:
            route.point(release, True, actor)  # the canary graduates: AliasPointed clears it
            if rollout.target_adapter is not None:
                adapter = reg.adapter(rollout.target_adapter)
                if adapter.state == CANARY:
                    adapter.promote(STABLE, actor, reg.tenant(adapter.tenant).policy)
                    changed.append(adapter)
            rollout.complete(now, actor)
        self._save(changed)
        return rollout

    def record_probe_failure(self, rid: UUID, index: int, probe: ProbeReport, *,
                             actor: str) -> Rollout:
        """Record a failed probe before step ``index``; when it is decisive or the last attempt
        the policy allows, the rollout rolls back in the same transaction."""
        rollout = self.get(rid)
        must_roll_back = rollout.record_probe_failure(index, probe, actor)
        if not must_roll_back:
            self._save([rollout])
            return rollout
        route = self.registry.alias(rollout.alias)
        reasons = [f"probe before step {index + 1} failed: {r}" for r in probe.reasons()]
        self._save(self._rolled_back(rollout, route, reasons, actor))
        return rollout

    def record_window(self, rid: UUID, start: float, end: float, window: WindowFigures,
                      host_busy: int, *, actor: str) -> Verdict:
        """Record a window's figures and decision; a ``roll_back`` decision rolls the rollout
        back in the same transaction (an ``inconclusive`` one pauses it, with its alert)."""
        rollout = self.get(rid)
        verdict = rollout.record_window(start, end, window, host_busy, actor)
        if verdict.decision != Decision.ROLL_BACK:
            self._save([rollout])
            return verdict
        route = self.registry.alias(rollout.alias)
        self._save(self._rolled_back(rollout, route, verdict.reasons, actor, hard=verdict.hard))
        return verdict

    def roll_back(self, rid: UUID, reasons: list[str], *, actor: str,
                  hard: bool = False) -> Rollout:
        """Roll back for a reason found outside the windows (a hard failure the controller saw
        as it happened, the target revoked). ``hard``: the target cannot serve correctly, so
        its sessions are re-pinned or ended whatever the policy says."""
        rollout = self.get(rid)
        route = self.registry.alias(rollout.alias)
        self._save(self._rolled_back(rollout, route, reasons, actor, hard=hard))
        return rollout

    def why_stop(self, rollout: Rollout) -> Stop | None:
        """A reason to stop ``rollout`` now, found outside its windows (None: carry on)."""
        return _why_stop(self.registry, rollout, self.registry.alias(rollout.alias))

    def stop(self, rid: UUID, stop: Stop, *, actor: str) -> Rollout:
        """Apply ``stop`` (from :meth:`why_stop`): roll back, or pause with an alert."""
        rollout = self.get(rid)
        self._stop(rollout, self.registry.alias(rollout.alias), stop, actor)
        return rollout

    def alert_unjudged(self, rid: UUID, *, actor: str) -> bool:
        """Record that the rollout's open window went unjudged longer than its policy allows
        (once per window); True when recorded."""
        rollout = self.get(rid)
        if not rollout.alert_unjudged(self.clock(), actor):
            return False
        self._save([rollout])
        return True

    def sweep_sessions(self, rid: UUID, *, actor: str) -> int:
        """End the sessions still pinned to a rolled-back rollout's target (a gateway may
        have pinned one just as the rollback was recorded); returns how many. Nothing for a
        rollout that drained its sessions, or that did not roll back."""
        rollout = self.get(rid)
        if rollout.status != "rolled_back" or self._sessions_choice(rid) == Sessions.DRAIN:
            return 0
        pins = SessionPins(self.registry, actor=actor, clock=self.clock)
        ended = pins.ending(pins.live_on(rollout.alias, rollout.target))
        if ended:
            self.registry.commit(*ended, what="session pin")
        return len(ended)

    # -- operators ----------------------------------------------------------------------------

    def pause(self, alias: str, reason: str, *, actor: str) -> Rollout:
        """Stop the alias's rollout where it stands; the canary keeps its share."""

        def pause(r: Rollout) -> list[Aggregate]:
            r.pause(reason, actor)
            return [r]

        return self._retrying(alias, pause)

    def resume(self, alias: str, reason: str, *, actor: str) -> Rollout:
        """Carry on a paused rollout; an open window starts afresh now."""

        def resume(r: Rollout) -> list[Aggregate]:
            route = self.registry.alias(r.alias)
            baseline = None
            if r.baseline_lost:
                stable = (None if route.stable is None
                          else self.registry.release_manifest(route.stable))
                if stable is None or not self.registry.release_servable(stable):
                    raise IllegalTransition(
                        "the stable release this rollout compared against was revoked and the "
                        "alias has no servable stable release now: point it at one (`loraplane "
                        f"alias point {r.alias} ...`), then resume, or abort the rollout")
                baseline = (stable.digest, stable.adapter_digest)
            r.resume(reason, self.clock(), actor, baseline=baseline)
            if baseline is None or r.step < 0 or r.percent >= FULL:
                return [r]
            # The revocation's fallback may have cleared the canary: it gets its share back.
            if route.canary != r.target or route.canary_percent != r.percent:
                route.set_canary(self.registry.release_manifest(r.target), r.percent, True,
                                 actor)
            return [r, route]

        return self._retrying(alias, resume)

    def abort(self, alias: str, reason: str, *, actor: str) -> Rollout:
        """End the alias's rollout and roll it back, in one transaction."""

        def abort(r: Rollout) -> list[Aggregate]:
            r.abort(reason, actor)
            return self._rolled_back(r, self.registry.alias(r.alias),
                                     [f"aborted by {actor}: {reason}"], actor)

        return self._retrying(alias, abort)

    # -- helpers ------------------------------------------------------------------------------

    def _retrying(self, alias: str, move: Callable[[Rollout], list[Aggregate]]) -> Rollout:
        for attempt in range(_RETRIES):
            rollout = self.current(alias)
            try:
                self._save(move(rollout))
                return rollout
            except Conflict:
                if attempt == _RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _save(self, aggregates: list[Aggregate]) -> None:
        self.registry.commit(*aggregates, what="rollout")

    def _sessions_choice(self, rid: UUID) -> str | None:
        """What the rollback of ``rid`` recorded for its sessions (None: not rolled back)."""
        for name, fields in reversed(self.history(rid)):
            if name == "RolloutRolledBack":
                return str(fields["sessions"])
        return None

    def _stop(self, rollout: Rollout, route: Alias, stop: Stop, actor: str) -> None:
        if stop.roll_back:
            self._save(self._rolled_back(rollout, route, [stop.reason], actor, hard=stop.hard))
        else:
            rollout.lose_baseline(stop.reason, self.clock(), actor)
            self._save([rollout])

    def _rolled_back(self, rollout: Rollout, route: Alias, reasons: list[str], actor: str,
                     *, hard: bool = False) -> list[Aggregate]:
        """Apply the rollback to ``rollout`` and ``route`` (nothing saved): the canary
        cleared, the target's sessions re-pinned to the stable release, drained or ended (see
        the module notes). Returns every aggregate to save, in one transaction."""
        reg = self.registry
        cleared = route.canary == rollout.target
        if cleared:
            route.clear_canary(actor)
        choice = rollout.policy.sessions
        if hard and choice == Sessions.DRAIN:
            choice = Sessions.REPIN
            reasons = [*reasons, "a hard failure: the target's sessions do not drain"]
        why = f"rollout {rollout.number} of {rollout.alias} rolled back"
        if choice == Sessions.REPIN:
            stable = None if route.stable is None else reg.release_manifest(route.stable)
            if (stable is not None and reg.release_servable(stable)
                    and stable.digest != rollout.target):
                route.repin_sessions(rollout.target, stable, True, why, actor)
            else:
                choice = Sessions.END
                reasons = [*reasons, "no servable stable release to re-pin to: the target's "
                                     "sessions ended"]
        ended: list[Aggregate] = []
        if choice == Sessions.END:
            pins = SessionPins(reg, actor=actor, clock=self.clock)
            ended.extend(pins.ending(pins.live_on(rollout.alias, rollout.target)))
        elif choice == Sessions.DRAIN:
            route.drain_sessions(rollout.target, why, actor)
        rollout.roll_back(reasons, choice, cleared, actor)
        return [rollout, route, *ended]


def _why_stop(reg: Registry, rollout: Rollout, route: Alias) -> Stop | None:
    """A reason found outside the windows to stop ``rollout`` (``route``: its alias now)."""
    if not reg.release_servable(reg.release_manifest(rollout.target)):
        return Stop("the target is no longer servable (revoked or deprecated)", hard=True)
    if route.canary not in (None, rollout.target):
        return Stop("the alias's canary was changed outside the rollout")
    baseline_gone = not reg.release_servable(reg.release_manifest(rollout.baseline))
    if baseline_gone:
        # Not the canary's doing: pause and call for an operator (once), never discard it.
        return None if rollout.baseline_lost else Stop(
            "the stable release the canary is compared with was revoked (or deprecated); "
            "the alias now serves "
            + ("nothing" if route.stable is None else "another stable release")
            + ": paused, resume to compare with the alias's stable release", roll_back=False)
    if route.stable != rollout.baseline:
        return Stop("the alias's stable release was changed outside the rollout")
    return None
