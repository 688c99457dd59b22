"""Rollouts through the registry and the controller, with a fake clock and a fake probe (no
Triton), on SQLite and PostgreSQL: each step and its alias move are one transaction, windows are
judged from the ledger rows the test writes, a rollback clears the canary and re-pins the target's
sessions in the same transaction, and a controller started afresh at any point carries on
without repeating or skipping a step."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from control.app.audit import audit_log
from control.app.registry import Registry
from control.app.rollouts import RolloutDesk
from control.contracts.ledger import AdapterLoad, Completion, Ledger, LedgerEntry, Outcome
from control.domain import (
    CANARY,
    STABLE,
    AlreadyExists,
    IllegalTransition,
    ProbeReport,
    Release,
    RolloutPolicy,
    RolloutStatus,
)
from control.ops.rollout_controller import RolloutController
from tests.fixtures_control import Artifacts, OnPostgres, OnSQLite, WithRegistry

ALIAS = "chat"
WINDOW = 10.0
POLICY = RolloutPolicy(min_requests=4, min_ratings=4, settle_s=1.0, probe_attempts=2)


def release_to(reg: Registry, digest: str, to: str) -> None:
    """Walk an adapter to ``to`` with a smoke report (an external one: not the gate's)."""
    reg.advance(digest, evaluation={"suite": "smoke", "passed": True}, to=to, actor="op",
                external=True)


@dataclass
class Clock:
    now: float = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeProbe:
    """Passes unless told otherwise; records what it probed."""

    reports: list[ProbeReport] = field(default_factory=list)
    probed: list[str] = field(default_factory=list)

    def probe(self, owner: str | None, release: Release, requests: int) -> ProbeReport:
        self.probed.append(release.digest)
        if self.reports:
            return self.reports.pop(0)
        return ProbeReport(hosts=["fake:8000"], requests=requests, ok=requests)


@dataclass
class World:
    reg: Registry
    desk: RolloutDesk
    ledger: Ledger
    clock: Clock
    probe: FakeProbe
    stable: str  # adapter digests
    target: str
    ids: Iterator[int] = field(default_factory=itertools.count)

    def controller(self) -> RolloutController:
        """A controller as a fresh process starts one: it knows only the recorded events."""
        return RolloutController(self.desk, self.ledger, self.probe, clock=self.clock,
                                 retry_s=0.0)

    def traffic(self, release: str, adapter: str, n: int, *, rated: bool | None = None,
                outcome: str = Outcome.OK) -> None:
        """``n`` requests admitted now, finished at once, rated ``rated`` (None: not rated)."""
        rows = [LedgerEntry(request_id=f"r{next(self.ids)}", ticket_id="t", tenant="acme",
                            model="lora_llm", host="h1", base_digest=None,
                            adapter_digest=adapter, tokenizer_digest=None,
                            admitted_at=self.clock.now, release_digest=release)
                for _ in range(n)]
        self.ledger.admit(rows)
        self.ledger.complete([Completion(r.request_id, outcome) for r in rows],
                             now=self.clock.now + 0.1)
        if rated is not None:
            for r in rows:
                self.ledger.rate(r.request_id, "acme", rated)

    def releases(self) -> tuple[str, str]:
        a = self.reg.alias(ALIAS)
        assert a.stable is not None and a.canary is not None
        return a.stable, a.canary

    def events(self, kind: str) -> list[Any]:
        return [e for e in audit_log(self.reg) if e.event_type == kind]


class RolloutContract(WithRegistry):
    @pytest.fixture
    def world(self, registry: Registry, artifacts: Artifacts) -> World:
        reg = registry
        reg.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        reg.create_tenant("acme", actor="op")
        stable = reg.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias=ALIAS,
                                      actor="op")
        release_to(reg, stable, STABLE)
        target = reg.register_adapter(artifacts.adapters["beta"], tenant="acme", alias=ALIAS,
                                      actor="op")
        release_to(reg, target, CANARY)  # the alias sends it 10 % until a rollout takes over
        clock = Clock()
        return World(reg, RolloutDesk(reg, clock=clock), Ledger(reg.follower.engine), clock,
                     FakeProbe(), stable, target)

    def start(self, w: World, steps: list[int] | None = None,
              policy: RolloutPolicy = POLICY) -> Any:
        return w.desk.start(ALIAS, w.target, steps=steps or [25, 50, 100], window_s=WINDOW,
                            policy=policy, actor="alice")

    def good_window(self, w: World, c: RolloutController) -> None:
        stable, canary = w.releases()
        w.clock.now += 1
        w.traffic(canary, w.target, 5, rated=True)
        w.traffic(stable, w.stable, 5, rated=True)
        w.clock.now += WINDOW + POLICY.settle_s
        assert c.tick() == 1  # the window judged

    def test_a_good_rollout_walks_every_step_to_completion(self, world: World) -> None:
        w = world
        r = self.start(w)
        assert r.baseline == w.reg.alias(ALIAS).stable
        c = w.controller()
        assert c.tick() == 1  # probed, step 1 entered with the canary at 25 %
        a = w.reg.alias(ALIAS)
        assert (a.canary_percent, w.desk.get(r.id).percent) == (25, 25)
        self.good_window(w, c)
        assert c.tick() == 1 and w.reg.alias(ALIAS).canary_percent == 50
        self.good_window(w, c)
        assert c.tick() == 1  # the last step: the alias points at the target
        done = w.desk.get(r.id)
        a = w.reg.alias(ALIAS)
        assert done.status == RolloutStatus.COMPLETED
        assert (a.stable, a.canary, a.history[-1]) == (r.target, None, r.baseline)
        assert w.reg.adapter(w.target).state == STABLE
        assert w.reg.adapter(w.stable).state == STABLE  # the previous stable is untouched
        assert [e.summary["percent"] for e in w.events("RolloutStepEntered")] == [25, 50, 100]
        assert len(w.probe.probed) == 3
        assert c.tick() == 0 and not c.unfinished

    def test_each_step_and_its_alias_move_are_one_transaction(self, world: World) -> None:
        w = world
        self.start(w)
        w.controller().tick()
        log = audit_log(w.reg)
        step = next(e for e in log if e.event_type == "RolloutStepEntered")
        moved = [e for e in log if e.event_type == "AliasCanarySet"][-1]
        assert moved.summary["percent"] == 25
        # Adjacent positions, saved by one command: nothing can be recorded in between.
        assert abs(step.position - moved.position) == 1
        assert step.summary["probe"]["ok"] == POLICY.probe_requests

    def test_a_worse_success_rate_rolls_back_in_one_transaction(self, world: World) -> None:
        w = world
        r = self.start(w)
        c = w.controller()
        c.tick()
        stable, canary = w.releases()
        w.clock.now += 1
        w.traffic(canary, w.target, 5, rated=False)  # answered ok, rated as failures
        w.traffic(stable, w.stable, 5, rated=True)
        w.clock.now += WINDOW + 1
        assert c.tick() == 1
        done = w.desk.get(r.id)
        a = w.reg.alias(ALIAS)
        assert done.status == RolloutStatus.ROLLED_BACK
        assert (a.stable, a.canary) == (r.baseline, None)
        window = w.events("RolloutWindowEvaluated")[-1].summary
        assert window["decision"] == "roll_back" and window["success_source"] == "feedback"
        assert window["target"]["feedback_success_rate"] == 0.0
        assert window["target"]["ledger_success_rate"] == 1.0
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

    def test_a_quiet_window_waits_and_the_next_one_decides(self, world: World) -> None:
        w = world
        self.start(w)
        c = w.controller()
        c.tick()
        stable, canary = w.releases()
        w.traffic(canary, w.target, 2, rated=True)
        w.clock.now += WINDOW + 1
        c.tick()
        assert w.events("RolloutWindowEvaluated")[-1].summary["decision"] == "wait"
        assert w.reg.alias(ALIAS).canary_percent == 25
        w.traffic(canary, w.target, 5, rated=True)
        w.traffic(stable, w.stable, 5, rated=True)
        w.clock.now += WINDOW
        assert c.tick() == 1
        judged = w.events("RolloutWindowEvaluated")[-1].summary
        assert (judged["decision"], judged["window"]) == ("advance", 2)

    def test_an_identity_mismatch_rolls_back_in_its_window(self, world: World) -> None:
        w = world
        r = self.start(w)
        c = w.controller()
        c.tick()
        _stable, canary = w.releases()
        w.traffic(canary, w.target, 1, outcome=Outcome.IDENTITY_MISMATCH)
        w.clock.now += WINDOW + 1
        c.tick()
        assert w.desk.get(r.id).status == RolloutStatus.ROLLED_BACK
        assert "identity mismatches: 1" in w.events("RolloutRolledBack")[-1].summary[
            "reasons"][0]

    def test_load_failures_roll_back_on_the_third_window(self, world: World) -> None:
        w = world
        r = self.start(w, steps=[10, 20, 30, 50, 100])
        c = w.controller()
        c.tick()
        for _ in range(3):
            stable, canary = w.releases()
            w.traffic(canary, w.target, 5, rated=True)
            w.traffic(stable, w.stable, 5, rated=True)
            w.ledger.record_load(AdapterLoad("h1", w.target, w.clock.now, 0.1, "failed"))
            w.clock.now += WINDOW + 1
            c.tick()
            w.clock.now -= 1  # windows follow on
        decisions = [e.summary["decision"] for e in w.events("RolloutWindowEvaluated")]
        assert decisions == ["hold", "hold", "roll_back"]
        assert w.desk.get(r.id).status == RolloutStatus.ROLLED_BACK
        assert w.reg.alias(ALIAS).canary is None

    def test_a_probe_that_sees_a_load_failure_rolls_back_before_any_traffic_moves(
            self, world: World) -> None:
        w = world
        r = self.start(w)
        w.reg.clear_canary(ALIAS, actor="op")  # no share before the rollout's first step
        w.probe.reports = [ProbeReport(hosts=["h"], requests=2, ok=0, load_failures=2,
                                       errors=["h: refused (503)"])]
        w.controller().tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK and done.step == -1
        rolled = w.events("RolloutRolledBack")[-1].summary
        assert rolled["canary_cleared"] is False and "load failures" in rolled["reasons"][0]
        assert not w.events("RolloutStepEntered")

    def test_an_unhealthy_probe_is_retried_then_rolls_back(self, world: World) -> None:
        w = world
        r = self.start(w)
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
        r = self.start(w)
        for _ in range(12):  # a new controller for every tick: a crash between each
            c = w.controller()
            rollout = w.desk.get(r.id)
            if rollout.finished:
                break
            if rollout.window_start is not None:
                stable, canary = w.releases()
                w.traffic(canary, w.target, 5, rated=True)
                w.traffic(stable, w.stable, 5, rated=True)
                w.clock.now += WINDOW + 1
            c.tick()
            c.tick()  # and a second tick of the same one changes nothing more
        assert w.desk.get(r.id).status == RolloutStatus.COMPLETED
        assert [e.summary["step"] for e in w.events("RolloutStepEntered")] == [0, 1, 2]

    def test_operators_pause_resume_and_abort(self, world: World) -> None:
        w = world
        r = self.start(w)
        c = w.controller()
        c.tick()
        w.desk.pause(ALIAS, "looking at a ticket", actor="bob")
        w.clock.now += 10 * WINDOW
        assert c.tick() == 0
        w.clock.now += 5
        w.desk.resume(ALIAS, "fine", actor="bob")
        assert w.desk.get(r.id).window_start == w.clock.now
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
        r = self.start(w)
        c = w.controller()
        c.tick()
        w.reg.point_alias(ALIAS, w.target, actor="op")  # an operator takes over by hand
        w.clock.now += 1  # the controller looks for outside changes once a second
        c.tick()
        done = w.desk.get(r.id)
        assert done.status == RolloutStatus.ROLLED_BACK
        assert "changed outside the rollout" in done.reasons[0]

    def test_starting_is_refused_when_it_cannot_be_judged(self, world: World) -> None:
        w = world
        with pytest.raises(IllegalTransition, match="already the alias's stable"):
            w.desk.start(ALIAS, w.stable, steps=[100], window_s=WINDOW, policy=POLICY,
                         actor="a")
        self.start(w)
        with pytest.raises(AlreadyExists, match="in progress"):
            self.start(w)
        w.desk.abort(ALIAS, "test", actor="a")
        assert self.start(w).number == 2  # a new rollout after the first finished


class TestRolloutsSQLite(OnSQLite, RolloutContract):
    pass


class TestRolloutsPostgres(OnPostgres, RolloutContract):
    pass
