"""The operator console over HTTP, against a real registry on SQLite: who gets in, what every
answer's headers say, that tenant text is escaped, and that each page shows what the CLI and the
event store say (the timeline's order, the CLI's incident rows, a tampered history in red, a
rollout's windows and its pause button recording ``RolloutPaused``)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import stat
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
from control.console.access import COOKIE, load_or_create_token, rotate_token, token_path
from control.console.app import CSP, Console
from control.console.reads import iso
from control.contracts.db import make_engine
from control.contracts.host_status import HostStatus, HostStatusTable, SlotEntry
from control.contracts.ledger import AdapterLoad
from control.domain import AdapterMetadata, RolloutPolicy
from tests.control.app.rollout_world import ALIAS, WINDOW, RolloutWorld, World
from tests.control.console.server import csrf_of, logged_in, serving
from tests.fixtures_control import OnSQLite

XSS = "<script>alert(1)</script>"
POLICY = RolloutPolicy(min_requests=20, min_ratings=20, margin_pp=10, settle_s=1.0,
                       probe_attempts=2)


class TestConsole(RolloutWorld, OnSQLite):
    @pytest.fixture
    def console(self, world: World) -> Console:
        return Console(world.reg, actor="op", verify_every_s=0.0)

    @pytest.fixture
    def base(self, console: Console) -> Iterator[str]:
        with serving(console) as url:
            yield url

    @pytest.fixture
    def client(self, base: str, console: Console) -> requests.Session:
        return logged_in(base, console)

    # -- access -------------------------------------------------------------------------------

    def test_no_credential_and_tenant_keys_are_refused(self, world: World, base: str,
                                                       console: Console) -> None:
        tenant_key = world.reg.create_tenant("mallory", actor="op")
        page = requests.get(f"{base}/adapters", allow_redirects=False, timeout=10)
        assert page.status_code == 303 and page.headers["Location"] == "/login"
        assert requests.get(f"{base}/incidents?adapter=x&format=json",
                            timeout=10).status_code == 401
        assert requests.get(f"{base}/rollouts/live", timeout=10).status_code == 401
        bearer = {"Authorization": f"Bearer {tenant_key}"}
        assert requests.get(f"{base}/adapters", headers=bearer, timeout=10).status_code == 401
        r = requests.post(f"{base}/login", data={"token": tenant_key}, allow_redirects=False,
                          timeout=10)
        assert r.status_code == 401 and COOKIE not in r.cookies
        token = load_or_create_token(console.reg.settings.home)
        ok = requests.get(f"{base}/adapters", headers={"Authorization": f"Bearer {token}"},
                          timeout=10)
        assert ok.status_code == 200 and "Adapters" in ok.text

    def test_token_file_is_private_and_login_cookie_strict(self, base: str,
                                                           console: Console) -> None:
        path = token_path(console.reg.settings.home)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        r = requests.post(f"{base}/login", data={"token": path.read_text().strip()},
                          allow_redirects=False, timeout=10)
        cookie = r.headers["Set-Cookie"]
        assert r.status_code == 303 and "HttpOnly" in cookie and "SameSite=Strict" in cookie

    def test_rotating_the_token_ends_every_session(self, base: str, console: Console,
                                                   client: requests.Session) -> None:
        assert client.get(f"{base}/adapters", timeout=10).status_code == 200
        rotate_token(console.reg.settings.home)
        r = client.get(f"{base}/adapters", allow_redirects=False, timeout=10)
        assert r.status_code == 303 and r.headers["Location"] == "/login"

    def test_every_answer_has_a_strict_csp_and_loads_nothing_from_elsewhere(
            self, base: str, client: requests.Session) -> None:
        for path in ("/login", "/adapters", "/rollouts", "/incidents", "/audit", "/hosts",
                     "/static/console.js", "/nowhere"):
            r = client.get(f"{base}{path}", timeout=10)
            assert r.headers["Content-Security-Policy"] == CSP, path
            assert r.headers["X-Frame-Options"] == "DENY"
            if r.headers.get("Content-Type", "").startswith("text/html"):
                assert "<script>" not in r.text  # no inline script, only src="/static/..."
                for url in re.findall(r'(?:src|href|action)="([^"]*)"', r.text):
                    assert url.startswith(("/", "#")) or not url, (path, url)
        assert "script-src 'self'" in CSP and "frame-ancestors 'none'" in CSP
        assert "unsafe-inline" not in CSP
        anon = requests.get(f"{base}/adapters", allow_redirects=False, timeout=10)
        assert anon.headers["Content-Security-Policy"] == CSP  # refusals too

    # -- escaping and the timeline ----------------------------------------------------------------

    def test_tenant_text_renders_as_text_and_the_timeline_is_in_order(
            self, world: World, base: str, client: requests.Session) -> None:
        reg = world.reg
        d = reg.register_adapter(world.artifacts.adapters["gamma"], tenant="acme",
                                 alias="xss", actor="op",
                                 metadata=AdapterMetadata(owner=XSS, training_data_version=XSS))
        reg.advance(d, evaluation={"suite": "smoke", "passed": True}, to="stable", actor="rel",
                    external=True)
        reg.revoke(d, XSS, actor="sec")
        page = client.get(f"{base}/adapters/{d}", timeout=10)
        assert page.status_code == 200
        assert XSS not in page.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        events = re.findall(r'<span class="event">(\w+)</span>', page.text)
        assert events[0] == "AdapterRegistered"
        # revoked last, but for what the revocation did to its alias (fell back)
        assert events.index("AdapterRevoked") > events.index("AdapterPromoted")
        assert events[events.index("AdapterRevoked"):] == ["AdapterRevoked", "AliasFellBack"]
        promoted = [i for i, e in enumerate(events) if e == "AdapterPromoted"]
        assert promoted and promoted[0] > events.index("EvaluationRecorded")
        assert "AliasPointed" in events  # the alias event that pointed to its release
        times = re.findall(r"<time>([^<]+)</time>", page.text)
        assert times == sorted(times) and len(times) == len(events)
        listing = client.get(f"{base}/adapters", timeout=10).text
        assert d in listing and XSS not in listing

    # -- incidents ----------------------------------------------------------------------------

    def test_incident_rows_and_exports_are_the_clis_rows(self, world: World, base: str,
                                                         client: requests.Session) -> None:
        stable, _canary = world.releases()
        world.traffic(stable, world.stable, 3)
        world.traffic(stable, world.stable, 1, outcome="rejected", reason="busy")
        home = world.reg.settings.home
        run = CliRunner().invoke(cli, ["--json", "--home", str(home), "incident", "requests",
                                       "--adapter", world.stable], env={"COLUMNS": "200"})
        assert run.exit_code == 0, run.output
        cli_rows = json.loads(run.output.strip().splitlines()[-1])
        assert len(cli_rows) == 3
        got = client.get(f"{base}/incidents", params={"adapter": world.stable,
                                                      "format": "json"}, timeout=10)
        assert got.status_code == 200 and got.json() == cli_rows
        exported = client.get(f"{base}/incidents", params={"adapter": world.stable,
                                                           "format": "csv"}, timeout=10)
        rows = list(csv.DictReader(io.StringIO(exported.text)))
        assert rows == [{k: "" if v is None else str(v) for k, v in r.items()}
                        for r in cli_rows]
        page = client.get(f"{base}/incidents", params={"adapter": world.stable}, timeout=10)
        shown = re.findall(r"<tr><td>(r\d+)</td>", page.text)
        assert shown == [r["request_id"] for r in cli_rows]
        by_tenant = client.get(f"{base}/incidents", params={
            "adapter": world.stable, "tenant": "nobody", "format": "json"}, timeout=10)
        assert by_tenant.json() == []
        bad = client.get(f"{base}/incidents", params={"adapter": "nope"}, timeout=10)
        assert bad.status_code == 400 and 'class="error"' in bad.text

    # -- audit --------------------------------------------------------------------------------

    def test_a_tampered_event_turns_the_audit_page_red(self, world: World, base: str,
                                                       client: requests.Session) -> None:
        assert AuditSeal.for_registry(world.reg).seal() is not None
        intact = client.get(f"{base}/audit", timeout=10).text
        assert 'class="verdict-ok"' in intact and "verdict-bad" not in intact
        assert 'id="seals"' in intact and "<td>1</td>" in intact
        with make_engine(world.reg.settings.db_url).begin() as conn:
            state = bytes(conn.execute(
                sa.text("SELECT state FROM registry_events WHERE id = 3")).scalar_one())
            forged = state.replace(b'"op"', b'"eve"')
            assert forged != state
            conn.execute(sa.text("UPDATE registry_events SET state = :s WHERE id = 3"),
                         {"s": forged})
        red = client.get(f"{base}/audit", timeout=10).text
        assert 'class="verdict-bad"' in red and "TAMPERED" in red and "modified" in red

    # -- rollouts -----------------------------------------------------------------------------

    def _rollout_with_a_window(self, w: World) -> None:
        w.desk.start(ALIAS, w.target, steps=[25, 50, 100], window_s=WINDOW, policy=POLICY,
                     actor="alice")
        c = w.controller()
        assert c.tick() == 1
        w.clock.now += POLICY.settle_s
        stable, canary = w.releases()
        w.traffic(canary, w.target, 40, rated=True)
        w.traffic(stable, w.stable, 40, rated=True)
        w.clock.now += WINDOW
        assert c.tick() >= 1

    def test_rollout_windows_and_the_pause_button(self, world: World, base: str,
                                                  client: requests.Session) -> None:
        self._rollout_with_a_window(world)
        listing = client.get(f"{base}/rollouts/live", timeout=10).text
        assert f'href="/rollouts/{ALIAS}?number=1"' in listing
        page = client.get(f"{base}/rollouts/{ALIAS}", timeout=10).text
        assert page.count('<tr class="window">') >= 1 and "<svg" in page
        assert 'data-refresh="/rollouts/chat/live?number=1"' in page
        live = client.get(f"{base}/rollouts/{ALIAS}/live", timeout=10)
        assert live.status_code == 200 and '<tr class="window">' in live.text
        confirm = client.get(f"{base}/rollouts/{ALIAS}/confirm",
                             params={"action": "pause", "number": "1"}, timeout=10)
        token = csrf_of(confirm.text)
        url = f"{base}/rollouts/{ALIAS}/pause"
        assert client.post(url, data={"confirm": "yes"}, timeout=10).status_code == 403
        assert client.post(url, data={"csrf": "x" + token, "confirm": "yes"},
                           timeout=10).status_code == 403
        assert client.post(url, data={"csrf": token}, timeout=10).status_code == 400
        assert client.post(url, data={"csrf": token, "confirm": "yes"}, timeout=10,
                           headers={"Origin": "http://evil.example"}).status_code == 403
        assert not world.events("RolloutPaused")
        done = client.post(url, data={"csrf": token, "confirm": "yes", "reason": XSS},
                           allow_redirects=False, timeout=10)
        assert done.status_code == 303
        paused = world.events("RolloutPaused")
        assert len(paused) == 1 and paused[0].actor == "op@console"
        after = client.get(f"{base}/rollouts/{ALIAS}", timeout=10).text
        assert 'id="rollout-status">paused<' in after and XSS not in after
        abort = f"{base}/rollouts/{ALIAS}/abort"
        assert client.post(abort, data={"csrf": token, "confirm": "yes"},
                           timeout=10).status_code == 400  # an abort needs a reason

    def test_hosts_show_what_their_device_slots_hold_and_their_evictions(
            self, world: World, base: str, client: requests.Session) -> None:
        now = time.time()
        for load in (AdapterLoad("h1", world.stable, now - 60, 0.2, "loaded", 3 << 20),
                     AdapterLoad("h1", world.target, now - 50, 0.2, "loaded", 1 << 20),
                     AdapterLoad("h1", world.target, now - 40, 0.0, "unloaded", None, "lru"),
                     AdapterLoad("h2", world.target, now - 30, 0.2, "loaded", 1 << 20)):
            world.ledger.record_load(load)
        page = client.get(f"{base}/hosts/live", timeout=10)
        assert page.status_code == 200
        rows = {m.group(1): m.group(2) for m in re.finditer(
            r"<tr><td>(h\d)</td>(.*?)</tr>", page.text, re.S)}
        resident = {h: re.search(r'class="resident">(.*?)</td>', r, re.S).group(1)  # type: ignore[union-attr]
                    for h, r in rows.items()}
        evicted = {h: re.search(r'class="evictions">(.*?)</td>', r, re.S).group(1)  # type: ignore[union-attr]
                   for h, r in rows.items()}
        # h1 holds the stable adapter only: the canary's load was followed by its eviction
        assert world.stable[:19] in resident["h1"] and world.target[:19] not in resident["h1"]
        assert "acme" in resident["h1"] and "3.0 MiB" in resident["h1"]
        assert world.target[:19] in evicted["h1"] and "lru" in evicted["h1"]
        assert world.target[:19] in resident["h2"] and evicted["h2"].strip() == "none"

    def test_hosts_show_their_reported_slots_tiers_load_queue_and_health(
            self, world: World, base: str, client: requests.Session) -> None:
        now = time.time()
        table = HostStatusTable(world.ledger.engine)
        table.put(HostStatus(  # reporting: healthy, with what its slots and host tier hold
            "h3", now, now - 600, 4,
            device=(SlotEntry(world.stable, 3 << 20, 2),
                    SlotEntry(world.target, 1 << 20, 1, revoked=True)),
            host_tier=(SlotEntry(world.target, 2 << 20, 1),), pending_loads=2, load_waiters=5,
            load_queue_max=64, running=3, waiting=7, kv_tokens_reserved=300,
            kv_tokens_budget=4096, host_bytes=2 << 20, host_budget=64 << 20,
            health={"violations": 1, "ledger_backlog": 0}))
        # silent for longer than three report periods: stale, shown with its last report
        table.put(HostStatus("h4", now - 60, now - 600, 2))
        world.ledger.record_load(AdapterLoad("h5", world.stable, now - 30, 0.2, "loaded",
                                             1 << 20))  # never reported its status
        page = client.get(f"{base}/hosts/live", timeout=10).text
        rows = {m.group(1): m.group(2) for m in re.finditer(
            r"<tr><td>(h\d)</td>(.*?)</tr>", page, re.S)}

        def cell(host: str, name: str) -> str:
            found = re.search(rf'class="{name}">(.*?)</td>', rows[host], re.S)
            assert found, (host, name)
            return re.sub(r"\s+", " ", found.group(1))

        assert 'class="state-healthy">healthy<' in cell("h3", "health")
        assert 'class="state-stale">violations=1<' in cell("h3", "health")
        assert "ledger_backlog" not in cell("h3", "health")  # zero: nothing to flag
        slots = cell("h3", "resident")
        assert "2 of 4 slots" in slots and "acme" in slots and "3.0 MiB · 2 active" in slots
        assert world.stable[:19] in slots and "revoked, draining" in slots
        tier = cell("h3", "host-tier")
        assert world.target[:19] in tier and "2.0 of 64.0 MiB" in tier
        loads = cell("h3", "loads")
        assert "load queue 2 of 64 (5 requests waiting)" in loads
        assert "running 3 · waiting 7" in loads and "KV 300 of 4096 positions" in loads
        stale = cell("h4", "health")
        assert f'class="state-stale">not reporting since {iso(now - 60)}<' in stale
        assert 'class="state-unknown">unknown<' in cell("h5", "health")
        assert world.stable[:19] in cell("h5", "resident")  # from its load records
        assert cell("h5", "loads") == "not reported"
        full = client.get(f"{base}/hosts", timeout=10).text
        assert 'class="state-stale">not reporting since' in full and "every 2 s" in full

    def test_finished_rollouts_offer_no_actions(self, world: World, base: str,
                                                client: requests.Session) -> None:
        self._rollout_with_a_window(world)
        live = client.get(f"{base}/rollouts/{ALIAS}/live", timeout=10).text
        assert 'id="pause"' in live and 'id="abort"' in live  # the buttons follow the status
        confirm = client.get(f"{base}/rollouts/{ALIAS}/confirm",
                             params={"action": "pause", "number": "1"}, timeout=10)
        token = csrf_of(confirm.text)
        resume = client.get(f"{base}/rollouts/{ALIAS}/confirm",
                            params={"action": "resume", "number": "1"}, timeout=10)
        assert resume.status_code == 409 and "cannot be resumed" in resume.text
        world.desk.abort(ALIAS, "enough", actor="alice")
        for path in (f"/rollouts/{ALIAS}", f"/rollouts/{ALIAS}/live"):
            page = client.get(f"{base}{path}", timeout=10).text
            assert 'id="rollout-status">rolled_back<' in page
            assert not re.search(r'id="(pause|resume|abort)"', page), path
        for action in ("pause", "resume", "abort"):
            r = client.get(f"{base}/rollouts/{ALIAS}/confirm",
                           params={"action": action, "number": "1"}, timeout=10)
            assert r.status_code == 409 and "is rolled back: it cannot be" in r.text
            assert 'name="confirm"' not in r.text
        # a confirmation page opened before the rollout ended: its POST is refused too
        done = client.post(f"{base}/rollouts/{ALIAS}/pause",
                           data={"csrf": token, "confirm": "yes", "number": "1"}, timeout=10)
        assert done.status_code == 409 and not world.events("RolloutPaused")

    def test_another_sessions_csrf_token_is_refused(self, world: World, base: str,
                                                    console: Console,
                                                    client: requests.Session) -> None:
        self._rollout_with_a_window(world)
        other = logged_in(base, console)
        theirs = csrf_of(other.get(f"{base}/rollouts/{ALIAS}/confirm?action=pause",
                                   timeout=10).text)
        r = client.post(f"{base}/rollouts/{ALIAS}/pause",
                        data={"csrf": theirs, "confirm": "yes"}, timeout=10)
        assert r.status_code == 403 and not world.events("RolloutPaused")


def test_console_token_verb_prints_and_rotates(tmp_path: Path) -> None:
    runner = CliRunner()
    home = tmp_path / "home"
    first = runner.invoke(cli, ["--json", "--home", str(home), "console", "token"])
    assert first.exit_code == 0, first.output
    data: dict[str, Any] = json.loads(first.output)
    assert data["token"].startswith("lpc_") and Path(data["path"]).is_file()
    again = json.loads(runner.invoke(cli, ["--json", "--home", str(home), "console",
                                           "token"]).output)
    assert again["token"] == data["token"]
    rotated = json.loads(runner.invoke(cli, ["--json", "--home", str(home), "console", "token",
                                             "--rotate"]).output)
    assert rotated["token"] != data["token"]
    assert stat.S_IMODE(os.stat(rotated["path"]).st_mode) == 0o600


def test_serve_runs_the_console_on_its_own_loopback_port(tmp_path: Path) -> None:
    """``serve --console-port``: the console in a thread of the serving process, on loopback;
    a port already taken is a clear error, not a console that silently never came up."""
    import socket

    from control.console.background import serve_in_thread
    from tests.fixtures_control import sqlite_settings

    settings = sqlite_settings(tmp_path / "home")
    settings.ensure_dirs()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve_in_thread(settings, port=port, actor="op")
    r = requests.get(f"http://127.0.0.1:{port}/login", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Security-Policy"] == CSP
    with pytest.raises(RuntimeError, match="could not listen"):
        serve_in_thread(settings, port=port, actor="op")


def test_console_verb_serves_on_loopback_until_interrupted(tmp_path: Path) -> None:
    """``loraplane console --port P`` as an operator runs it: a process on 127.0.0.1 that
    answers with the login page and stops on Ctrl-C (SIGINT)."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    from tests.fixtures_control import sqlite_settings

    home = tmp_path / "home"
    settings = sqlite_settings(home)
    settings.ensure_dirs()
    from projections.follower import open_registry

    open_registry(settings).create_tenant("acme", actor="op")  # a deployment to open
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "control.cli.main", "--home", str(home),
                             "console", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "LORAPLANE_DB_URL": ""})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/login", timeout=2)
                break
            except requests.ConnectionError:
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, "the console never listened"
                time.sleep(0.2)
        assert r.status_code == 200 and r.headers["Content-Security-Policy"] == CSP
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0].decode()
        assert "operator console on http://127.0.0.1:" in out and "console/token" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_removed_token_file_ends_sessions_instead_of_failing(tmp_path: Path) -> None:
    from control.console.access import Gatekeeper

    home = tmp_path / "home"
    gate = Gatekeeper(home)
    cookie = gate.new_session()
    assert gate.session(cookie) is not None
    token_path(home).unlink()
    assert gate.session(cookie) is None  # a new token was made: the old sessions end
    assert gate.is_token(load_or_create_token(home))
