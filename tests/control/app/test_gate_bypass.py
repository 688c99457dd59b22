"""No way around the evaluation gate (issue 21), through the registry on SQLite and PostgreSQL:
an external report must say it passed and name its producer, and never overrides a failing gate
report; stable needs a completed rollout, the alias's first release, or a break-glass, which is
recorded (who, why, what it overrides) with the one move it allows."""

from __future__ import annotations

from typing import Any

import pytest

from control.app.audit import audit_log
from control.app.gate_desk import GateDesk
from control.app.registry import Registry
from control.app.rollouts import RolloutDesk
from control.contracts.golden import GOLDEN_KIND, GoldenSet
from control.domain import (
    CANARY,
    CANDIDATE,
    STABLE,
    DomainError,
    IllegalTransition,
    ProbeReport,
    RolloutPolicy,
)
from projections.follower import open_registry
from tests.fixtures_control import Artifacts, OnPostgres, OnSQLite, WithRegistry, close_registry

GOLDEN = GoldenSet.from_json({"kind": GOLDEN_KIND, "family": "chat", "tasks": [
    {"id": f"t{i}", "prompt": f"hello {i}", "checker": {"kind": "exact", "expected": " hi"}}
    for i in range(3)]})
GOOD = {"producer": "eval-team", "passed": True, "accuracy": 0.93}


def _kinds(registry: Registry) -> list[str]:
    return [e.event_type for e in audit_log(registry)]


class GateBypassContract(WithRegistry):
    @pytest.fixture
    def world(self, registry: Registry, artifacts: Artifacts) -> dict[str, str]:
        """``chat`` serves alpha as its stable release (its first); beta is a candidate on it
        with a failing gate report on its canary combination."""
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        registry.create_tenant("acme", actor="op")
        alpha = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                          alias="chat", actor="alice", golden=GOLDEN)
        registry.advance(alpha, external=True, evaluation=GOOD, actor="alice")
        beta = registry.register_adapter(artifacts.adapters["beta"], tenant="acme",
                                         alias="chat", actor="alice", golden=GOLDEN)
        registry.promote(beta, actor="alice")  # -> candidate
        return {"alpha": alpha, "beta": beta}

    def _fail_gate(self, registry: Registry, digest: str) -> str:
        desk = GateDesk(registry)
        return desk.record_gate_report(
            digest, {"passed": False, "failures": ["success_rate"]}, passed=False,
            figures={"success_rate": 0.0}, actor="gate",
            combination=registry.canary_combination(registry.adapter(digest)))

    def test_the_reviewers_one_command_to_stable_is_refused(
            self, registry: Registry, world: dict[str, str]) -> None:
        beta = world["beta"]
        self._fail_gate(registry, beta)
        before = _kinds(registry)
        # a failing gate report, and an external report saying it failed: refused at once
        with pytest.raises(DomainError, match="must say it passed"):
            registry.advance(beta, evaluation={"passed": False}, external=True, actor="eve")
        # one that says it passed cannot override the failing gate report
        with pytest.raises(IllegalTransition, match="does not override the gate"):
            registry.advance(beta, evaluation=GOOD, external=True, actor="eve")
        assert _kinds(registry) == before  # the walk is one transaction: nothing recorded
        assert registry.adapter(beta).state == CANDIDATE

    @pytest.mark.parametrize("report", [
        {"passed": False, "producer": "eval-team"},
        {"suite": "smoke"},  # says nothing of passing
        {"accuracy": 0.99},
        {"passed": "yes", "producer": "eval-team"},  # not the boolean true
        {"passed": True},  # names no producer
        {"passed": True, "producer": "  "},
        {"passed": True, "producer": 7},
    ])
    def test_an_external_report_must_say_it_passed_and_name_its_producer(
            self, registry: Registry, world: dict[str, str], report: dict[str, Any]) -> None:
        before = _kinds(registry)
        with pytest.raises(DomainError, match="external evaluation report"):
            registry.record_evaluation(world["beta"], report, actor="eve", external=True)
        with pytest.raises(DomainError, match="external evaluation report"):
            registry.advance(world["beta"], evaluation=report, external=True, to=CANARY,
                             actor="eve")
        assert _kinds(registry) == before

    def test_the_producer_is_recorded_with_the_report(
            self, registry: Registry, world: dict[str, str]) -> None:
        registry.record_evaluation(world["beta"], {"suite": "nightly", "passed": True},
                                   actor="eve", external=True)
        recorded = [e for e in audit_log(registry) if e.event_type == "EvaluationRecorded"]
        assert recorded[-1].summary["summary"]["producer"] == "nightly"
        assert recorded[-1].actor == "eve"

    def test_stable_needs_a_rollout_or_a_break_glass_beside_another_stable_release(
            self, registry: Registry, world: dict[str, str]) -> None:
        beta = world["beta"]
        assert registry.advance(beta, evaluation=GOOD, external=True, to=CANARY,
                                actor="eve") == CANARY
        before = _kinds(registry)
        with pytest.raises(IllegalTransition, match="completed rollout"):
            registry.promote(beta, actor="eve")
        with pytest.raises(IllegalTransition, match="completed rollout"):
            registry.advance(beta, actor="eve")
        assert _kinds(registry) == before
        assert registry.alias("chat").canary == registry.adapter(beta).release
        assert registry.break_glass(beta, to=STABLE, reason="customer escalation 7",
                                    actor="oncall") == STABLE
        assert registry.alias("chat").stable == registry.adapter(beta).release
        kinds = _kinds(registry)[len(before):]
        assert kinds[:2] == ["BreakGlassUsed", "AdapterPromoted"] and "AliasPointed" in kinds

    def test_a_first_release_reaches_stable_on_its_canary_evidence(
            self, registry: Registry, world: dict[str, str]) -> None:
        # the fixture's alpha: its canary entry made it the alias's stable release
        assert registry.adapter(world["alpha"]).state == STABLE
        assert "BreakGlassUsed" not in _kinds(registry)

    def test_a_completed_rollout_promotes_the_canary(
            self, registry: Registry, world: dict[str, str]) -> None:
        beta = world["beta"]
        registry.advance(beta, evaluation=GOOD, external=True, to=CANARY, actor="eve")
        desk = RolloutDesk(registry)
        # one step of 100 %: entering it completes the rollout (windows are not this suite's)
        rollout = desk.start("chat", beta, steps=[100], window_s=5.0, policy=RolloutPolicy(),
                             actor="op")
        probe = ProbeReport(hosts=["h1:8000"], requests=2, ok=2)
        desk.enter_step(rollout.id, 0, probe, actor="controller")
        assert registry.adapter(beta).state == STABLE
        assert "BreakGlassUsed" not in _kinds(registry)
        # nothing left to override: a break-glass is refused, recording nothing
        before = _kinds(registry)
        with pytest.raises(IllegalTransition):
            registry.break_glass(beta, to=STABLE, reason="x", actor="oncall")
        assert _kinds(registry) == before

    def test_a_break_glass_into_canary_overrides_a_failing_gate_report_and_says_so(
            self, registry: Registry, world: dict[str, str]) -> None:
        beta = world["beta"]
        with pytest.raises(IllegalTransition, match="run loraplane adapter gate"):
            registry.break_glass(beta, to=CANARY, reason="no gate yet", actor="oncall")
        failing = self._fail_gate(registry, beta)
        with pytest.raises(IllegalTransition, match="evaluation report"):
            registry.promote(beta, actor="eve")
        with pytest.raises(DomainError, match="reason"):
            registry.break_glass(beta, to=CANARY, reason=" ", actor="oncall")
        before = _kinds(registry)
        assert registry.break_glass(beta, to=CANARY, reason="demo of a rollback",
                                    actor="oncall", canary_percent=25) == CANARY
        glass = [e for e in audit_log(registry) if e.event_type == "BreakGlassUsed"]
        assert [(g.actor, g.summary["to"], g.summary["overrides"], g.summary["reason"])
                for g in glass] == [("oncall", "canary", failing, "demo of a rollback")]
        after = _kinds(registry)[len(before):]
        assert after[0] == "BreakGlassUsed" and "AdapterPromoted" in after  # one transaction
        release = registry.release_manifest(registry.adapter(beta).release or "")
        assert release.evaluation_report_digest == failing  # what it was released despite
        assert registry.alias("chat").canary == release.digest
        assert registry.alias("chat").canary_percent == 25
        # the override allowed that one move: stable still needs its own basis
        with pytest.raises(IllegalTransition, match="completed rollout"):
            registry.promote(beta, actor="eve")

    def test_a_break_glass_allows_one_move_also_after_a_restart(
            self, registry: Registry, world: dict[str, str], settings: Any) -> None:
        beta = world["beta"]
        self._fail_gate(registry, beta)
        registry.break_glass(beta, to=CANARY, reason="r", actor="oncall")
        reopened = open_registry(settings, follow=False)
        try:
            adapter = reopened.adapter(beta)
            assert adapter.state == CANARY and adapter.break_glass_for is None
        finally:
            close_registry(reopened)

    def test_a_passing_gate_report_leaves_nothing_to_override(
            self, registry: Registry, world: dict[str, str]) -> None:
        beta = world["beta"]
        GateDesk(registry).record_gate_report(
            beta, {"passed": True}, passed=True, figures={"success_rate": 1.0}, actor="gate",
            combination=registry.canary_combination(registry.adapter(beta)))
        with pytest.raises(IllegalTransition, match="nothing to override"):
            registry.break_glass(beta, to=CANARY, reason="r", actor="oncall")
        assert registry.promote(beta, actor="eve") == CANARY


class TestGateBypassSQLite(OnSQLite, GateBypassContract):
    pass


class TestGateBypassPostgres(OnPostgres, GateBypassContract):
    pass
