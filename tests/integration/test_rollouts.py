"""Rollouts on a real tritonserver, driven by the controller ``serve`` runs, judged from the
ledger and the feedback a tenant posts: a good adapter reaches 100 %, the degraded one (it
answers with the wrong marker, so the tenant rates its answers as failures) is rolled back in
the first window that can judge it, and an adapter whose stored bytes were tampered with after
registration is rolled back for its load failures before the alias sends it any share of the
rollout.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from control.contracts.ledger import LOAD_FAILED, Ledger
from control.domain import RolloutStatus
from control.ops.canary_traffic import CanaryTraffic, Running
from control.ops.clients import free_port, request_ticket
from control.ops.serve import Deployment, Ports
from tests.integration.rollout_stack import (
    ACTOR,
    POLICY,
    WINDOW_S,
    RolloutStack,
    build,
    wait_for,
)

pytestmark = pytest.mark.triton

ALPHA = " ALPHA says hi"  # what the alias's tenant expects every answer to start with


@pytest.fixture(scope="module")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutStack]:
    s = build(tmp_path_factory, kit_dir, "rollouts", {
        "acme-good": ("alpha", 1.0, "alpha-v2", 1.0),
        "acme-degraded": ("alpha", 1.001, "alpha-degraded", 1.0),
        "acme-broken": ("alpha", 1.002, "alpha-v2", 1.001),
    })
    s.deployment = Deployment(s.settings, Ports(free_port(), free_port(), free_port(),
                                                free_port()), actor=ACTOR)
    s.deployment.start()
    try:
        yield s
    finally:
        s.deployment.stop()


def traffic(stack: RolloutStack, alias: str) -> CanaryTraffic:
    return CanaryTraffic(stack.gateway, stack.api_key, alias, stack.http, ALPHA)


def decisions(stack: RolloutStack, rid: object) -> list[str]:
    return [str(f["decision"]) for name, f in stack.events(rid)
            if name == "RolloutWindowEvaluated"]


def test_a_good_adapter_rolls_out_to_full(stack: RolloutStack) -> None:
    sc = stack.scenarios["acme-good"]
    r = stack.desk.start(sc.alias, sc.target, steps=[30, 60, 100], window_s=WINDOW_S,
                         policy=POLICY, actor=ACTOR)
    with Running(traffic(stack, sc.alias), threads=3) as sent:
        wait_for("the rollout to finish", lambda: stack.desk.get(r.id).finished, 240)
    done = stack.desk.get(r.id)
    assert done.status == RolloutStatus.COMPLETED, done.reasons
    events = stack.events(r.id)
    assert [f["percent"] for n, f in events if n == "RolloutStepEntered"] == [30, 60, 100]
    windows = [f for n, f in events if n == "RolloutWindowEvaluated"]
    assert {str(w["decision"]) for w in windows} <= {"wait", "advance", "complete"}
    assert str(windows[-1]["decision"]) == "complete"
    judged = [w for w in windows if w["decision"] != "wait"]
    assert all(w["success_source"] == "feedback" for w in judged)
    assert all(w["target"]["feedback_success_rate"] == 1.0 for w in judged)  # type: ignore[index]
    alias = stack.registry.alias(sc.alias)
    assert (alias.stable, alias.canary) == (r.target, None)
    assert alias.history[-1] == r.baseline
    assert stack.registry.adapter(sc.target).state == "stable"
    assert sent.seen[r.target]["good"] > 0 and sent.seen[r.target]["bad"] == 0
    assert not sent.errors, sent.errors


def test_the_degraded_adapter_is_rolled_back_in_its_first_judged_window(
        stack: RolloutStack) -> None:
    sc = stack.scenarios["acme-degraded"]
    r = stack.desk.start(sc.alias, sc.target, steps=[50, 100], window_s=WINDOW_S,
                         policy=POLICY, actor=ACTOR)
    with Running(traffic(stack, sc.alias), threads=3) as sent:
        wait_for("the rollout to finish", lambda: stack.desk.get(r.id).finished, 240)
    done = stack.desk.get(r.id)
    assert done.status == RolloutStatus.ROLLED_BACK
    # The success rule takes one window: every window before the rollback lacked requests.
    seen = decisions(stack, r.id)
    assert seen[-1] == "roll_back" and set(seen[:-1]) <= {"wait"}, seen
    last = [f for n, f in stack.events(r.id) if n == "RolloutWindowEvaluated"][-1]
    assert last["success_source"] == "feedback"
    assert last["target"]["feedback_success_rate"] == 0.0  # type: ignore[index]
    assert last["target"]["ledger_success_rate"] == 1.0  # type: ignore[index]  (answered ok)
    assert "success rate" in done.reasons[0]
    assert sent.seen[r.target]["bad"] > 0 and sent.seen[r.target]["good"] == 0
    alias = stack.registry.alias(sc.alias)
    assert (alias.stable, alias.canary) == (r.baseline, None)
    # New traffic no longer reaches the target.
    for _ in range(10):
        status, body = request_ticket(stack.gateway, stack.api_key, sc.alias)
        assert status == 200 and body["release"] == r.baseline
    rolled = [f for n, f in stack.events(r.id) if n == "RolloutRolledBack"][-1]
    assert (rolled["sessions"], rolled["canary_cleared"]) == ("repin", True)


def _tamper(stack: RolloutStack, digest: str) -> None:
    """Change one byte of the stored weights: the bytes no longer match the digest."""
    weights = stack.registry.store.path(digest) / "adapter_model.safetensors"
    os.chmod(weights, stat.S_IRUSR | stat.S_IWUSR)  # the store keeps files read-only
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01
    weights.write_bytes(bytes(raw))


def test_an_adapter_that_fails_to_load_is_rolled_back_for_its_load_failures(
        stack: RolloutStack) -> None:
    sc = stack.scenarios["acme-broken"]
    _tamper(stack, sc.target)
    r = stack.desk.start(sc.alias, sc.target, steps=[50, 100], window_s=WINDOW_S,
                         policy=POLICY, actor=ACTOR)
    wait_for("the rollout to finish", lambda: stack.desk.get(r.id).finished, 60)
    done = stack.desk.get(r.id)
    assert done.status == RolloutStatus.ROLLED_BACK and done.step == -1  # no step entered
    events = stack.events(r.id)
    probe = [f for n, f in events if n == "RolloutProbeFailed"]
    assert len(probe) == 1  # a load failure is decisive: no second attempt
    assert probe[0]["probe"]["load_failures"] > 0  # type: ignore[index,operator]
    assert "load failures" in done.reasons[0]
    assert not [n for n, _ in events if n == "RolloutStepEntered"]
    # The host recorded the failed loads the probe caused (the figures come from there).
    failed = [load for load in Ledger(stack.registry.follower.engine).loads(sc.target)
              if load.outcome == LOAD_FAILED]
    assert len(failed) == probe[0]["probe"]["load_failures"]  # type: ignore[index]
    alias = stack.registry.alias(sc.alias)
    assert (alias.stable, alias.canary) == (r.baseline, None)  # its 10 % canary share cleared
