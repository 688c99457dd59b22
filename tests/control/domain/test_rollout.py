"""The rollout's rules and its aggregate, without a database: what each window decides, and
that what is due next follows from the recorded events alone (so a restarted controller neither
repeats nor skips a step)."""

from __future__ import annotations

import pytest

from control.contracts.ledger import ReleaseWindow
from control.domain import DomainError, IllegalTransition
from control.domain.rollout import (
    Decision,
    Enter,
    Idle,
    Judge,
    ProbeReport,
    Rollout,
    RolloutPolicy,
    RolloutStatus,
    Sessions,
    Sleep,
    SuccessSource,
    check_steps,
    judge_window,
    load_failure_rate,
)

T = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
POLICY = RolloutPolicy(min_requests=20, min_ratings=10, settle_s=1.0)
GOOD_PROBE = ProbeReport(hosts=["h:1"], requests=2, ok=2)


def window(requests: int = 40, ok: int | None = None, **kw: int | float | None) -> ReleaseWindow:
    return ReleaseWindow(requests=requests, ok=requests if ok is None else ok, **kw)  # type: ignore[arg-type]


def judge(target: ReleaseWindow, baseline: ReleaseWindow | None = None, streak: int = 0,
          policy: RolloutPolicy = POLICY, last: bool = False) -> tuple[Decision, list[str]]:
    v = judge_window(policy, target, baseline or window(), streak, last_step=last)
    return v.decision, v.reasons


# -- the rules --------------------------------------------------------------------------------

def test_a_healthy_window_advances_and_the_one_before_full_completes() -> None:
    assert judge(window())[0] == Decision.ADVANCE
    assert judge(window(), last=True)[0] == Decision.COMPLETE


def test_any_identity_mismatch_rolls_back_even_in_a_quiet_window() -> None:
    decision, reasons = judge(window(requests=1, ok=0, identity_mismatches=1))
    assert decision == Decision.ROLL_BACK and "identity mismatches: 1" in reasons[0]


def test_too_few_requests_wait_rather_than_advance() -> None:
    decision, reasons = judge(window(requests=19))
    assert decision == Decision.WAIT and "19 < 20" in reasons[0]


def test_a_window_without_baseline_traffic_waits() -> None:
    decision, reasons = judge(window(), window(requests=0))
    assert decision == Decision.WAIT and "baseline" in reasons[0]


def test_success_more_than_one_point_below_the_baseline_rolls_back() -> None:
    base = window(requests=100, ok=100, rated=100, successes=99)
    # 97.9 % against 99 %: 1.1 points below
    assert judge(window(requests=1000, rated=1000, successes=979), base)[0] == Decision.ROLL_BACK
    # 98.0 % against 99 %: exactly one point, allowed
    assert judge(window(requests=1000, rated=1000, successes=980), base)[0] == Decision.ADVANCE


def test_feedback_is_the_source_only_when_both_sides_hold_enough_ratings() -> None:
    base = window(rated=10, successes=10)
    bad = window(rated=10, successes=0)  # every answer ok in the ledger, every rating a failure
    v = judge_window(POLICY, bad, base, 0, last_step=False)
    assert v.success_source == SuccessSource.FEEDBACK and v.decision == Decision.ROLL_BACK
    assert v.target_success == 0.0 and v.baseline_success == 1.0
    # The baseline's 9 ratings are too few: both sides are judged from the ledger instead.
    v = judge_window(POLICY, bad, window(rated=9, successes=9), 0, last_step=False)
    assert v.success_source == SuccessSource.LEDGER and v.decision == Decision.ADVANCE


def test_ledger_success_counts_served_requests_only() -> None:
    # 40 rows: 30 ok, 2 failed, 8 refused (busy): success is 30 of the 32 served.
    v = judge_window(POLICY, window(requests=40, ok=30, failed=2, busy=8),
                     window(requests=40, ok=40), 0, last_step=False)
    assert v.target_success == pytest.approx(30 / 32)
    assert v.decision == Decision.ROLL_BACK  # 6.25 points below


def test_load_failures_hold_then_roll_back_on_the_third_window_in_a_row() -> None:
    failing = window(requests=100, load_failures=1)  # 1 % > 0.5 %
    v1 = judge_window(POLICY, failing, window(), 0, last_step=False)
    assert (v1.decision, v1.load_failure_streak) == (Decision.HOLD, 1)
    v2 = judge_window(POLICY, failing, window(), v1.load_failure_streak, last_step=False)
    assert (v2.decision, v2.load_failure_streak) == (Decision.HOLD, 2)
    v3 = judge_window(POLICY, failing, window(), v2.load_failure_streak, last_step=False)
    assert (v3.decision, v3.load_failure_streak) == (Decision.ROLL_BACK, 3)
    assert "3 of 3 windows" in v3.reasons[0]


def test_a_clean_window_resets_the_load_failure_run_and_a_silent_one_keeps_it() -> None:
    assert judge_window(POLICY, window(requests=1000, load_failures=5), window(), 2,
                        last_step=False).load_failure_streak == 0  # 0.5 %: not above
    silent = judge_window(POLICY, window(requests=0, ok=0), window(), 2, last_step=False)
    assert (silent.decision, silent.load_failure_streak) == (Decision.WAIT, 2)


def test_load_failures_without_any_request_counted_are_a_full_rate() -> None:
    assert load_failure_rate(window(requests=0, ok=0, load_failures=3)) == 1.0
    assert load_failure_rate(window(requests=0, ok=0)) is None


def test_latency_and_refusal_rules_are_off_unless_the_policy_sets_them() -> None:
    slow = window(p95_latency_s=5.0, busy=10, requests=40, ok=30)
    base = window(p95_latency_s=1.0, requests=40, ok=30)
    assert judge(slow, base)[0] == Decision.ADVANCE
    strict = RolloutPolicy(min_requests=20, max_p95_ratio=2.0, max_refusal_rate=0.1)
    decision, reasons = judge(slow, base, policy=strict)
    assert decision == Decision.ROLL_BACK and "p95 latency 5.00x" in reasons[0]


def test_steps_and_policy_are_checked_with_clear_messages() -> None:
    assert check_steps([1, 10, 50, 100]) == [1, 10, 50, 100]
    for bad, why in (([], "list"), ([10, 5, 100], "increase"), ([1, 50], "last step"),
                     ([0, 100], "between 1 and 100"), ([1.5, 100], "whole")):
        with pytest.raises(DomainError, match=why):
            check_steps(bad)  # type: ignore[arg-type]
    with pytest.raises(DomainError, match="min_requests"):
        RolloutPolicy(min_requests=0)
    with pytest.raises(DomainError, match="sessions"):
        RolloutPolicy(sessions="forget")  # type: ignore[arg-type]
    with pytest.raises(DomainError, match="unknown rollout policy fields"):
        RolloutPolicy.from_json({"min_requests": 5, "skip_checks": True})
    p = RolloutPolicy(sessions="drain", max_p95_ratio=3)  # type: ignore[arg-type]
    assert RolloutPolicy.from_json(p.to_json()) == p and p.sessions is Sessions.DRAIN


def test_probe_report_passes_only_when_every_request_was_served_by_the_target() -> None:
    assert GOOD_PROBE.passed and not GOOD_PROBE.reasons()
    unreachable = ProbeReport(hosts=["h:1"], requests=2, ok=0, errors=["connection refused"])
    assert not unreachable.passed and not unreachable.decisive
    assert "answered 0 of 2" in unreachable.reasons()[0]
    broken = ProbeReport(hosts=["h:1"], requests=2, ok=0, load_failures=2)
    assert broken.decisive and "load failures" in broken.reasons()[0]
    assert not ProbeReport(hosts=[], requests=0, ok=0).passed


# -- the aggregate ------------------------------------------------------------------------------

def started(steps: list[int] | None = None, policy: RolloutPolicy = POLICY) -> Rollout:
    return Rollout.start(alias="acme-chat", number=1, owner="acme", target=T,
                         target_adapter=T, baseline=B, baseline_adapter=B,
                         steps=steps or [10, 50, 100], window_s=60.0, policy=policy,
                         now=1000.0, actor="op")


def test_a_rollout_walks_its_steps_window_by_window_to_completion() -> None:
    r = started()
    assert r.next_action(1000.0) == Enter(0, 10)
    r.enter_step(0, GOOD_PROBE, 1001.0, "controller")
    assert r.percent == 10
    assert r.next_action(1061.5) == Sleep(1062.0)  # window end 1061, settled 1 s later
    assert r.next_action(1062.0) == Judge(1001.0, 1061.0)
    v = r.record_window(1001.0, 1061.0, window(requests=5), window(), 0, "controller")
    assert v.decision == Decision.WAIT
    assert r.next_action(1122.0) == Judge(1061.0, 1121.0)  # the next window follows on
    r.record_window(1061.0, 1121.0, window(), window(), 0, "controller")
    assert r.next_action(1122.0) == Enter(1, 50)
    r.enter_step(1, GOOD_PROBE, 1125.0, "controller")
    v = r.record_window(1125.0, 1185.0, window(), window(), 0, "controller")
    assert v.decision == Decision.COMPLETE
    assert r.next_action(1190.0) == Enter(2, 100)
    r.enter_step(2, GOOD_PROBE, 1191.0, "controller")
    r.complete(1191.0, "controller")
    assert r.status == RolloutStatus.COMPLETED and r.next_action(2000.0) == Idle()


def test_no_step_can_be_repeated_or_skipped() -> None:
    r = started()
    with pytest.raises(IllegalTransition, match="not due"):
        r.enter_step(1, GOOD_PROBE, 1001.0, "c")  # skipping step 1
    r.enter_step(0, GOOD_PROBE, 1001.0, "c")
    with pytest.raises(IllegalTransition, match="not due"):
        r.enter_step(0, GOOD_PROBE, 1002.0, "c")  # repeating it
    with pytest.raises(IllegalTransition, match="not due"):
        r.enter_step(1, GOOD_PROBE, 1002.0, "c")  # before its window was judged
    with pytest.raises(IllegalTransition, match="not the one open"):
        r.record_window(1000.0, 1060.0, window(), window(), 0, "c")
    with pytest.raises(IllegalTransition, match="probe passed"):
        started().enter_step(0, ProbeReport(hosts=["h"], requests=2, ok=1), 1001.0, "c")


def test_what_is_due_next_survives_a_replay_of_the_events_at_every_point() -> None:
    r = started()
    moves = [
        lambda: r.enter_step(0, GOOD_PROBE, 1001.0, "c"),
        lambda: r.record_window(1001.0, 1061.0, window(requests=3), window(), 0, "c"),
        lambda: r.record_window(1061.0, 1121.0, window(), window(), 0, "c"),
        lambda: r.record_probe_failure(1, ProbeReport(["h"], 2, 0, errors=["503"]), "c"),
        lambda: r.enter_step(1, GOOD_PROBE, 1130.0, "c"),
    ]
    history = []
    for move in moves:
        move()
        history.extend(r.collect_events())
        rebuilt: Rollout | None = None
        for e in history:
            rebuilt = e.mutate(rebuilt)  # type: ignore[assignment]
        assert rebuilt is not None
        for now in (1000.0, 1062.0, 1122.0, 1200.0, 1300.0):
            assert rebuilt.next_action(now) == r.next_action(now)
        assert (rebuilt.step, rebuilt.window_start, rebuilt.probe_failures) == (
            r.step, r.window_start, r.probe_failures)


def test_probe_failures_roll_back_after_the_policy_attempts_or_at_once_when_decisive() -> None:
    r = started(policy=RolloutPolicy(probe_attempts=2))
    flaky = ProbeReport(["h"], 2, 1, errors=["busy"])
    assert r.record_probe_failure(0, flaky, "c") is False
    assert r.record_probe_failure(0, flaky, "c") is True
    assert r.record_probe_failure(0, ProbeReport(["h"], 2, 0, load_failures=1), "c") is True
    assert started().record_probe_failure(0, ProbeReport(["h"], 2, 0, load_failures=1),
                                          "c") is True


def test_pause_stops_the_clock_and_resume_opens_a_fresh_window() -> None:
    r = started()
    r.enter_step(0, GOOD_PROBE, 1001.0, "c")
    r.pause("investigating", "alice")
    assert r.next_action(5000.0) == Idle()
    with pytest.raises(IllegalTransition):
        r.record_window(1001.0, 1061.0, window(), window(), 0, "c")
    r.resume("fine", 5000.0, "alice")
    assert r.next_action(5061.0) == Judge(5000.0, 5060.0)
    with pytest.raises(IllegalTransition, match="only a paused"):
        r.resume("again", 5001.0, "alice")


def test_a_rollback_is_final_and_records_the_sessions_choice() -> None:
    r = started()
    r.enter_step(0, GOOD_PROBE, 1001.0, "c")
    r.abort("wrong target", "alice")
    r.roll_back(["aborted by alice: wrong target"], Sessions.REPIN, True, "alice")
    events = r.collect_events()
    rolled = events[-1]
    assert type(rolled).__name__ == "RolloutRolledBack"
    assert (rolled.sessions, rolled.canary_cleared) == ("repin", True)  # type: ignore[attr-defined]
    assert r.status == RolloutStatus.ROLLED_BACK and r.next_action(9999.0) == Idle()
    for move in (lambda: r.abort("again", "bob"),
                 lambda: r.roll_back(["x"], Sessions.DRAIN, False, "c"),
                 lambda: r.enter_step(1, GOOD_PROBE, 1100.0, "c"),
                 lambda: r.pause("x", "bob")):
        with pytest.raises(IllegalTransition):
            move()


def test_the_target_must_differ_from_the_baseline_and_windows_be_sane() -> None:
    with pytest.raises(IllegalTransition, match="already"):
        Rollout.start(alias="a", number=1, owner="acme", target=B, target_adapter=B,
                      baseline=B, baseline_adapter=B, steps=[100], window_s=60, policy=POLICY,
                      now=0.0, actor="op")
    with pytest.raises(DomainError, match="window"):
        Rollout.start(alias="a", number=1, owner="acme", target=T, target_adapter=T,
                      baseline=B, baseline_adapter=B, steps=[100], window_s=0.1,
                      policy=POLICY, now=0.0, actor="op")
