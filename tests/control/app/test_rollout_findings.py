"""The review's findings against rollouts (issue 21), each reproduced through the controller and
the registry as an operator runs them, with ledger rows written as a host writes them. Every
test here failed on the code before the sequential analysis (it uses only what that code had:
``RolloutDesk``, ``RolloutController``, the ledger, and policy fields both versions know).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from control.app.sessions import SessionPins
from control.contracts.ledger import Outcome
from control.domain import IllegalTransition, RolloutPolicy, RolloutStatus
from projections.follower import open_registry
from projections.routing import RoutingView
from tests.control.app.rollout_world import ALIAS, ALIAS2, WINDOW, RolloutWorld, World
from tests.fixtures_control import OnPostgres, OnSQLite, close_registry

SETTLE = RolloutPolicy(settle_s=1.0)  # the default policy, judged a second after each window


def start(w: World, alias: str = ALIAS, target: str | None = None,
          policy: RolloutPolicy = SETTLE, window_s: float = WINDOW) -> Any:
    return w.desk.start(alias, target or w.target, steps=[25, 50, 100], window_s=window_s,
                        policy=policy, actor="alice")


def rated(w: World, release: str, adapter: str, good: int, bad: int) -> None:
    w.traffic(release, adapter, good, rated=True)
    w.traffic(release, adapter, bad, rated=False)


def next_window(w: World) -> None:
    w.clock.now += WINDOW + SETTLE.settle_s


class FindingsContract(RolloutWorld):
    def test_a_drop_within_the_noise_of_twenty_requests_does_not_roll_back(
            self, world: World) -> None:
        """90 % against 95 % on 20 rated requests: a coin flip, not evidence."""
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        stable, canary = w.releases()
        w.clock.now += 1
        rated(w, canary, w.target, 18, 2)
        rated(w, stable, w.stable, 190, 10)
        next_window(w)
        c.tick()
        assert w.desk.get(r.id).status == RolloutStatus.RUNNING
        assert w.events("RolloutWindowEvaluated")[-1].summary["decision"] == "wait"

    def test_engine_errors_count_when_feedback_is_the_source(self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        stable, canary = w.releases()
        w.clock.now += 1
        w.traffic(canary, w.target, 60, rated=True)  # every answer the tenant saw was good
        w.traffic(canary, w.target, 40, outcome=Outcome.FAILED)  # 40 % never answered
        w.traffic(stable, w.stable, 200, rated=True)
        next_window(w)
        c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK
        assert any(reason.startswith("errors:") for reason in done.reasons), done.reasons

    def test_a_canary_whose_every_request_is_refused_rolls_back(self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        for _ in range(3):
            if w.desk.get(r.id).finished:
                break
            stable, canary = w.releases()
            w.clock.now += 1
            w.traffic(canary, w.target, 30, outcome=Outcome.REJECTED, reason="busy")
            w.traffic(stable, w.stable, 100)
            w.clock.now += WINDOW - 1
            c.tick()
        assert w.desk.get(r.id).status == RolloutStatus.ROLLED_BACK

    def test_a_mismatch_between_a_window_and_the_next_step_is_judged(
            self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        entered = w.clock.now
        stable, canary = w.releases()
        w.clock.now += 1
        w.traffic(canary, w.target, 300)
        w.traffic(stable, w.stable, 300)
        # After the window's end, before it is judged and the next step entered.
        w.traffic(canary, w.target, 1, outcome=Outcome.IDENTITY_MISMATCH, at=entered + WINDOW
                  + 0.3)
        w.clock.now = entered + WINDOW + SETTLE.settle_s
        for _ in range(8):
            c.tick()
            if w.desk.get(r.id).finished:
                break
            stable, canary = w.releases()
            w.traffic(canary, w.target, 300)
            w.traffic(stable, w.stable, 300)
            next_window(w)
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK, done.reasons
        assert "identity mismatches" in done.reasons[0]

    def test_pausing_leaves_the_hard_failure_rules_on(self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        w.desk.pause(ALIAS, "looking at something", actor="bob")
        _stable, canary = w.releases()
        w.clock.now += 1
        w.traffic(canary, w.target, 1, outcome=Outcome.IDENTITY_MISMATCH)
        next_window(w)
        c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK
        assert "identity mismatches" in done.reasons[0]

    def test_a_step_without_enough_evidence_pauses_at_its_deadline_with_an_alert(
            self, world: World) -> None:
        w = world
        r = start(w, window_s=600.0)  # the default step deadline is an hour: six windows
        c = w.controller()
        c.tick()
        for i in range(48):  # 80 minutes in steps of 100 s
            if i % 6 == 0:
                stable, canary = w.releases()
                w.traffic(canary, w.target, 2)
                w.traffic(stable, w.stable, 20)
            w.clock.now += 100
            c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.PAUSED
        alerts = [e.summary for e in w.events("RolloutAlerted")]
        assert [a["kind"] for a in alerts] == ["inconclusive"]
        assert w.reg.alias(ALIAS).canary_percent == 25  # the canary keeps its share, judged

    def test_a_canary_left_unjudged_is_alerted(self, world: World) -> None:
        w = world
        start(w)
        c = w.controller()
        c.tick()
        w.clock.now += 20 * WINDOW  # no controller ran for twenty windows
        c.tick()
        kinds = [e.summary["kind"] for e in w.events("RolloutAlerted")]
        assert kinds == ["unjudged"]
        assert len(w.events("RolloutWindowEvaluated")) >= 19  # then caught up, in order

    def test_a_tenfold_p95_latency_regression_rolls_back_by_default(self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        stable, canary = w.releases()
        w.clock.now += 1
        w.traffic(canary, w.target, 30, took=1.0)
        w.traffic(stable, w.stable, 270, took=0.1)
        next_window(w)
        c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK
        assert any(reason.startswith("latency:") for reason in done.reasons), done.reasons

    def test_revoking_the_stable_release_pauses_the_rollout_and_keeps_the_canary(
            self, world: World) -> None:
        w = world
        w.reg.set_fallback(ALIAS, "base", actor="op")
        r = start(w)
        c = w.controller()
        c.tick()
        w.reg.revoke(w.stable, "leaked", actor="sec")
        w.clock.now += 1
        c.tick()
        paused = w.desk.get(r.id)
        assert paused.status == RolloutStatus.PAUSED
        alias = w.reg.alias(ALIAS)
        assert (alias.canary, alias.canary_percent) == (r.target, 25)
        assert [e.summary["kind"] for e in w.events("RolloutAlerted")] == ["baseline_revoked"]
        w.desk.resume(ALIAS, "compare with the base model now", actor="bob")
        resumed = w.desk.get(r.id)
        assert resumed.status == RolloutStatus.RUNNING
        assert resumed.baseline == alias.stable != r.baseline

    def test_no_session_stays_on_the_target_when_it_is_rolled_back_under_fallback_none(
            self, world: World) -> None:
        w = world
        r = start(w)
        c = w.controller()
        c.tick()
        pins = SessionPins(w.reg, actor="gateway", clock=w.clock)
        for i in range(16):
            pins.pin("acme", ALIAS, f"s{i}", r.target, servable=lambda _r: True)
        w.reg.revoke(w.stable, "leaked", actor="sec")  # fallback none: nothing is served
        w.clock.now += 1
        c.tick()
        if not w.desk.get(r.id).finished:
            w.desk.abort(ALIAS, "its stable release is gone", actor="bob")
        assert w.desk.get(r.id).status == RolloutStatus.ROLLED_BACK
        w.reg.follower.catch_up()
        live = [p for p in RoutingView(w.reg.follower.engine).session_pins(ALIAS)
                if p.release == r.target and p.holds(w.clock.now)]
        assert live == []

    def test_one_rollout_raising_does_not_stop_the_tick_for_the_others(
            self, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
        w = world
        stable2, target2 = w.second_alias()
        r1 = start(w)
        r2 = start(w, ALIAS2, target2)
        c = w.controller()
        c.tick()
        assert w.desk.get(r1.id).step == w.desk.get(r2.id).step == 0
        for alias, base, target in ((ALIAS, w.stable, w.target), (ALIAS2, stable2, target2)):
            stable, canary = w.releases(alias)
            w.traffic(canary, target, 5)
            w.traffic(stable, base, 5)
        next_window(w)
        real = w.desk.record_window

        def lost_race(rid: Any, *args: Any, **kw: Any) -> Any:
            if rid == r1.id:  # another controller recorded this window first
                raise IllegalTransition("that window is not the one open")
            return real(rid, *args, **kw)

        monkeypatch.setattr(w.desk, "record_window", lost_race)
        c.tick()
        judged = {e.aggregate_id for e in w.events("RolloutWindowEvaluated")}
        assert str(r2.id) in judged and str(r1.id) not in judged

    def test_racing_controllers_and_operators_never_break_a_tick(self, world: World) -> None:
        w = world
        stable2, target2 = w.second_alias()
        other = open_registry(w.reg.settings)
        try:
            from control.app.rollouts import RolloutDesk
            from control.ops.rollout_controller import RolloutController

            rival = RolloutController(RolloutDesk(other, clock=w.clock), w.ledger, w.probe,
                                      clock=w.clock, retry_s=0.0, check_s=0.0)
            mine = w.controller()
            mine.check_s = 0.0
            escaped: list[BaseException] = []
            for run in range(6):
                rollouts = [start(w), start(w, ALIAS2, target2)]
                stop = threading.Event()

                def ticking(c: RolloutController, stop: threading.Event) -> None:
                    while not stop.is_set():
                        try:
                            c.tick()
                        except BaseException as e:  # what the tick let escape
                            escaped.append(e)

                threads = [threading.Thread(target=ticking, args=(c, stop)) for c in (mine, rival)]
                for t in threads:
                    t.start()
                try:
                    for _ in range(4):
                        for alias, base, target in ((ALIAS, w.stable, w.target),
                                                    (ALIAS2, stable2, target2)):
                            a = w.reg.alias(alias)
                            if a.canary is not None and a.stable is not None:
                                w.traffic(a.canary, target, 3)
                                w.traffic(a.stable, base, 3)
                        w.clock.now += WINDOW / 2
                    for rollout, alias in zip(rollouts, (ALIAS, ALIAS2), strict=True):
                        if not w.desk.get(rollout.id).finished:
                            w.desk.abort(alias, f"race {run}", actor="bob")
                finally:
                    stop.set()
                    for t in threads:
                        t.join(timeout=60)
                for alias, target in ((ALIAS, w.target), (ALIAS2, target2)):
                    if w.reg.alias(alias).canary is None:
                        w.reg.set_canary(alias, target, 10, actor="op")
            assert escaped == []
        finally:
            close_registry(other)


class TestFindingsSQLite(OnSQLite, FindingsContract):
    pass


class TestFindingsPostgres(OnPostgres, FindingsContract):
    pass

