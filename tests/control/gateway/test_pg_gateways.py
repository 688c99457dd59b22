"""Two gateway processes and the projection follower process on one PostgreSQL.

Commands come from a third process (this test, with a registry that does not follow); only the
follower process updates the projections; both gateways see each change: a revoked adapter, a
rotated or revoked API key, a removed grant and a retired signing key, each within 1 s of the
command returning (a command that takes something away returns once the follower process has
made it visible).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from control.contracts.config import Settings
from control.contracts.tickets import TicketSigner
from control.gateway.server import FORBIDDEN
from control.ops.clients import request_ticket
from control.ops.triton_server import free_ports
from projections.follower import open_registry
from tests import REPO
from tests.fixtures_control import (
    Artifacts,
    close_registry,
    postgres_settings,
    ticket_claims,
)

pytestmark = pytest.mark.postgres

GATEWAY = textwrap.dedent("""
    import sys
    from pathlib import Path
    from aiohttp import web
    from control.contracts.config import Settings
    from control.contracts.db import make_engine
    from control.gateway.server import make_app
    from control.contracts.tickets import TicketSigner
    from control.gateway.ticket_office import TicketOffice
    from projections.route_cache import CachedRoutingView
    s = Settings(home=Path(sys.argv[1]), db_url=sys.argv[2])
    signer, _ = TicketSigner.load_or_create(s.keys_dir)
    office = TicketOffice(s, CachedRoutingView(make_engine(s.db_url)), signer)
    web.run_app(make_app(office), host="127.0.0.1", port=int(sys.argv[3]), print=None)
""")


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    with postgres_settings(tmp_path / "home") as s:
        s.ensure_dirs()
        yield s


def _wait(predicate: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def _in_force(predicate: Callable[[], bool], limit_s: float = 1.0) -> bool:
    """``predicate`` holds within ``limit_s`` seconds (what the product promises)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _kid(body: dict[str, object]) -> str:
    """The key id a ticket was signed with (its footer)."""
    footer = str(body["ticket"]).split(".")[3]
    return str(json.loads(base64.urlsafe_b64decode(footer + "=" * (-len(footer) % 4)))["kid"])


def test_two_gateways_and_follower_share_one_postgres(settings: Settings,
                                                      artifacts: Artifacts) -> None:
    root = REPO
    env = {**os.environ, "PYTHONPATH": str(root), "LORAPLANE_HOME": str(settings.home),
           "LORAPLANE_DB_URL": settings.db_url}
    reg = open_registry(settings, follow=False)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        reg.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                          alias="tiny-base")
        # The key both gateways start with (they share this home's keys folder), recorded.
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        first_kid = signer.kid
        reg.record_signing_key(first_kid, signer.public_b64, actor="op")
        key = reg.create_tenant("acme", actor="op")
        d = reg.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                 actor="op")
        reg.advance(d, external=True, evaluation={"suite": "smoke", "passed": True}, actor="op")
        reg.grant("acme", "chat", actor="op")
        reg.grant("acme", "tiny-base", actor="op")
        procs.append(subprocess.Popen([sys.executable, "-m", "projections.follower"], env=env,
                                      cwd=root, stderr=subprocess.DEVNULL))
        ports = free_ports(2)
        for port in ports:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", GATEWAY, str(settings.home), settings.db_url,
                 str(port)], env=env, cwd=root, stderr=subprocess.DEVNULL))
        urls = [f"http://127.0.0.1:{p}" for p in ports]

        def ticket(url: str) -> tuple[int, dict[str, object]]:
            try:
                return request_ticket(url, key, "chat")
            except OSError:
                return 0, {}

        assert _wait(lambda: all(ticket(u)[0] == 200 for u in urls), 60)
        assert {ticket_claims(str(ticket(u)[1]["ticket"]),
                                  settings.keys_dir)["adapter"] for u in urls} == {d}
        assert {_kid(ticket(u)[1]) for u in urls} == {first_kid}

        # A retired signing key: both gateways move to the key rotated in (same keys folder).
        new_kid, previous = reg.rotate_signing_key(actor="op")
        assert previous == first_kid
        reg.retire_signing_key(first_kid, actor="op", reason="rotated")
        assert _in_force(lambda: {_kid(ticket(u)[1]) for u in urls} == {new_kid})

        # A rotated API key: the old one is refused by both, the new one served by both.
        old_key, key = key, reg.rotate_api_key("acme", actor="op")
        assert _in_force(lambda: all(request_ticket(u, old_key, "chat")[0] == 401
                                     for u in urls))
        assert all(ticket(u)[0] == 200 for u in urls)

        # Revoked API keys: the tenant has no working key at either gateway.
        reg.revoke_api_keys("acme", actor="sec")
        assert _in_force(lambda: all(ticket(u)[0] == 401 for u in urls))
        key = reg.rotate_api_key("acme", actor="op")

        # A removed grant: the generic 403 at both, while the other grant still serves.
        reg.remove_grant("acme", "chat", actor="op")
        assert _in_force(lambda: all(ticket(u) == (403, FORBIDDEN) for u in urls))
        assert all(request_ticket(u, key, "tiny-base")[0] == 200 for u in urls)
        reg.grant("acme", "chat", actor="op")
        assert _wait(lambda: all(ticket(u)[0] == 200 for u in urls), 30)

        reg.revoke(d, "leak", actor="sec")  # recorded here, projected by the follower process
        assert _in_force(lambda: all(ticket(u)[0] == 403 for u in urls))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        close_registry(reg)
