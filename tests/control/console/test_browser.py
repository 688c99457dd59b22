"""The operator console in a real browser: Debian's chromium, headless, driven by Selenium
through the system chromedriver, against the console serving a real registry (SQLite).

It checks what only a browser shows: the login form's cookie works; a tenant's
``<script>alert(1)</script>`` renders as text and never runs; the page's own script runs under
the strict CSP and no CSP violation is reported; the rollout's windows appear without a reload
as traffic flows, and the pause button, through its confirmation page, records
``RolloutPaused``; the incident search shows the CLI's rows and its CSV export holds them; a
tampered event turns the audit page red; a host that stopped reporting its status is shown in
red. Screenshots of each page go to
``$LORAPLANE_TEST_ARTIFACTS/console`` (default: the pytest temporary folder).

Skipped where chromium or chromedriver is missing, except in CI (``tests/required.py``).
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import sqlalchemy as sa
from typer.testing import CliRunner

from control.app.integrity import AuditSeal
from control.cli.main import app as cli
from control.console.access import COOKIE, load_or_create_token
from control.console.app import Console
from control.contracts.db import make_engine
from control.contracts.host_status import HostStatus, HostStatusTable, SlotEntry
from control.domain import AdapterMetadata, RolloutPolicy
from tests.control.app.rollout_world import ALIAS, WINDOW, RolloutWorld, World
from tests.control.console.conftest import csp_violations, shot, wait_for
from tests.control.console.server import serving
from tests.fixtures_control import OnSQLite

XSS = "<script>alert(1)</script>"
POLICY = RolloutPolicy(min_requests=20, min_ratings=20, margin_pp=10, settle_s=1.0,
                       probe_attempts=2)


class TestConsoleInChromium(RolloutWorld, OnSQLite):
    @pytest.fixture
    def console(self, world: World) -> Console:
        return Console(world.reg, actor="op", verify_every_s=0.0, refresh_s=1)

    @pytest.fixture
    def base(self, console: Console) -> Iterator[str]:
        with serving(console) as url:
            yield url

    def login(self, d: Any, base: str, console: Console, shots: Path) -> None:
        from selenium.webdriver.common.by import By

        d.get(f"{base}/adapters")
        assert d.current_url.endswith("/login")  # no credential: the login form
        d.find_element(By.ID, "token").send_keys("lp_not-the-console-token")
        d.find_element(By.ID, "login").click()
        wait_for(lambda: d.find_elements(By.ID, "error"), what="the refusal")
        assert "not the console token" in d.find_element(By.ID, "error").text
        d.find_element(By.ID, "token").send_keys(
            load_or_create_token(console.reg.settings.home))
        shot(d, shots / "login.png")
        d.find_element(By.ID, "login").click()
        wait_for(lambda: d.current_url.endswith("/adapters"), what="the adapters page")
        cookie = d.get_cookie(COOKIE)
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

    def test_timeline_escaping_incidents_and_audit(self, world: World, base: str,
                                                   console: Console, driver: Any,
                                                   shots: Path) -> None:
        from selenium.common.exceptions import NoAlertPresentException
        from selenium.webdriver.common.by import By

        d = driver
        reg = world.reg
        digest = reg.register_adapter(world.artifacts.adapters["gamma"], tenant="acme",
                                      alias="xss", actor="op",
                                      metadata=AdapterMetadata(owner=XSS))
        reg.advance(digest, evaluation={"suite": "smoke", "passed": True}, to="stable",
                    actor="rel", external=True)
        reg.revoke(digest, f"leak {XSS}", actor="sec")
        self.login(d, base, console, shots)
        shot(d, shots / "adapters.png")

        # the timeline after register -> release -> revoke, in order; the tenant's text as text
        d.get(f"{base}/adapters/{digest}")
        events = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#timeline .event")]
        assert events[0] == "AdapterRegistered"
        assert events.index("EvaluationRecorded") < events.index("AdapterPromoted") \
            < events.index("AdapterRevoked")
        assert XSS in d.find_element(By.ID, "timeline").text  # shown, as text
        with pytest.raises(NoAlertPresentException):
            d.switch_to.alert.text  # noqa: B018  (it never ran)
        assert not d.find_elements(By.CSS_SELECTOR, "#timeline script")
        shot(d, shots / "adapter-timeline.png")

        # incident search: the CLI's rows, and the CSV export holds them
        stable, _ = world.releases()
        world.traffic(stable, world.stable, 4)
        run = CliRunner().invoke(cli, ["--json", "--home", str(reg.settings.home), "incident",
                                       "requests", "--adapter", world.stable])
        assert run.exit_code == 0, run.output
        cli_rows = json.loads(run.output.strip().splitlines()[-1])
        d.get(f"{base}/incidents")
        d.find_element(By.NAME, "adapter").send_keys(world.stable)
        d.find_element(By.ID, "search-go").click()
        wait_for(lambda: d.find_elements(By.ID, "incident-rows"), what="the incident rows")
        shown = [tr.find_element(By.TAG_NAME, "td").text
                 for tr in d.find_elements(By.CSS_SELECTOR, "#incident-rows tbody tr")]
        assert shown == [r["request_id"] for r in cli_rows] and len(shown) == 4
        shot(d, shots / "incidents.png")
        href = d.find_element(By.ID, "csv").get_attribute("href")
        exported = requests.get(href, cookies={COOKIE: d.get_cookie(COOKIE)["value"]},
                                timeout=10)
        assert list(csv.DictReader(io.StringIO(exported.text))) == [
            {k: "" if v is None else str(v) for k, v in r.items()} for r in cli_rows]

        # audit: green, then red once an event is edited in the database
        assert AuditSeal.for_registry(reg).seal() is not None
        d.get(f"{base}/audit")
        assert "INTACT" in d.find_element(By.ID, "verdict").text
        shot(d, shots / "audit.png")
        with make_engine(reg.settings.db_url).begin() as conn:
            state = bytes(conn.execute(
                sa.text("SELECT state FROM registry_events WHERE id = 3")).scalar_one())
            conn.execute(sa.text("UPDATE registry_events SET state = :s WHERE id = 3"),
                         {"s": state.replace(b'"op"', b'"eve"')})
        d.refresh()
        verdict = d.find_element(By.ID, "verdict")
        assert "TAMPERED" in verdict.text
        assert verdict.value_of_css_property("background-color") in (
            "rgba(192, 21, 27, 1)", "rgb(192, 21, 27)")
        shot(d, shots / "audit-tampered.png")

        # hosts: one reporting its status (healthy, in green), one silent for longer than
        # three report periods (in red), as Triton hosts write their reports
        now, slot = time.time(), 320 << 20
        table = HostStatusTable(make_engine(reg.settings.db_url))
        table.put(HostStatus(
            "h1", now, now - 3600, 4,
            device=(SlotEntry(world.stable, slot, 1), SlotEntry(world.target, slot, 0)),
            host_tier=(SlotEntry(world.stable, 84 << 20, 1),), pending_loads=1,
            load_waiters=2, load_queue_max=64, running=1, waiting=2, kv_tokens_reserved=96,
            kv_tokens_budget=8192, device_bytes=2 * slot, device_budget=4 * slot,
            host_bytes=84 << 20, host_budget=1 << 30, health={"violations": 0}))
        table.put(HostStatus("h2", now - 90, now - 7200, 4,
                             device=(SlotEntry(world.target, slot, 0),), load_queue_max=64,
                             kv_tokens_reserved=0, kv_tokens_budget=8192,
                             device_bytes=slot, device_budget=4 * slot, host_budget=1 << 30))
        d.get(f"{base}/hosts")
        # one script call: the live fragment may be replaced between two WebDriver calls
        health = {host: (text, color) for host, text, color in d.execute_script(
            "return Array.from(document.querySelectorAll('#hosts tbody tr')).map(function (tr) {"
            " var s = tr.querySelector('td.health span');"
            " return [tr.cells[0].innerText, s.innerText, getComputedStyle(s).color]; });")}
        assert health["h1"] == ("healthy", "rgb(27, 122, 51)")
        assert health["h2"][0].startswith("not reporting since")
        assert health["h2"][1] == "rgb(192, 21, 27)"
        shot(d, shots / "hosts.png")
        assert csp_violations(d) == []

    def test_rollout_windows_arrive_live_and_pause_records_the_event(
            self, world: World, base: str, console: Console, driver: Any,
            shots: Path) -> None:
        from selenium.webdriver.common.by import By

        d, w = driver, world
        w.desk.start(ALIAS, w.target, steps=[10, 25, 50, 100], window_s=WINDOW, policy=POLICY,
                     actor="alice")
        c = w.controller()
        assert c.tick() == 1
        self.login(d, base, console, shots)
        d.get(f"{base}/rollouts/{ALIAS}")
        assert "no window judged yet" in d.find_element(By.ID, "windows").text

        def window() -> None:
            w.clock.now += POLICY.settle_s
            stable, canary = w.releases()
            w.traffic(canary, w.target, 40, rated=True)
            w.traffic(stable, w.stable, 40, rated=True)
            w.clock.now += WINDOW
            assert c.tick() >= 1

        for n in (1, 2):  # each window appears without a reload, through the page's script
            window()
            wait_for(lambda n=n: len(d.find_elements(  # type: ignore[misc]
                By.CSS_SELECTOR, "#windows tr.window")) == n, what=f"window {n} on the page")
        assert d.find_elements(By.CSS_SELECTOR, "#rollout-live svg.chart polyline.canary")
        shot(d, shots / "rollout.png")
        d.get(f"{base}/rollouts")
        shot(d, shots / "rollouts.png")

        d.get(f"{base}/rollouts/{ALIAS}")
        d.find_element(By.ID, "pause").click()
        wait_for(lambda: "/confirm" in d.current_url, what="the confirmation page")
        assert not w.events("RolloutPaused")  # a click alone changes nothing
        d.find_element(By.ID, "reason").send_keys("looking at p95")
        shot(d, shots / "rollout-confirm.png")
        d.find_element(By.ID, "confirm").click()
        wait_for(lambda: d.find_element(By.ID, "rollout-status").text == "paused",
                 what="the paused status")
        paused = w.events("RolloutPaused")
        assert len(paused) == 1 and paused[0].actor == "op@console"
        assert paused[0].summary.get("reason") == "looking at p95"
        assert csp_violations(d) == []
