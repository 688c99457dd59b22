"""What a tenant is told and shown (issue 21): a ticket answer names no arm of a canary split,
and the control plane's own requests (gate, probes) are in no tenant's stats, while the
operator's stats show them apart under their own tenant name."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.ledger import Ledger, LedgerEntry
from control.contracts.synthetic import GATE_TENANT, PROBE_TENANT
from control.contracts.tickets import TicketSigner
from control.gateway.observability import ADMIN_TOKEN_ENV
from control.gateway.server import make_app
from control.gateway.ticket_office import TicketOffice
from projections.routing import RoutingView
from tests.fixtures_control import Artifacts, OnSQLite, WithRegistry

EVAL = {"producer": "eval-team", "passed": True}
ADMIN = "operator-token-for-tests"

Call = tuple[int, Any]


class TestTenantView(OnSQLite, WithRegistry):
    @pytest.fixture
    def world(self, registry: Registry, artifacts: Artifacts) -> dict[str, str]:
        """acme's ``chat``: alpha stable, beta a 50 % canary."""
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        out = {"key": registry.create_tenant("acme", actor="op")}
        for name, to in (("alpha", "stable"), ("beta", "canary")):
            d = registry.register_adapter(artifacts.adapters[name], tenant="acme",
                                          alias="chat", actor="op")
            registry.advance(d, external=True, evaluation=EVAL, to=to, canary_percent=50,
                             actor="op")
            out[name] = d
            out[f"r_{name}"] = registry.adapter(d).release or ""
        registry.grant("acme", "chat", actor="op")
        return out

    @pytest.fixture
    def call(self, settings: Settings, registry: Registry, world: dict[str, str],
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
        monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
        engine = registry.follower.engine
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        app = make_app(TicketOffice(settings, RoutingView(engine), signer),
                       ledger=Ledger(engine))
        loop = asyncio.new_event_loop()
        client = TestClient(TestServer(app), loop=loop)
        loop.run_until_complete(client.start_server())

        def call(method: str, path: str, key: str, body: object = None) -> Call:
            async def go() -> Call:
                r = await client.request(method, path, json=body,
                                         headers={"Authorization": f"Bearer {key}"})
                return r.status, await r.json()

            return loop.run_until_complete(go())

        try:
            yield call
        finally:
            loop.run_until_complete(client.close())
            loop.close()

    def test_a_ticket_answer_names_no_arm(self, call: Any, world: dict[str, str]) -> None:
        """Told its arm, a client re-draws sessions until it lands where it wants."""
        seen = []
        for session in range(12):  # both arms of the 50 % split, in all likelihood
            status, body = call("POST", "/v1/tickets", world["key"],
                                {"alias": "chat", "session": f"s{session}"})
            assert status == 200
            assert set(body) == {"ticket", "ticket_id", "expires_at", "model", "alias",
                                 "affinity", "pool"}
            rest = json.dumps({k: v for k, v in body.items() if k != "ticket"})
            assert "sha256:" not in rest
            seen.append(rest)
        # nothing but the ticket's own id and expiry differs between arms
        assert len({json.dumps({k: v for k, v in json.loads(x).items()
                                if k not in ("ticket_id", "expires_at")}) for x in seen}) == 1

    def test_synthetic_requests_are_in_no_tenants_stats_and_apart_in_the_operators(
            self, call: Any, world: dict[str, str], registry: Registry) -> None:
        def row(rid: str, tenant: str, adapter: str) -> LedgerEntry:
            return LedgerEntry(request_id=rid, ticket_id="t", tenant=tenant, model="lora_llm",
                               host="h1", base_digest=None, adapter_digest=adapter,
                               tokenizer_digest=None, admitted_at=1.0, outcome="ok",
                               release_digest=world["r_beta"])

        Ledger(registry.follower.engine).admit([
            row("t-1", "acme", world["beta"]), row("g-1", GATE_TENANT, world["beta"]),
            row("g-2", GATE_TENANT, world["beta"]), row("p-1", PROBE_TENANT, world["beta"])])
        status, mine = call("GET", "/v1/stats", world["key"])
        assert status == 200 and mine["scope"] == "tenant"
        assert [(d["adapter_digest"], d["requests"]) for d in mine["digests"]] == [
            (world["beta"], 1)]
        status, everyone = call("GET", "/v1/stats", ADMIN)
        assert status == 200 and everyone["scope"] == "all"
        by_tenant = {d["tenant"]: d["requests"] for d in everyone["digests"]}
        assert by_tenant == {"acme": 1, GATE_TENANT: 2, PROBE_TENANT: 1}
