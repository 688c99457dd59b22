"""Rollouts on a real tritonserver, driven by the controller ``serve`` runs, judged from the
ledger and the feedback a tenant posts. The DEFAULT policy (``RolloutPolicy()``: alpha 0.02,
power 0.95, a 3-point margin, at least 100 requests and 100 ratings per arm) runs end to end
twice: a good adapter reaches 100 % once each step's evidence shows it not worse (real ledger
rows of real requests, some 150 per arm per step, windows of two seconds), and the degraded one
(it answers with the wrong marker, so the tenant rates its answers as failures) is rolled back
as soon as its feedback is significantly worse. An adapter whose stored bytes were tampered with
after registration is rolled back for its load failures before the alias sends it any share of
the rollout.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from control.contracts.ledger import LOAD_FAILED, MEMORY_REFUSALS, Ledger, Outcome
from control.contracts.synthetic import PROBE_TENANT
from control.domain import RolloutPolicy, RolloutStatus
from control.ops.clients import request_ticket
from control.ops.serve import Deployment, Ports
from control.tools.canary_traffic import Running
from tests.integration.rollout_stack import (
    ACTOR,
    POLICY,
    WINDOW_S,
    ArmTraffic,
    RolloutStack,
    build,
    ticket_release,
    wait_for,
)

DEFAULT = RolloutPolicy()

pytestmark = pytest.mark.triton

ALPHA = " ALPHA says hi"  # what the alias's tenant expects every answer to start with


@pytest.fixture(scope="module")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutStack]:
    s = build(tmp_path_factory, kit_dir, "rollouts", {
        "acme-good": ("alpha", 1.0, "alpha-v2", 1.0),
        "acme-degraded": ("alpha", 1.001, "alpha-degraded", 1.0),
        "acme-broken": ("alpha", 1.002, "alpha-v2", 1.001),
    })
    s.deployment = Deployment(s.settings, Ports.free(), actor=ACTOR)
    s.deployment.start()
    try:
        yield s
    finally:
        s.deployment.stop()


def traffic(stack: RolloutStack, alias: str) -> ArmTraffic:
    return ArmTraffic(stack.gateway, stack.api_key, alias, stack.http, ALPHA,
                      seal_keys=stack.seal_keys)


def decisions(stack: RolloutStack, rid: object) -> list[str]:
    return [str(f["decision"]) for name, f in stack.events(rid)
            if name == "RolloutWindowEvaluated"]


def test_a_good_adapter_rolls_out_to_full_under_the_default_policy(
        stack: RolloutStack, record_property: pytest.RecordProperty) -> None:
    sc = stack.scenarios["acme-good"]
    r = stack.desk.start(sc.alias, sc.target, steps=[50, 100], window_s=WINDOW_S,
                         policy=DEFAULT, actor=ACTOR)
    with Running(traffic(stack, sc.alias), threads=3) as sent:
        wait_for("the rollout to finish", lambda: stack.desk.get(r.id).finished, 400)
    done = stack.desk.get(r.id)
    assert done.status == RolloutStatus.COMPLETED, done.reasons
    events = stack.events(r.id)
    assert events[0][1]["policy"] == DEFAULT.to_json()  # the policy is on the record
    assert [f["percent"] for n, f in events if n == "RolloutStepEntered"] == [50, 100]
    windows = [f for n, f in events if n == "RolloutWindowEvaluated"]
    assert {str(w["decision"]) for w in windows[:-1]} == {"wait"}
    assert str(windows[-1]["decision"]) == "complete"
    final: dict = windows[-1]["evidence"]  # type: ignore[assignment]
    # Enough real requests for the default minimum, on both arms, and every gate passed.
    assert min(final["errors"][0][1], final["errors"][1][1]) >= DEFAULT.min_requests
    metrics: dict = windows[-1]["metrics"]  # type: ignore[assignment]
    assert metrics["errors"]["state"] == "not_worse"
    assert metrics["feedback"]["state"] == "not_worse" and metrics["feedback"]["gating"]
    # Each window started where the one before ended.
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(windows))
    alias = stack.registry.alias(sc.alias)
    assert (alias.stable, alias.canary) == (r.target, None)
    assert alias.history[-1] == r.baseline
    assert stack.registry.adapter(sc.target).state == "stable"
    assert sent.seen[r.target]["good"] > 0 and sent.seen[r.target]["bad"] == 0
    assert not sent.errors, sent.errors
    record_property("requests_per_arm", [final["errors"][0][1], final["errors"][1][1]])
    record_property("windows", len(windows))


def test_the_degraded_adapter_is_rolled_back_under_the_default_policy(
        stack: RolloutStack) -> None:
    sc = stack.scenarios["acme-degraded"]
    r = stack.desk.start(sc.alias, sc.target, steps=[50, 100], window_s=WINDOW_S,
                         policy=DEFAULT, actor=ACTOR)
    with Running(traffic(stack, sc.alias), threads=3) as sent:
        wait_for("the rollout to finish", lambda: stack.desk.get(r.id).finished, 240)
    done = stack.desk.get(r.id)
    assert done.status == RolloutStatus.ROLLED_BACK
    # Evidence accumulates: every window before the rollback waited for more.
    seen = decisions(stack, r.id)
    assert seen[-1] == "roll_back" and set(seen[:-1]) <= {"wait"}, seen
    last = [f for n, f in stack.events(r.id) if n == "RolloutWindowEvaluated"][-1]
    metrics: dict = last["metrics"]  # type: ignore[assignment]
    assert metrics["feedback"]["state"] == "worse"
    assert metrics["errors"]["state"] != "worse"  # every answer was ok in the ledger
    assert last["target"]["feedback_success_rate"] == 0.0  # type: ignore[index]
    assert done.reasons[0].startswith("feedback:")
    assert sent.seen[r.target]["bad"] > 0 and sent.seen[r.target]["good"] == 0
    alias = stack.registry.alias(sc.alias)
    assert (alias.stable, alias.canary) == (r.baseline, None)
    # New traffic no longer reaches the target.
    for _ in range(10):
        status, body = request_ticket(stack.gateway, stack.api_key, sc.alias)
        assert status == 200
        assert ticket_release(body["ticket"], stack.settings.keys_dir) == r.baseline
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
    # What the host recorded, read apart from the probe's report: failed loads of the target
    # for its own bytes (not a full host), and the probe's requests refused for them, under
    # the synthetic probe tenant (no window counts them as the owner's traffic).
    ledger = Ledger(stack.registry.follower.engine)
    failed = [load for load in ledger.loads(sc.target) if load.outcome == LOAD_FAILED]
    capacity = {m.removeprefix("adapter_") for m in MEMORY_REFUSALS}
    assert failed and all(load.reason not in capacity for load in failed)
    refused = ledger.query(adapter=sc.target, outcome=Outcome.REJECTED.value)
    assert refused and {row.tenant for row in refused} == {PROBE_TENANT}
    alias = stack.registry.alias(sc.alias)
    assert (alias.stable, alias.canary) == (r.baseline, None)  # its 10 % canary share cleared
