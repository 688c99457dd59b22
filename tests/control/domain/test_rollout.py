"""The rollout's rules and its aggregate, without a database: the sequential judge on a step's
evidence, metric by metric, and that what is due next follows from the recorded events alone (so
a restarted controller neither repeats nor skips a step)."""

from __future__ import annotations

from typing import Any

import pytest

from control.contracts.ledger import ReleaseWindow
from control.domain import DomainError, IllegalTransition
from control.domain.rollout import (
    AlertKind,
    Decision,
    Enter,
    Evidence,
    Idle,
    Judge,
    ProbeReport,
    Rollout,
    RolloutPolicy,
    RolloutStatus,
    Sessions,
    Sleep,
    WindowFigures,
    check_steps,
    judge_window,
)
from control.domain.rollout_judge import MetricState

T = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
POLICY = RolloutPolicy(min_requests=20, min_ratings=20, settle_s=1.0)
ALPHA = POLICY.test_alpha(2)
GOOD_PROBE = ProbeReport(hosts=["h:1"], requests=2, ok=2)


def window(requests: int = 40, ok: int | None = None, **kw: Any) -> ReleaseWindow:
    return ReleaseWindow(requests=requests, ok=requests if ok is None else ok, **kw)


def figures(target: ReleaseWindow | None = None, baseline: ReleaseWindow | None = None,
            **kw: int) -> WindowFigures:
    return WindowFigures(target or window(), baseline or window(), **kw)


def judge(f: WindowFigures, before: Evidence | None = None, policy: RolloutPolicy = POLICY,
          **kw: bool) -> tuple[Decision, list[str]]:
    v = judge_window(policy, ALPHA, before or Evidence(), f, last_step=kw.pop("last", False),
                     **kw)
    return v.decision, v.reasons


def evidence(*windows: WindowFigures) -> Evidence:
    ev = Evidence()
    for w in windows:
        ev = ev.add(w)
    return ev


# -- the judge ----------------------------------------------------------------------------------

def test_a_clean_step_advances_once_it_holds_enough_evidence_and_completes_before_full() -> None:
    clean = figures(window(200), window(1800))
    assert judge(clean)[0] == Decision.ADVANCE
    assert judge(clean, last=True)[0] == Decision.COMPLETE
    # The same rates on too few requests conclude nothing: min_requests per arm
    decision, reasons = judge(figures(window(10), window(90)))
    assert decision == Decision.WAIT and "20 needed to advance" in reasons[0]


def test_a_point_estimate_below_stable_does_not_roll_back_without_significance() -> None:
    # 90 % against 95 % on 20 and 200 rated requests: the old rule rolled this back (5 points
    # is more than 1); no test at any sane level can tell these apart.
    f = figures(window(20, rated=20, successes=18), window(200, rated=200, successes=190))
    decision, _ = judge(f)
    assert decision == Decision.WAIT


def test_a_significantly_worse_feedback_rate_rolls_back() -> None:
    f = figures(window(60, rated=60, successes=30), window(600, rated=600, successes=570))
    decision, reasons = judge(f)
    assert decision == Decision.ROLL_BACK
    assert reasons[0].startswith("feedback: 50.0% of 60") and "significantly worse" in reasons[0]


def test_engine_errors_roll_back_even_when_feedback_is_perfect() -> None:
    # 40 of 100 served requests failed; the 60 answered were all rated good, as were stable's.
    target = window(100, ok=60, failed=40, rated=60, successes=60)
    decision, reasons = judge(figures(target, window(900, rated=900, successes=900)))
    assert decision == Decision.ROLL_BACK and reasons[0].startswith("errors: 60.0% of 100")


def test_feedback_gates_the_step_only_once_both_arms_hold_min_ratings() -> None:
    quiet = figures(window(200, rated=5, successes=5), window(1800, rated=500, successes=475))
    assert judge(quiet)[0] == Decision.ADVANCE  # 5 ratings: feedback does not gate yet
    rated = figures(window(200, rated=40, successes=38), window(1800, rated=500, successes=475))
    v = judge_window(POLICY, ALPHA, Evidence(), rated, last_step=False)
    assert v.metrics["feedback"].gating and v.metrics["feedback"].state == MetricState.COLLECTING
    assert v.decision == Decision.WAIT  # 40 ratings cannot show "not 3 points worse"


def test_evidence_accumulates_across_windows_of_a_step() -> None:
    small = figures(window(20, rated=20, successes=19), window(180, rated=180, successes=171))
    ev = Evidence()
    decisions = []
    for _ in range(40):
        v = judge_window(POLICY, ALPHA, ev, small, last_step=False)
        ev = v.evidence
        decisions.append(v.decision)
        if v.decision != Decision.WAIT:
            break
    assert decisions[0] == Decision.WAIT and decisions[-1] == Decision.ADVANCE
    assert ev.feedback[0].total == 20 * len(decisions)  # every window counted, none twice


def test_hard_failures_roll_back_on_one_event_however_few_the_requests() -> None:
    decision, reasons = judge(figures(window(1, ok=0, identity_mismatches=1)))
    assert decision == Decision.ROLL_BACK and "identity mismatches: 1" in reasons[0]
    decision, reasons = judge(figures(window(3), load_failures=1))
    assert decision == Decision.ROLL_BACK and "load failures: 1" in reasons[0]
    lenient = RolloutPolicy(max_load_failures=2)
    assert judge(figures(window(3), load_failures=2), policy=lenient)[0] == Decision.WAIT


def test_a_canary_whose_every_request_is_refused_rolls_back() -> None:
    refused = window(30, ok=0, busy=30)
    decision, reasons = judge(figures(refused, window(30, ok=0, busy=30)))
    # Even beside a stable release refused as much (fail closed: it cannot serve).
    assert decision == Decision.ROLL_BACK and "none of the target's 30 requests" in reasons[0]


def test_requests_still_running_when_judged_are_not_refusals() -> None:
    # 30 long requests admitted, none finished by the time the window is judged.
    running = WindowFigures(window(30, ok=0), window(270, ok=240), target_running=30,
                            baseline_running=30)
    v = judge_window(POLICY, ALPHA, Evidence(), running, last_step=False)
    assert v.decision == Decision.WAIT
    assert (v.evidence.refusals[0].total, v.evidence.requests) == (0, 0)
    assert v.evidence.refusals[1].total == 240


def test_refusals_worse_than_stable_roll_back() -> None:
    target = window(100, ok=50, busy=50)
    decision, reasons = judge(figures(target, window(900, ok=890, busy=10)))
    assert decision == Decision.ROLL_BACK and any(r.startswith("refusals:") for r in reasons)


def test_a_p95_latency_regression_rolls_back_by_default() -> None:
    # Every one of the target's ok requests slower than 1.5x stable's p95: its p95 is 10x.
    decision, reasons = judge(figures(window(30), window(270), slow=30, timed=30))
    assert decision == Decision.ROLL_BACK and reasons[0].startswith("latency: 30 of 30")
    # A few slow ones among many are what a p95 allows.
    assert judge(figures(window(200), window(1800), slow=4, timed=200))[0] == Decision.ADVANCE


def test_a_paused_step_still_rolls_back_but_does_not_advance() -> None:
    assert judge(figures(window(200), window(1800)), paused=True)[0] == Decision.WAIT
    bad = figures(window(5, ok=4, identity_mismatches=1))
    assert judge(bad, paused=True)[0] == Decision.ROLL_BACK


def test_an_undecided_step_past_its_deadline_is_inconclusive() -> None:
    decision, reasons = judge(figures(window(5), window(45)), past_deadline=True)
    assert decision == Decision.INCONCLUSIVE and "deadline" in reasons[0]


def test_steps_and_policy_are_checked_with_clear_messages() -> None:
    assert check_steps([1, 10, 50, 100]) == [1, 10, 50, 100]
    for bad, why in (([], "list"), ([10, 5, 100], "increase"), ([1, 50], "last step"),
                     ([0, 100], "between 1 and 100"), ([1.5, 100], "whole")):
        with pytest.raises(DomainError, match=why):
            check_steps(bad)  # type: ignore[arg-type]
    for kw, why in (({"min_requests": 0}, "min_requests"), ({"alpha": 0}, "alpha"),
                    ({"power": 1.0}, "power"), ({"margin_pp": 0}, "margin_pp"),
                    ({"sessions": "forget"}, "sessions")):
        with pytest.raises(DomainError, match=why):
            RolloutPolicy(**kw)
    with pytest.raises(DomainError, match="unknown rollout policy fields"):
        RolloutPolicy.from_json({"min_requests": 5, "skip_checks": True})
    p = RolloutPolicy(sessions="drain", max_p95_ratio=3)  # type: ignore[arg-type]
    assert RolloutPolicy.from_json(p.to_json()) == p and p.sessions is Sessions.DRAIN


def test_a_policy_recorded_before_the_sequential_analysis_still_reads() -> None:
    old = {"max_success_drop_pp": 1.0, "max_load_failure_rate": 0.005, "load_failure_windows": 3,
           "max_identity_mismatches": 0, "min_requests": 20, "min_ratings": 10, "settle_s": 2.0,
           "probe_requests": 2, "probe_attempts": 3, "sessions": "repin",
           "max_p95_ratio": None, "max_refusal_rate": None}
    p = RolloutPolicy.from_json(old)
    assert (p.min_requests, p.min_ratings, p.max_p95_ratio) == (20, 10, 1.5)


def test_the_error_budget_is_split_over_steps_and_metrics() -> None:
    assert RolloutPolicy(alpha=0.02).test_alpha(judged_steps=2) == pytest.approx(0.0025)
    assert RolloutPolicy(alpha=0.02).test_alpha(judged_steps=0) == pytest.approx(0.005)


def test_probe_report_passes_only_when_every_request_was_served_by_the_target() -> None:
    assert GOOD_PROBE.passed and not GOOD_PROBE.reasons()
    unreachable = ProbeReport(hosts=["h:1"], requests=2, ok=0, errors=["connection refused"])
    assert not unreachable.passed and not unreachable.decisive
    assert "answered 0 of 2" in unreachable.reasons()[0]
    broken = ProbeReport(hosts=["h:1"], requests=2, ok=0, load_failures=2)
    assert broken.decisive and "load failures" in broken.reasons()[0]
    assert not ProbeReport(hosts=[], requests=0, ok=0).passed


# -- the aggregate ------------------------------------------------------------------------------

CLEAN = figures(window(200), window(1800))
QUIET = figures(window(5), window(45))


def started(steps: list[int] | None = None, policy: RolloutPolicy = POLICY) -> Rollout:
    return Rollout.start(alias="acme-chat", number=1, owner="acme", target=T,
                         target_adapter=T, baseline=B, baseline_adapter=B,
                         steps=steps or [10, 50, 100], window_s=60.0, policy=policy,
                         now=1000.0, actor="op")


def test_a_rollout_walks_its_steps_with_windows_that_never_leave_a_gap() -> None:
    r = started()
    assert r.next_action(1000.0) == Enter(0, 10)
    r.enter_step(0, GOOD_PROBE, 1001.0, "controller")
    assert r.percent == 10
    assert r.next_action(1061.5) == Sleep(1062.0)  # window end 1061, settled 1 s later
    assert r.next_action(1062.0) == Judge(1001.0, 1061.0)
    assert r.record_window(1001.0, 1061.0, QUIET, 0, "controller").decision == Decision.WAIT
    assert r.next_action(1122.0) == Judge(1061.0, 1121.0)  # the next window follows on
    assert r.record_window(1061.0, 1121.0, CLEAN, 0, "c").decision == Decision.ADVANCE
    # Advancing does not close the window: the time until the next step is judged too.
    assert r.window_start == 1121.0 and r.next_action(1122.0) == Enter(1, 50)
    r.enter_step(1, GOOD_PROBE, 1125.0, "controller")
    assert r.evidence == Evidence()  # each step's evidence is its own
    assert r.next_action(1182.0) == Judge(1121.0, 1181.0)
    v = r.record_window(1121.0, 1181.0, CLEAN, 0, "controller")
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
    with pytest.raises(IllegalTransition, match="still being judged"):
        r.enter_step(1, GOOD_PROBE, 1002.0, "c")  # before its evidence let it advance
    with pytest.raises(IllegalTransition, match="not the one open"):
        r.record_window(1000.0, 1060.0, CLEAN, 0, "c")
    with pytest.raises(IllegalTransition, match="probe passed"):
        started().enter_step(0, ProbeReport(hosts=["h"], requests=2, ok=1), 1001.0, "c")


def test_what_is_due_next_survives_a_replay_of_the_events_at_every_point() -> None:
    r = started()
    moves = [
        lambda: r.enter_step(0, GOOD_PROBE, 1001.0, "c"),
        lambda: r.record_window(1001.0, 1061.0, QUIET, 0, "c"),
        lambda: r.pause("look", "alice"),
        lambda: r.record_window(1061.0, 1121.0, CLEAN, 0, "c"),
        lambda: r.resume("fine", 1130.0, "alice"),
        lambda: r.record_window(1121.0, 1181.0, CLEAN, 0, "c"),
        lambda: r.record_probe_failure(1, ProbeReport(["h"], 2, 0, errors=["503"]), "c"),
        lambda: r.enter_step(1, GOOD_PROBE, 1190.0, "c"),
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
        assert (rebuilt.step, rebuilt.window_start, rebuilt.probe_failures, rebuilt.evidence,
                rebuilt.advance_due, rebuilt.status) == (
            r.step, r.window_start, r.probe_failures, r.evidence, r.advance_due, r.status)


def test_probe_failures_roll_back_after_the_policy_attempts_or_at_once_when_decisive() -> None:
    r = started(policy=RolloutPolicy(probe_attempts=2))
    flaky = ProbeReport(["h"], 2, 1, errors=["busy"])
    assert r.record_probe_failure(0, flaky, "c") is False
    assert r.record_probe_failure(0, flaky, "c") is True
    assert r.record_probe_failure(0, ProbeReport(["h"], 2, 0, load_failures=1), "c") is True
    assert started().record_probe_failure(0, ProbeReport(["h"], 2, 0, load_failures=1),
                                          "c") is True


def test_a_paused_rollout_is_still_judged_and_rolls_back_but_never_advances() -> None:
    r = started()
    r.enter_step(0, GOOD_PROBE, 1001.0, "c")
    r.pause("investigating", "alice")
    assert r.next_action(1062.0) == Judge(1001.0, 1061.0)  # windows go on while paused
    assert r.record_window(1001.0, 1061.0, CLEAN, 0, "c").decision == Decision.WAIT
    assert not r.advance_due and r.next_action(1070.0) == Sleep(1122.0)
    v = r.record_window(1061.0, 1121.0, figures(window(3, ok=2, identity_mismatches=1)), 0, "c")
    assert v.decision == Decision.ROLL_BACK and v.hard
    r.resume("fine", 1125.0, "alice")  # the desk rolls back in the window's transaction
    with pytest.raises(IllegalTransition, match="only a paused"):
        r.resume("again", 1126.0, "alice")


def test_a_step_undecided_at_its_deadline_pauses_with_an_alert_and_resume_extends_it() -> None:
    r = started(policy=RolloutPolicy(min_requests=20, settle_s=1.0, step_deadline_s=120.0))
    r.enter_step(0, GOOD_PROBE, 1000.0, "c")  # deadline 1120
    assert r.record_window(1000.0, 1060.0, QUIET, 0, "c").decision == Decision.WAIT
    v = r.record_window(1060.0, 1120.0, QUIET, 0, "c")
    assert v.decision == Decision.INCONCLUSIVE and r.status == RolloutStatus.PAUSED
    assert [a["kind"] for a in r.alerts] == [AlertKind.INCONCLUSIVE]
    assert r.next_action(1200.0) == Judge(1120.0, 1180.0)  # still judged
    r.resume("more traffic now", 1190.0, "alice")
    assert r.deadline_at == 1190.0 + 120.0


def test_an_unjudged_window_is_alerted_once() -> None:
    r = started()
    r.enter_step(0, GOOD_PROBE, 1000.0, "c")  # due at 1061; 120 s of lateness allowed
    assert r.unjudged_for(1181.0) is None and not r.alert_unjudged(1181.0, "c")
    assert r.unjudged_for(1200.0) == pytest.approx(139.0)
    assert r.alert_unjudged(1200.0, "c") and not r.alert_unjudged(1300.0, "c")
    assert r.alerts[-1]["kind"] == AlertKind.UNJUDGED and "controller" in r.alerts[-1]["message"]
    r.record_window(1000.0, 1060.0, QUIET, 0, "c")  # catching up: still the same outage
    assert r.unjudged_for(1300.0) is not None and not r.alert_unjudged(1300.0, "c")
    for start in range(1060, 1300, 60):
        r.record_window(float(start), float(start + 60), QUIET, 0, "c")
    assert not r.alert_unjudged(1400.0, "c")  # caught up: the window from 1300 is on time
    assert r.alert_unjudged(1600.0, "c")  # a new outage


def test_a_revoked_baseline_pauses_and_resume_compares_with_the_new_stable() -> None:
    r = started()
    r.enter_step(0, GOOD_PROBE, 1000.0, "c")
    r.record_window(1000.0, 1060.0, QUIET, 0, "c")
    r.lose_baseline("stable revoked", 1070.0, "c")
    assert r.status == RolloutStatus.PAUSED and r.baseline_lost
    with pytest.raises(IllegalTransition, match="revoked"):
        r.resume("go", 1080.0, "alice")
    new_stable = "sha256:" + "c" * 64
    r.resume("compare with c", 1080.0, "alice", baseline=(new_stable, None))
    assert (r.baseline, r.baseline_lost, r.evidence) == (new_stable, False, Evidence())
    assert r.window_start == 1060.0  # the open window is not dropped: no gap


def test_a_rollback_is_final() -> None:
    r = started()
    r.enter_step(0, GOOD_PROBE, 1001.0, "c")
    r.abort("wrong target", "alice")
    r.roll_back(["aborted by alice: wrong target"], Sessions.END, True, "alice")
    assert r.status == RolloutStatus.ROLLED_BACK and r.next_action(9999.0) == Idle()
    assert r.window_start is None and r.unjudged_for(99999.0) is None
    for move in (lambda: r.abort("again", "bob"),
                 lambda: r.roll_back(["x"], Sessions.DRAIN, False, "c"),
                 lambda: r.enter_step(1, GOOD_PROBE, 1100.0, "c"),
                 lambda: r.record_window(1001.0, 1061.0, CLEAN, 0, "c"),
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
