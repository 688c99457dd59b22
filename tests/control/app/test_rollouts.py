"""Rollouts through the registry and the controller, with a fake clock and a fake probe (no
Triton), on SQLite and PostgreSQL: each step and its alias move are one transaction, a step's
windows are judged from the ledger rows the test writes as evidence that accumulates, a rollback
clears the canary and moves the target's sessions in the same transaction, hard failures act as
they happen, and a controller started afresh at any point carries on without repeating or
skipping a step. (The review's findings are reproduced in ``test_rollout_findings.py``.)"""

from __future__ import annotations

from typing import Any

import pytest

from control.app.sessions import SessionPins
from control.contracts.ledger import AdapterLoad, Outcome
from control.domain import (
    STABLE,
    AlreadyExists,
    IllegalTransition,
    ProbeReport,
    RolloutPolicy,
    RolloutStatus,
)
from control.ops.rollout_controller import RolloutController, liveness_metrics
from projections.routing import RoutingView
from tests.control.app.rollout_world import ALIAS, WINDOW, RolloutWorld, World
from tests.fixtures_control import OnPostgres, OnSQLite

# A 10-point margin lets 40 clean requests per arm advance a step: small enough to write.
POLICY = RolloutPolicy(min_requests=20, min_ratings=20, margin_pp=10, settle_s=1.0,
                       probe_attempts=2)
CLEAN = 40


def start(w: World, steps: list[int] | None = None, policy: RolloutPolicy = POLICY) -> Any:
    return w.desk.start(ALIAS, w.target, steps=steps or [25, 50, 100], window_s=WINDOW,
                        policy=policy, actor="alice")


def good_window(w: World, c: RolloutController, n: int = CLEAN) -> None:
    """A window of clean traffic on both arms, then the tick that judges it (and enters the
    next step, which the judgement made due)."""
    stable, canary = w.releases()
    w.traffic(canary, w.target, n)
    w.traffic(stable, w.stable, n)
    w.clock.now += WINDOW
    assert c.tick() >= 1


def pins_on(w: World, release: str) -> list[str]:
    w.reg.follower.catch_up()
    return sorted(p.session for p in RoutingView(w.reg.follower.engine).session_pins(ALIAS)
                  if p.release == release and p.holds(w.clock.now))


class RolloutContract(RolloutWorld):
    def test_a_good_rollout_walks_every_step_to_completion(self, world: World) -> None:
        w = world
        before = w.reg.alias(ALIAS).stable
        r = start(w)
        c = w.controller()
        assert c.tick() == 1  # probed, step 1 entered with the canary at 25 %
        a = w.reg.alias(ALIAS)
        assert (a.canary_percent, w.desk.get(r.id).percent) == (25, 25)
        w.clock.now += POLICY.settle_s
        good_window(w, c)  # judged: advance; the next step entered in the same tick
        assert w.reg.alias(ALIAS).canary_percent == 50
        good_window(w, c)  # complete: the alias points at the target
        done = w.desk.get(r.id)
        a = w.reg.alias(ALIAS)
        assert done.status == RolloutStatus.COMPLETED
        assert (a.stable, a.canary, a.history[-1]) == (w.release_of(w.target), None, before)
        assert w.reg.adapter(w.target).state == STABLE
        assert w.reg.adapter(w.stable).state == STABLE  # the previous stable is untouched
        assert [e.summary["percent"] for e in w.events("RolloutStepEntered")] == [25, 50, 100]
        windows = w.events("RolloutWindowEvaluated")
        assert [x.summary["decision"] for x in windows] == ["advance", "complete"]
        # Windows follow on: the second began where the first ended, across the step change.
        assert windows[1].summary["start"] == windows[0].summary["end"]
        assert c.tick() == 0 and not c.unfinished

    def test_each_step_and_its_alias_move_are_one_transaction(self, world: World,
                                                               view: RoutingView) -> None:
        w = world
        start(w)
        w.controller().tick()
        log = w.events("RolloutStepEntered") + w.events("AliasCanarySet")
        step, moved = log[0], log[-1]
        assert moved.summary["percent"] == 25
        # Adjacent positions, saved by one command: nothing can be recorded in between.
        assert abs(step.position - moved.position) == 1
        # What gateways resolve by (the projection) shows the share the step recorded.
        row = view.alias_row(ALIAS)
        assert row is not None and row.canary_percent == step.summary["percent"]

    def test_a_worse_feedback_rate_rolls_back_in_one_transaction(self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        stable, canary = w.releases()
        w.clock.now += 1
        w.traffic(canary, w.target, 30, rated=False)  # answered ok, rated as failures
        w.traffic(stable, w.stable, 30, rated=True)
        w.clock.now += WINDOW
        assert c.tick() == 1
        done = w.desk.get(r.id)
        a = w.reg.alias(ALIAS)
        assert done.status == RolloutStatus.ROLLED_BACK
        assert (a.stable, a.canary) == (r.baseline, None)
        window = w.events("RolloutWindowEvaluated")[-1].summary
        assert window["decision"] == "roll_back"
        assert window["metrics"]["feedback"]["state"] == "worse"
        assert window["metrics"]["errors"]["state"] != "worse"  # the ledger said all ok
        rolled = w.events("RolloutRolledBack")[-1]
        assert rolled.summary["sessions"] == "repin" and rolled.summary["canary_cleared"]
        repinned = w.events("AliasSessionsRepinned")[-1]
        assert (repinned.summary["from_release"], repinned.summary["to_release"]) == (
            r.target, r.baseline)
        cleared = w.events("AliasCanaryCleared")[-1]
        positions = sorted([rolled.position, repinned.position, cleared.position,
                            w.events("RolloutWindowEvaluated")[-1].position])
        assert positions == list(range(positions[0], positions[0] + 4))  # one transaction
        assert c.tick() == 0

    def test_evidence_accumulates_over_quiet_windows_until_the_step_decides(
            self, world: World) -> None:
        w = world
        start(w)
        c = w.controller()
        c.tick()
        w.clock.now += POLICY.settle_s
        for _ in range(3):
            stable, canary = w.releases()
            w.traffic(canary, w.target, 12)
            w.traffic(stable, w.stable, 12)
            w.clock.now += WINDOW
            c.tick()
        windows = [e.summary for e in w.events("RolloutWindowEvaluated")]
        assert [x["decision"] for x in windows][:2] == ["wait", "wait"]
        assert windows[-1]["decision"] == "advance"  # 36 per arm: more than any one window
        assert windows[-1]["evidence"]["errors"] == [[36, 36], [36, 36]]
        assert w.reg.alias(ALIAS).canary_percent == 50

    def test_an_identity_mismatch_rolls_back_as_soon_as_it_is_seen(self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        _stable, canary = w.releases()
        w.clock.now += 2
        w.traffic(canary, w.target, 1, outcome=Outcome.IDENTITY_MISMATCH)
        w.clock.now += c.check_s  # well before the window's end
        c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK
        assert done.reasons[0].startswith("seen as it happened: identity mismatches: 1")
        assert not w.events("RolloutWindowEvaluated")  # no window had ended

    def test_a_failed_load_rolls_back_at_once_but_a_full_host_does_not(
            self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        w.clock.now += 1
        w.ledger.record_load(AdapterLoad("h1", w.target, w.clock.now, 0.1, "failed",
                                         reason="no_room"))  # the host was full: capacity
        w.clock.now += c.check_s
        c.tick()
        assert w.desk.get(r.id).status == RolloutStatus.RUNNING
        w.ledger.record_load(AdapterLoad("h1", w.target, w.clock.now, 0.1, "failed",
                                         reason="DigestMismatch"))
        w.clock.now += c.check_s
        c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK and "load failures: 1" in done.reasons[0]

    def test_a_probe_that_sees_a_load_failure_rolls_back_before_any_traffic_moves(
            self, world: World) -> None:
        w = world
        r = start(w)
        w.reg.clear_canary(ALIAS, actor="op")  # no share before the rollout's first step
        w.probe.reports = [ProbeReport(hosts=["h"], requests=2, ok=0, load_failures=2,
                                       errors=["h: refused (503)"])]
        w.controller().tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK and done.step == -1
        rolled = w.events("RolloutRolledBack")[-1].summary
        assert rolled["canary_cleared"] is False and "load failures" in rolled["reasons"][0]
        assert not w.events("RolloutStepEntered")

    def test_an_unhealthy_probe_is_retried_then_passes(self, world: World) -> None:
        w = world
        r = start(w)
        down = ProbeReport(hosts=["h"], requests=2, ok=0, errors=["h: unreachable"])
        w.probe.reports = [down, ProbeReport(hosts=["h"], requests=2, ok=2)]
        c = w.controller()
        c.tick()
        assert w.desk.get(r.id).status == RolloutStatus.RUNNING
        c.tick()
        assert w.desk.get(r.id).percent == 25  # the second attempt passed
        assert [e.summary["attempt"] for e in w.events("RolloutProbeFailed")] == [1]

    def test_a_controller_started_afresh_at_any_point_neither_repeats_nor_skips(
            self, world: World) -> None:
        w = world
        r = start(w)
        for _ in range(12):  # a new controller for every tick: a crash between each
            c = w.controller()
            rollout = w.desk.get(r.id)
            if rollout.finished:
                break
            if rollout.window_start is not None:
                stable, canary = w.releases()
                w.traffic(canary, w.target, CLEAN)
                w.traffic(stable, w.stable, CLEAN)
                w.clock.now += WINDOW + 1
            c.tick()
            c.tick()  # and a second tick of the same one changes nothing more
        assert w.desk.get(r.id).status == RolloutStatus.COMPLETED
        assert [e.summary["step"] for e in w.events("RolloutStepEntered")] == [0, 1, 2]

    def test_operators_pause_resume_and_abort(self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        w.desk.pause(ALIAS, "looking at a ticket", actor="bob")
        stable, canary = w.releases()
        w.traffic(canary, w.target, CLEAN)
        w.traffic(stable, w.stable, CLEAN)
        w.clock.now += WINDOW + 1
        c.tick()
        paused = w.desk.get(r.id)
        assert paused.status == RolloutStatus.PAUSED and paused.percent == 25
        assert w.events("RolloutWindowEvaluated")[-1].summary["decision"] == "wait"
        w.desk.resume(ALIAS, "fine", actor="bob")
        assert w.desk.get(r.id).deadline_at == w.clock.now + POLICY.step_deadline_s
        w.desk.abort(ALIAS, "wrong target", actor="bob")
        a = w.reg.alias(ALIAS)
        assert (a.stable, a.canary) == (r.baseline, None)
        assert w.desk.get(r.id).status == RolloutStatus.ROLLED_BACK
        assert w.events("RolloutRolledBack")[-1].summary["reasons"] == [
            "aborted by bob: wrong target"]
        with pytest.raises(IllegalTransition):
            w.desk.abort(ALIAS, "again", actor="bob")
        assert c.tick() == 0

    def test_an_alias_moved_outside_the_rollout_rolls_it_back(self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        w.reg.point_alias(ALIAS, w.target, actor="op")  # an operator takes over by hand
        w.clock.now += 1  # the controller looks for outside changes once a second
        c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK
        assert "changed outside the rollout" in done.reasons[0]

    def test_a_revoked_target_rolls_back_and_its_sessions_move_even_under_drain(
            self, world: World) -> None:
        w = world
        r = start(w, policy=RolloutPolicy(**{**POLICY.to_json(), "sessions": "drain"}))
        c = w.controller()
        c.tick()
        pins = SessionPins(w.reg, actor="gateway", clock=w.clock)
        pins.pin("acme", ALIAS, "s1", w.desk.get(r.id).target, servable=lambda _r: True)
        w.reg.revoke(w.target, "bad weights", actor="sec")
        w.clock.now += 1
        c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK and "no longer servable" in done.reasons[0]
        rolled = w.events("RolloutRolledBack")[-1].summary
        assert rolled["sessions"] == "repin"  # a hard failure: the policy's drain is overridden
        assert pins_on(w, done.target) == []

    def test_resuming_after_the_baseline_was_revoked_gives_the_canary_its_share_back(
            self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        w.reg.revoke(w.stable, "leaked", actor="sec")  # fallback none: canary cleared too
        w.clock.now += 1
        c.tick()
        assert w.desk.get(r.id).status == RolloutStatus.PAUSED
        assert w.reg.alias(ALIAS).canary is None
        with pytest.raises(IllegalTransition, match="no servable stable release"):
            w.desk.resume(ALIAS, "go on", actor="bob")
        gamma = w.reg.register_adapter(w.artifacts.adapters["gamma"], tenant="acme",
                                       alias=ALIAS, actor="op")
        w.reg.advance(gamma, evaluation={"suite": "smoke", "passed": True,
                                         "producer": "test"}, to="canary", actor="op",
                      external=True)  # the alias had no stable release: gamma's becomes it
        assert w.reg.alias(ALIAS).stable == w.release_of(gamma)
        w.clock.now += 1
        c.tick()  # a new stable after the revocation is not "moved outside" this rollout
        assert w.desk.get(r.id).status == RolloutStatus.PAUSED
        w.desk.resume(ALIAS, "compare with gamma", actor="bob")
        resumed = w.desk.get(r.id)
        a = w.reg.alias(ALIAS)
        assert resumed.status == RolloutStatus.RUNNING and resumed.baseline == a.stable
        assert (a.canary, a.canary_percent) == (r.target, 25)
        assert [e.event_type for e in w.events("RolloutRebased")] == ["RolloutRebased"]

    def test_pins_recorded_on_the_target_just_after_a_rollback_are_ended(
            self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        c.tick()  # the controller has read the log once: later rollbacks are new to it
        w.desk.abort(ALIAS, "wrong target", actor="bob")
        # A gateway whose view still had the canary pins a session to it just after.
        SessionPins(w.reg, actor="gateway", clock=w.clock).pin(
            "acme", ALIAS, "late", w.desk.get(r.id).target, servable=lambda _r: True)
        assert pins_on(w, w.desk.get(r.id).target) == ["late"]
        w.clock.now += c.check_s
        c.tick()
        assert pins_on(w, w.desk.get(r.id).target) == []
        ended = [e for e in w.events("SessionEnded") if e.summary["session"] == "late"]
        assert len(ended) == 1 and ended[0].actor == c.actor

    def test_a_tick_reports_its_liveness(self, world: World) -> None:
        w = world
        before = liveness_metrics()["loraplane_rollout_controller_ticks_total"]
        start(w)
        c = w.controller()
        c.tick()
        now = liveness_metrics(w.clock.now + 5)
        assert now["loraplane_rollout_controller_ticks_total"] == before + 1
        assert now["loraplane_rollout_controller_tick_age_seconds"] == pytest.approx(5)
        assert now["loraplane_rollout_unjudged_canaries"] == 0

    def test_status_shows_the_policy_the_step_evidence_and_alerts(self, world: World) -> None:
        from rich.console import Console

        from control.tools.rollout_view import render, rollout_status

        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        stable, canary = w.releases()
        w.traffic(canary, w.target, 12)
        w.traffic(stable, w.stable, 12)
        w.clock.now += 20 * WINDOW  # nothing judged it for twenty windows: alerted, caught up
        c.tick()
        data = rollout_status(w.desk, w.desk.get(r.id), now=w.clock.now)
        assert data["policy"]["margin_pp"] == 10 and data["test_alpha"] == pytest.approx(
            0.02 / 2 / 4)
        assert data["metrics"]["errors"]["target"] == [12, 12]
        assert [a["kind"] for a in data["alerts"]] == ["unjudged"]
        assert data["unjudged_s"] is None  # caught up now
        out = Console(width=200, record=True)
        out.print(render(data, now=w.clock.now))
        text = out.export_text()
        assert "margin 10 points" in text and "alert (unjudged)" in text and "errors" in text

    def test_starting_is_refused_when_it_cannot_be_judged(self, world: World) -> None:
        w = world
        with pytest.raises(IllegalTransition, match="already the alias's stable"):
            w.desk.start(ALIAS, w.stable, steps=[100], window_s=WINDOW, policy=POLICY,
                         actor="a")
        start(w)
        with pytest.raises(AlreadyExists, match="in progress"):
            start(w)
        w.desk.abort(ALIAS, "test", actor="a")
        assert start(w).number == 2


class TestRolloutsSQLite(OnSQLite, RolloutContract):
    pass


class TestRolloutsPostgres(OnPostgres, RolloutContract):
    pass
