"""The operator console in headless chromium against a real deployment: the kit, the registry,
the gateway and tritonserver (``tests.integration.conftest.started_stack``).

Real requests through Triton write the ledger; a revocation is carried out by the Triton host,
which reports drained, purged and unloaded. The browser then checks that the adapter's timeline
shows register -> release -> revoke and the host's steps in order, that the incident search
shows the rows ``loraplane --json incident requests`` prints and its CSV export holds them, and
that the hosts page shows the host that served them as healthy, from its own status report, with
the adapter it served in a device slot and its load queue.

Skipped where tritonserver or chromium is missing, except in CI (``tests/required.py``).
"""

from __future__ import annotations

import csv
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from typer.testing import CliRunner

from control.app.audit import audit_log
from control.app.ledger_audit import sync
from control.cli.main import app as cli
from control.console.access import COOKIE
from control.console.app import Console
from control.console.reads import ledger_checkpoints
from control.contracts.db import make_engine
from control.ops.clients import generate
from tests.artifacts import perturbed_copy
from tests.control.console.conftest import chromium, shot, wait_for
from tests.control.console.server import serving
from tests.integration.conftest import ACTOR, Stack, started_stack

pytestmark = pytest.mark.triton

ALIAS = "acme-console"


@pytest.fixture(scope="module")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    chromium()  # skip (or fail in CI) before starting a deployment for nothing
    with started_stack(kit_dir, tmp_path_factory, "console-home") as s:
        yield s


def _login(d: Any, base: str, stack: Stack) -> None:
    from selenium.webdriver.common.by import By

    from control.console.access import load_or_create_token

    d.get(f"{base}/login")
    d.find_element(By.ID, "token").send_keys(load_or_create_token(stack.settings.home))
    d.find_element(By.ID, "login").click()
    wait_for(lambda: d.current_url.endswith("/adapters"), what="the adapters page")


def test_a_served_and_revoked_adapter_in_the_console(stack: Stack, driver: Any, shots: Path,
                                                     tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    d, reg = driver, stack.registry
    src = stack.kit_dir / stack.kit.adapters["alpha"].path
    digest = reg.register_adapter(perturbed_copy(src, tmp_path / "console", 1.02),
                                  tenant="acme", alias=ALIAS, actor=ACTOR)
    reg.advance(digest, external=True, evaluation={"suite": "smoke", "passed": True},
                actor=ACTOR)
    reg.grant("acme", ALIAS, actor=ACTOR)
    ticket = stack.ticket("acme", ALIAS)
    served = [generate(stack.http, f"Hello {i}", ticket, max_tokens=4) for i in range(3)]
    assert {g.adapter_digest for g in served} == {digest}
    reg.revoke(digest, reason="console test", actor=ACTOR)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the host's steps, reported and folded into events
        steps = [e.event_type for e in audit_log(reg)
                 if e.summary.get("digest") == digest and e.actor.startswith("host:")]
        if len(steps) >= 3:
            break
        time.sleep(0.2)

    console = Console(reg, actor="op", verify_every_s=0.0, refresh_s=1)
    with serving(console) as base:
        _login(d, base, stack)
        d.get(f"{base}/adapters/{digest}")
        events = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#timeline .event")]
        order = ["AdapterRegistered", "AdapterPromoted", "AdapterRevoked", "AdapterDrained",
                 "AdapterPurged", "AdapterUnloaded"]
        assert all(e in events for e in order), events
        assert [events.index(e) for e in order] == sorted(events.index(e) for e in order)
        actors = [a.text for a in d.find_elements(By.CSS_SELECTOR, "#timeline .actor")]
        assert actors[events.index("AdapterDrained")].startswith("by host:")
        shot(d, shots / "deployment-adapter-timeline.png")

        run = CliRunner().invoke(cli, ["--json", "--home", str(stack.settings.home),
                                       "incident", "requests", "--adapter", digest])
        assert run.exit_code == 0, run.output
        cli_rows = json.loads(run.output.strip().splitlines()[-1])
        assert {r["request_id"] for r in cli_rows} >= {g.request_id for g in served}
        d.get(f"{base}/incidents")
        d.find_element(By.NAME, "adapter").send_keys(digest)
        d.find_element(By.ID, "search-go").click()
        wait_for(lambda: d.find_elements(By.ID, "incident-rows"), what="the incident rows")
        shown = [tr.find_element(By.TAG_NAME, "td").text
                 for tr in d.find_elements(By.CSS_SELECTOR, "#incident-rows tbody tr")]
        assert shown == [r["request_id"] for r in cli_rows]
        shot(d, shots / "deployment-incidents.png")
        href = d.find_element(By.ID, "csv").get_attribute("href")
        exported = requests.get(href, cookies={COOKIE: d.get_cookie(COOKIE)["value"]},
                                timeout=10)
        assert list(csv.DictReader(io.StringIO(exported.text))) == [
            {k: "" if v is None else str(v) for k, v in r.items()} for r in cli_rows]

        # The host's status report (every 2 s): healthy, its slot holding the adapter it has
        # just served, its load queue. Read in one script call: the fragment is replaced
        # whenever a report arrives, so elements found first may be gone by the next call.
        alpha = stack.digests["alpha"]
        assert generate(stack.http, "Hello", stack.ticket("acme", "acme-alpha"),
                        max_tokens=2).adapter_digest == alpha
        d.get(f"{base}/hosts")

        def reported() -> str:
            text = str(d.execute_script(
                "return document.getElementById('hosts-live').innerText"))
            return text if "healthy" in text and alpha[:19] in text else ""

        hosts = wait_for(reported, timeout=15, what="the host's status report with alpha")
        assert cli_rows[0]["host"] in hosts and "not reporting" not in hosts
        assert re.search(r"load queue \d+ of \d+", hosts) and re.search(r"\d+ of \d+ slots", hosts)
        shot(d, shots / "deployment-hosts.png")

        # the host signs a checkpoint of its ledger log every 10 s; once verified, the audit
        # page names it
        engine = make_engine(stack.settings.db_url)

        def verified() -> bool:
            sync(reg, engine)
            return any(h["host"] == cli_rows[0]["host"] for h in ledger_checkpoints(engine))

        wait_for(verified, timeout=40, what="a verified checkpoint of the host's ledger log")
        d.get(f"{base}/audit")
        assert "INTACT" in d.find_element(By.ID, "verdict").text
        assert cli_rows[0]["host"] in d.find_element(By.ID, "ledger-checkpoints").text
        shot(d, shots / "deployment-audit.png")
