"""A rollout on a real deployment, watched in headless chromium: the kit, the registry, the
gateway, tritonserver and the rollout controller ``serve`` runs, with real traffic on both arms
(``tests.integration.rollout_stack``).

The rollout page is opened once; its windows then appear while traffic flows, without a reload
(the page's script fetches the fragment every second). Clicking Pause, then confirming, records
``RolloutPaused`` with the console's actor, as ``loraplane rollout pause`` would.

Skipped where tritonserver or chromium is missing, except in CI (``tests/required.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from control.console.access import load_or_create_token
from control.console.app import Console
from control.ops.serve import Deployment, Ports
from control.tools.canary_traffic import Running
from tests.control.console.conftest import chromium, shot, wait_for
from tests.control.console.server import serving
from tests.integration.rollout_stack import (
    ACTOR,
    POLICY,
    WINDOW_S,
    ArmTraffic,
    RolloutStack,
    build,
)

pytestmark = pytest.mark.triton

ALIAS = "acme-live"
ALPHA = " ALPHA says hi"  # what the tenant expects every answer to start with


@pytest.fixture(scope="module")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutStack]:
    chromium()  # skip (or fail in CI) before starting a deployment for nothing
    s = build(tmp_path_factory, kit_dir, "console-rollout",
              {ALIAS: ("alpha", 1.0, "alpha-v2", 1.0)})
    s.deployment = Deployment(s.settings, Ports.free(), actor=ACTOR)
    s.deployment.start()
    try:
        yield s
    finally:
        s.deployment.stop()


def test_windows_arrive_live_and_pause_records_the_event(stack: RolloutStack, driver: Any,
                                                         shots: Path) -> None:
    from selenium.webdriver.common.by import By

    d = driver
    sc = stack.scenarios[ALIAS]
    # Many small steps: the rollout is still running when the test pauses it.
    r = stack.desk.start(ALIAS, sc.target, steps=[5, 10, 20, 40, 60, 80, 100],
                         window_s=WINDOW_S, policy=POLICY, actor=ACTOR)
    console = Console(stack.registry, actor="op", verify_every_s=0.0, refresh_s=1)
    with serving(console) as base:
        d.get(f"{base}/login")
        d.find_element(By.ID, "token").send_keys(load_or_create_token(stack.settings.home))
        d.find_element(By.ID, "login").click()
        wait_for(lambda: d.current_url.endswith("/adapters"), what="the adapters page")
        d.get(f"{base}/rollouts/{ALIAS}")
        before = len(d.find_elements(By.CSS_SELECTOR, "#windows tr.window"))
        traffic = ArmTraffic(stack.gateway, stack.api_key, ALIAS, stack.http, ALPHA,
                             seal_keys=stack.seal_keys)
        with Running(traffic, threads=2):
            # judged windows appear on the page opened before them: no reload in between
            wait_for(lambda: len(d.find_elements(By.CSS_SELECTOR, "#windows tr.window"))
                     >= before + 2, timeout=120, what="two windows judged live")
            # the canary's line, once a judged window holds canary requests (at 5 % a short
            # window may hold none: its rate is undefined and drawn as no point)
            wait_for(lambda: bool(d.find_elements(
                By.CSS_SELECTOR, "#rollout-live svg.chart polyline.canary")),
                timeout=120, what="the canary's line on the live chart")
            shot(d, shots / "deployment-rollout.png")
            if stack.desk.get(r.id).status.value == "running":
                d.find_element(By.ID, "pause").click()
                wait_for(lambda: "/confirm" in d.current_url, what="the confirmation page")
                d.find_element(By.ID, "reason").send_keys("watching the canary")
                d.find_element(By.ID, "confirm").click()
                wait_for(lambda: d.find_element(By.ID, "rollout-status").text == "paused",
                         what="the paused status")
    assert stack.desk.get(r.id).status.value == "paused", stack.desk.get(r.id).reasons
    paused = [f for name, f in stack.desk.history(r.id) if name == "RolloutPaused"]
    assert len(paused) == 1 and paused[0]["actor"] == "op@console"
    assert paused[0]["reason"] == "watching the canary"
