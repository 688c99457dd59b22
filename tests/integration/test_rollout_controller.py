"""The rollout controller as a process of its own, against a real tritonserver whose engine model
is the production glue over :class:`tests.rollout_faults.SwappingEngine` (this test's own model
repository; ``serve`` can never launch it): an injected identity mismatch rolls the canary back
as soon as the controller sees it (within seconds of the failed request, not at a window's
end), and a controller killed with SIGKILL mid-rollout, twice, resumes from the recorded events
without repeating or skipping a step, and without leaving any stretch of the canary's traffic
out of a judged window.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from control.contracts.ledger import Ledger, Outcome
from control.domain import RolloutPolicy, RolloutStatus
from control.ops.model_repositories import derived_repository
from control.ops.serve import Deployment, Ports
from control.tools.canary_traffic import PROMPTS, Running
from tests import REPO
from tests.integration.rollout_stack import (
    ACTOR,
    POLICY,
    WINDOW_S,
    ArmTraffic,
    RolloutStack,
    build,
    wait_for,
)
from tests.rollout_faults import MODEL_SOURCE, SWAP

pytestmark = pytest.mark.triton

ALPHA = " ALPHA says hi"


@pytest.fixture(scope="module")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutStack]:
    s = build(tmp_path_factory, kit_dir, "rollout-controller", {
        "acme-swap": ("alpha", 1.003, "alpha-v2", 1.002),
        "acme-kill": ("alpha", 1.004, "alpha-v2", 1.003),
    })
    repo = derived_repository(tmp_path_factory.mktemp("swap-repo") / "models", MODEL_SOURCE)
    # No controller in the deployment: the test runs it as a process it can kill.
    s.deployment = Deployment(s.settings, Ports.free(), actor=ACTOR,
                              model_repository=repo, rollout_controller=False)
    s.deployment.start()
    try:
        yield s
    finally:
        s.deployment.stop()


class ControllerProcess:
    """``python -m control.ops.rollout_controller`` for the stack, logging to a file."""

    def __init__(self, stack: RolloutStack, log: Path) -> None:
        self.stack = stack
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "LORAPLANE_HOME": str(self.stack.settings.home),
               "LORAPLANE_DB_URL": self.stack.settings.db_url,
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO),
                                                         os.environ.get("PYTHONPATH")) if p)}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "control.ops.rollout_controller", "--triton",
                 self.stack.http], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        assert self.proc.returncode == -signal.SIGKILL

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def controller(stack: RolloutStack, tmp_path: Path) -> Iterator[ControllerProcess]:
    c = ControllerProcess(stack, tmp_path / "controller.log")
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _names(stack: RolloutStack, rid: object) -> list[str]:
    return [n for n, _ in stack.events(rid)]


def test_an_injected_identity_mismatch_rolls_back_as_soon_as_it_is_seen(
        stack: RolloutStack, controller: ControllerProcess,
        record_property: pytest.RecordProperty) -> None:
    sc = stack.scenarios["acme-swap"]
    r = stack.desk.start(sc.alias, sc.target, steps=[50, 100], window_s=WINDOW_S,
                         policy=POLICY, actor=ACTOR)

    def prompt(release: str | None, n: int) -> str:
        # Every request the canary serves is swapped under the engine; none of the baseline's.
        text = PROMPTS[n % len(PROMPTS)]
        return f"{SWAP} {text}" if release == r.target else text

    sent = ArmTraffic(stack.gateway, stack.api_key, sc.alias, stack.http, ALPHA,
                      prompt_for=prompt, seal_keys=stack.seal_keys)
    with Running(sent, threads=2):
        wait_for("the rollout to finish", lambda: stack.desk.get(r.id).finished, 180)
    done = stack.desk.get(r.id)
    assert done.status == RolloutStatus.ROLLED_BACK
    assert "identity mismatches" in done.reasons[0], done.reasons
    rows = Ledger(stack.registry.follower.engine).query(
        release=r.target, outcome=Outcome.IDENTITY_MISMATCH.value)
    assert rows and all(row.reason == "stale_slot" for row in rows)
    assert sent.seen[r.target]["refused"] > 0 and sent.seen[r.baseline]["good"] > 0
    # Acted on the event: from the first mismatch recorded to the rollback recorded.
    first = min(row.finished_at for row in rows if row.finished_at is not None)
    rolled = next(e for e in stack.registry.repository.event_store.get(r.id)
                  if type(e).__name__ == "RolloutRolledBack")
    reaction_s = rolled.timestamp.timestamp() - first
    record_property("mismatch_to_rollback_s", round(reaction_s, 3))
    assert reaction_s < 10.0  # a check a second, on two busy cores: seconds, not a window
    alias = stack.registry.alias(sc.alias)
    assert (alias.stable, alias.canary) == (r.baseline, None)


def test_a_controller_killed_mid_rollout_resumes_without_repeating_or_skipping(
        stack: RolloutStack, controller: ControllerProcess,
        record_property: pytest.RecordProperty) -> None:
    sc = stack.scenarios["acme-kill"]
    steps = [20, 40, 60, 80, 100]
    # A 25-point margin: some ten requests per arm advance a step; restarts are under test, not
    # latency (a controller restarted mid-window on two busy cores sees slow requests of both
    # arms; a loose p95 bound keeps that from deciding this test).
    policy = RolloutPolicy(min_requests=5, min_ratings=5, margin_pp=25, settle_s=0.3,
                           probe_requests=2, max_p95_ratio=10.0)
    r = stack.desk.start(sc.alias, sc.target, steps=steps, window_s=1.5, policy=policy,
                         actor=ACTOR)
    kills: list[str] = []
    with Running(ArmTraffic(stack.gateway, stack.api_key, sc.alias, stack.http, ALPHA,
                            rate=False, seal_keys=stack.seal_keys), threads=2):
        # 1: mid-window, right after a step was entered
        wait_for("step 1", lambda: "RolloutStepEntered" in _names(stack, r.id), 60)
        controller.kill()
        kills.append(_names(stack, r.id)[-1])
        controller.start()

        # 2: right after a window decided to advance (the next probe is then under way)
        def advanced() -> bool:
            events = stack.events(r.id)
            return bool(events) and events[-1][0] == "RolloutWindowEvaluated" and (
                events[-1][1]["decision"] == "advance")

        wait_for("a window that advances", advanced, 120)
        controller.kill()
        kills.append(_names(stack, r.id)[-1])
        controller.start()
        wait_for("the rollout to finish", lambda: stack.desk.get(r.id).finished, 240)
    done = stack.desk.get(r.id)
    assert done.status == RolloutStatus.COMPLETED, done.reasons
    events = stack.events(r.id)
    entered = [f["step"] for n, f in events if n == "RolloutStepEntered"]
    assert entered == list(range(len(steps)))  # each step once, in order
    assert [n for n, _ in events].count("RolloutCompleted") == 1
    windows = [f for n, f in events if n == "RolloutWindowEvaluated"]
    # No stretch of traffic left out: each window starts where the one before it ended, across
    # the kills, the steps and the probes between them.
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(windows))
    for index in range(len(steps) - 1):  # each step's windows numbered 1..k
        mine = [w for w in windows if w["step"] == index]
        assert [w["window"] for w in mine] == list(range(1, len(mine) + 1))
        decided = [w["decision"] for w in mine]
        first = next(i for i, d in enumerate(decided) if d in ("advance", "complete"))
        # Waiting until the evidence sufficed; then (a window may close while the next step
        # is probed) never anything but the same conclusion or more waiting.
        assert set(decided[:first]) <= {"wait"} and set(decided[first:]) <= {
            "advance", "complete", "wait"}, decided
    # What the controller was doing when it died, as the event store showed it then.
    record_property("last_event_at_each_kill", kills)
    record_property("events", [n for n, _ in events])
    alias = stack.registry.alias(sc.alias)
    assert (alias.stable, alias.canary) == (r.target, None)
