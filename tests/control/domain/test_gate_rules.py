"""The evaluation gate's rules without a database: policies, judgement, and the canary guard on
the ``Adapter`` aggregate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from control.domain import (
    CANARY,
    CANDIDATE,
    Adapter,
    Combination,
    DomainError,
    GateFigures,
    GatePolicy,
    IllegalTransition,
    Tenant,
    effective_policy,
    judge,
)
from control.domain.gate import failures, passed

D = "sha256:" + "a" * 64
BASE, TOK, TEMPLATE = ("sha256:" + c * 64 for c in "bcd")
GOOD = GateFigures(golden_tasks=60, success_rate=0.9, base_success_rate=0.0,
                   stable_success_rate=0.85, authorization_errors=0, mismatch_tried=6,
                   mismatch_refused=6, mixed_requests=32, misattributions=0,
                   long_context_ok=True, cold_load_p95_s=0.2, cold_loads=1, load_failures=0,
                   memory_accounting_error=0.001, has_stable=True)


def _adapter() -> Adapter:
    return Adapter(tenant="acme", digest=D, base_digest=BASE, tokenizer_digest=TOK, rank=8,
                   target_modules=["q_proj"], alias="chat", metadata={}, signature=None,
                   actor="op")


def _failed(figures: GateFigures, policy: GatePolicy | None = None) -> set[str]:
    return {v.rule for v in judge(figures, policy or GatePolicy()) if not v.passed}


def test_the_defaults_are_the_issues() -> None:
    p = GatePolicy()
    assert (p.max_authorization_errors, p.max_success_rate_drop, p.max_cold_load_p95_s,
            p.max_memory_accounting_error, p.max_misattributions, p.mixed_requests,
            p.min_golden_tasks) == (0, 0.0, 8.0, 0.05, 0, 32, 50)
    assert (p.min_success_rate, p.min_gain_over_base) == (0.5, 0.1)  # issue 21
    assert passed(judge(GOOD, p)) and failures(judge(GOOD, p)) == []


@pytest.mark.parametrize(("change", "rule"), [
    ({"success_rate": 0.8}, "success_rate"),  # lower than the stable release's 0.85
    ({"authorization_errors": 1}, "authorization_errors"),
    ({"cold_load_p95_s": 8.0}, "cold_load_p95_s"),  # strictly below 8 s
    ({"memory_accounting_error": 0.05}, "memory_accounting_error"),  # strictly below 5 %
    ({"misattributions": 1}, "misattributions"),
    ({"mixed_requests": 31}, "mixed_requests"),
    ({"golden_tasks": 49}, "golden_tasks"),
    ({"load_failures": 1}, "load_failures"),
    ({"long_context_ok": False}, "long_context"),
    # a figure the gate could not measure fails its rule: the gate fails closed
    ({"memory_accounting_error": None}, "memory_accounting_error"),
    ({"cold_load_p95_s": None, "cold_loads": 0}, "cold_load_p95_s"),
    ({"stable_success_rate": None}, "success_rate"),
    # the absolute floor and the base alone judge the answers whatever the stable release did
    ({"success_rate": 0.45, "stable_success_rate": 0.4}, "min_success_rate"),
    ({"base_success_rate": 0.85}, "gain_over_base"),
    ({"base_success_rate": None}, "gain_over_base"),
])
def test_each_rule_fails_on_its_own_figure(change: dict[str, object], rule: str) -> None:
    figures = replace(GOOD, **change)  # type: ignore[arg-type]
    assert _failed(figures) == {rule}
    line = next(f for f in failures(judge(figures, GatePolicy())) if f.startswith(rule))
    assert "found" in line and "limit" in line


def test_without_a_stable_release_the_success_rule_has_nothing_to_compare() -> None:
    first = replace(GOOD, has_stable=False, stable_success_rate=None, success_rate=0.7)
    verdict = next(v for v in judge(first, GatePolicy()) if v.rule == "success_rate")
    assert verdict.passed and "nothing to compare" in verdict.why
    assert _failed(first) == set()
    # the floor a tenant may raise for its releases
    assert _failed(first, GatePolicy(min_success_rate=0.8)) == {"min_success_rate"}


def test_a_first_release_that_answers_nothing_fails() -> None:
    """Issue 21: with no stable release, a 0 % candidate passed (no rule judged its score)."""
    nothing = replace(GOOD, has_stable=False, stable_success_rate=None, success_rate=0.0)
    assert _failed(nothing) == {"min_success_rate", "gain_over_base"}
    # no better than the base alone: refused even above the floor
    copycat = replace(GOOD, has_stable=False, stable_success_rate=None, success_rate=0.6,
                      base_success_rate=0.6)
    assert _failed(copycat) == {"gain_over_base"}
    verdict = next(v for v in judge(copycat, GatePolicy()) if v.rule == "gain_over_base")
    assert verdict.value == 0.0 and verdict.limit == 0.1 and "beat the base" in verdict.why


@pytest.mark.parametrize("fields", [{"min_success_rate": 0}, {"min_success_rate": None},
                                    {"min_gain_over_base": 0.0}, {"min_gain_over_base": -0.1}])
def test_the_floor_and_the_gain_over_the_base_cannot_be_switched_off(
        fields: dict[str, object]) -> None:
    with pytest.raises(DomainError, match="above 0"):
        effective_policy(fields, None)


def test_policies_overlay_defaults_tenant_then_adapter() -> None:
    p = effective_policy({"max_cold_load_p95_s": 4.0, "max_success_rate_drop": 0.02},
                         {"max_cold_load_p95_s": 12.0})
    assert p.max_cold_load_p95_s == 12.0 and p.max_success_rate_drop == 0.02
    assert p.max_misattributions == 0  # untouched: the default
    assert _failed(replace(GOOD, success_rate=0.84), p) == set()  # within the allowed drop


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_cold_load": 1}, "unknown gate policy field 'max_cold_load'"),
    ({"max_cold_load_p95_s": 0}, "positive number"),
    ({"max_memory_accounting_error": 1.5}, "fraction"),
    ({"max_misattributions": -1}, "whole number"),
    ({"mixed_requests": 2.5}, "whole number"),
    ({"require_long_context": "yes"}, "true or false"),
])
def test_bad_policies_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(DomainError, match=message):
        effective_policy(fields, None)
    tenant = Tenant.create("acme", "k", "op")
    with pytest.raises(DomainError, match=message):
        tenant.set_gate_policy(dict(fields), "op")
    assert tenant.gate_policy == {}
    assert [type(e).__name__ for e in tenant.collect_events()] == ["TenantCreated"]


def test_canary_needs_a_passing_gate_report_for_the_exact_combination() -> None:
    adapter = _adapter()
    adapter.promote(CANDIDATE, "op")
    combo = Combination(BASE, TOK, None)
    with pytest.raises(IllegalTransition, match="evaluation report"):
        adapter.promote(CANARY, "op", release="sha256:" + "e" * 64, combination=combo)
    # a passing report on another template (or base) does not vouch for this combination
    adapter.record_gate_report("sha256:" + "1" * 64, True, {}, Combination(BASE, TOK, TEMPLATE),
                               "gate")
    with pytest.raises(IllegalTransition, match="evaluation report"):
        adapter.promote(CANARY, "op", release="sha256:" + "e" * 64, combination=combo)
    adapter.record_gate_report("sha256:" + "2" * 64, False, {}, combo, "gate")
    with pytest.raises(IllegalTransition, match="evaluation report"):
        adapter.promote(CANARY, "op", release="sha256:" + "e" * 64, combination=combo)
    adapter.record_gate_report("sha256:" + "3" * 64, True, {}, combo, "gate")
    assert adapter.canary_evidence(combo) == "sha256:" + "3" * 64
    adapter.promote(CANARY, "op", release="sha256:" + "e" * 64, combination=combo)
    assert adapter.state == CANARY


def test_an_external_report_does_not_override_a_failing_gate_report() -> None:
    adapter = _adapter()
    adapter.promote(CANDIDATE, "op")
    combo = Combination(BASE, TOK, None)
    failing = "sha256:" + "2" * 64
    adapter.record_gate_report(failing, False, {}, combo, "gate")
    adapter.record_evaluation("sha256:" + "f" * 64, {}, "eve", external=True)
    assert adapter.canary_evidence(combo) is None
    with pytest.raises(IllegalTransition, match="does not override the gate"):
        adapter.promote(CANARY, "op", release="sha256:" + "e" * 64, combination=combo)
    # a break-glass, recorded first, allows that one move and the release names the report
    adapter.break_glass(CANARY, failing, "the on-call lead's call", "lead")
    assert adapter.canary_evidence(combo) == failing
    adapter.promote(CANARY, "op", release="sha256:" + "e" * 64, combination=combo)
    assert adapter.state == CANARY and adapter.break_glass_for is None
    names = [type(e).__name__ for e in adapter.collect_events()]
    assert names[-2:] == ["BreakGlassUsed", "AdapterPromoted"]


def test_a_break_glass_needs_a_reason_and_the_right_state() -> None:
    adapter = _adapter()
    with pytest.raises(IllegalTransition, match="state 'candidate'"):
        adapter.break_glass(CANARY, "sha256:" + "2" * 64, "why", "lead")
    adapter.promote(CANDIDATE, "op")
    with pytest.raises(DomainError, match="reason"):
        adapter.break_glass(CANARY, "sha256:" + "2" * 64, "", "lead")
    with pytest.raises(DomainError, match="canary or stable"):
        adapter.break_glass("deprecated", "sha256:" + "2" * 64, "why", "lead")


def test_the_latest_gate_report_on_a_combination_counts() -> None:
    adapter = _adapter()
    combo = Combination(BASE, TOK, None)
    adapter.record_gate_report("sha256:" + "3" * 64, True, {}, combo, "gate")
    adapter.record_gate_report("sha256:" + "4" * 64, False, {}, combo, "gate")
    assert adapter.passing_gate_report(combo) is None


def test_an_external_report_is_accepted_only_with_the_flag_and_recorded_as_external() -> None:
    adapter = _adapter()
    adapter.promote(CANDIDATE, "op")
    with pytest.raises(IllegalTransition, match="external"):
        adapter.record_evaluation("sha256:" + "f" * 64, {}, "eve")
    assert adapter.evaluation_report is None
    adapter.record_evaluation("sha256:" + "f" * 64, {}, "eve", external=True)
    recorded = adapter.collect_events()[-1]
    assert isinstance(recorded, Adapter.EvaluationRecorded) and recorded.external is True
    adapter.promote(CANARY, "op", release="sha256:" + "e" * 64)  # no combination needed
    assert adapter.state == CANARY


def test_stored_evaluations_from_before_the_gate_read_back_as_external() -> None:
    state: dict[str, object] = {"digest": D, "report_digest": D, "summary": {}, "actor": "op"}
    Adapter.EvaluationRecorded.upcast_v1_v2(state)
    assert state["external"] is True
    assert Adapter.EvaluationRecorded.class_version == 2


def test_combinations_name_digests() -> None:
    with pytest.raises(DomainError, match="base digest"):
        Combination("tiny", TOK, None)
    with pytest.raises(DomainError, match="chat template"):
        Combination(BASE, TOK, "template")
    assert Combination(BASE, TOK, None).key != Combination(BASE, TOK, TEMPLATE).key


def test_golden_sets_and_gate_records_are_refused_on_a_revoked_adapter() -> None:
    adapter = _adapter()
    adapter.record_golden_set("sha256:" + "9" * 64, "alpha", 60, "op")
    assert adapter.golden_set == "sha256:" + "9" * 64 and adapter.golden_tasks == 60
    adapter.revoke("leak", "sec")
    with pytest.raises(IllegalTransition):
        adapter.record_golden_set("sha256:" + "8" * 64, "alpha", 60, "op")
    with pytest.raises(IllegalTransition):
        adapter.record_gate_report(D, True, {}, Combination(BASE, TOK, None), "gate")
    with pytest.raises(IllegalTransition):
        adapter.override_gate_policy({}, "op")
