"""``POST /v1/feedback`` on the gateway, on SQLite and PostgreSQL: a tenant rates only its own
requests, once; another tenant's request id and an unknown one get the same 404, byte for byte;
a request served under a release the caller does not own (an alias another tenant granted it)
gets 403 and no rating; the control plane's own requests are no tenant's to rate."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.ledger import Ledger, LedgerEntry
from control.contracts.synthetic import GATE_TENANT
from control.contracts.tickets import TicketSigner
from control.gateway.server import NO_SUCH_REQUEST, NOT_THE_OWNER, make_app
from control.gateway.ticket_office import TicketOffice
from projections.routing import RoutingView
from tests.fixtures_control import Artifacts, OnPostgres, OnSQLite, WithRegistry

EVAL = {"producer": "eval-team", "passed": True}


def _row(rid: str, tenant: str | None, release: str | None) -> LedgerEntry:
    return LedgerEntry(request_id=rid, ticket_id="t", tenant=tenant, model="lora_llm",
                       host="h1", base_digest=None, adapter_digest=None, tokenizer_digest=None,
                       admitted_at=1.0, outcome="ok", release_digest=release)


Exchange = tuple[int, dict[str, Any], bytes]


class FeedbackRouteContract(WithRegistry):
    @pytest.fixture
    def keys(self, registry: Registry) -> dict[str, str]:
        return {t: registry.create_tenant(t, actor="op") for t in ("acme", "globex")}

    @pytest.fixture
    def releases(self, registry: Registry, artifacts: Artifacts, keys: dict[str, str]
                 ) -> dict[str, str]:
        """acme's ``chat`` (granted to globex too), globex's ``g-chat``, a base alias."""
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                               alias="tiny-base")
        out = {}
        for tenant, alias, name in (("acme", "chat", "alpha"), ("globex", "g-chat", "gamma")):
            d = registry.register_adapter(artifacts.adapters[name], tenant=tenant, alias=alias,
                                          actor="op")
            registry.advance(d, external=True, evaluation=EVAL, actor="op")
            out[alias] = registry.adapter(d).release or ""
        registry.grant("globex", "chat", actor="op")
        out["tiny-base"] = registry.alias("tiny-base").stable or ""
        return out

    @pytest.fixture
    def post(self, settings: Settings, registry: Registry, keys: dict[str, str],
             releases: dict[str, str]) -> Iterator[Any]:
        engine = registry.follower.engine
        ledger = Ledger(engine)
        ledger.admit([_row("0b9c-acme", "acme", releases["chat"]),
                      _row("0b9c-globex", "globex", releases["g-chat"]),
                      _row("0b9c-granted", "globex", releases["chat"]),
                      _row("0b9c-base", "acme", releases["tiny-base"]),
                      _row("0b9c-gate", GATE_TENANT, releases["chat"]),
                      _row("0b9c-none", None, None)])
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        app = make_app(TicketOffice(settings, RoutingView(engine), signer), ledger=ledger)

        # One event loop for the fixture's life: an aiohttp app belongs to the loop it ran in.
        loop = asyncio.new_event_loop()
        client = TestClient(TestServer(app), loop=loop)
        loop.run_until_complete(client.start_server())

        def post(body: object, key: str | None, raw: bytes | None = None) -> Exchange:
            async def go() -> Exchange:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
                r = await client.post("/v1/feedback", headers=headers, **kwargs)
                text = await r.read()
                try:
                    data = await r.json()
                except ValueError:
                    data = {}
                return r.status, data, text

            return loop.run_until_complete(go())

        try:
            yield post
        finally:
            loop.run_until_complete(client.close())
            loop.close()

    def test_a_tenant_rates_its_own_request(self, post: Any, keys: dict[str, str],
                                            registry: Registry) -> None:
        status, body, _ = post({"request_id": "0b9c-acme", "success": False}, keys["acme"])
        assert status == 201 and body["request_id"] == "0b9c-acme" and body["success"] is False
        rating = Ledger(registry.follower.engine).rating("0b9c-acme")
        assert rating is not None and (rating.tenant, rating.success) == ("acme", False)

    def test_a_second_rating_is_refused_and_the_first_stays(self, post: Any,
                                                            keys: dict[str, str],
                                                            registry: Registry) -> None:
        assert post({"request_id": "0b9c-acme", "success": True}, keys["acme"])[0] == 201
        status, body, _ = post({"request_id": "0b9c-acme", "success": False}, keys["acme"])
        assert status == 409 and "never replaced" in body["error"]
        rating = Ledger(registry.follower.engine).rating("0b9c-acme")
        assert rating is not None and rating.success is True

    def test_another_tenants_request_looks_exactly_like_an_unknown_one(
            self, post: Any, keys: dict[str, str], registry: Registry) -> None:
        theirs = post({"request_id": "0b9c-globex", "success": False}, keys["acme"])
        unknown = post({"request_id": "0b9c-nobody", "success": False}, keys["acme"])
        unowned = post({"request_id": "0b9c-none", "success": False}, keys["acme"])
        assert theirs[0] == unknown[0] == unowned[0] == 404
        assert theirs[2] == unknown[2] == unowned[2]  # the same bytes: nothing to tell apart
        assert theirs[1] == NO_SUCH_REQUEST and "globex" not in theirs[2].decode()
        assert Ledger(registry.follower.engine).rating("0b9c-globex") is None
        # globex itself may still rate it
        assert post({"request_id": "0b9c-globex", "success": True}, keys["globex"])[0] == 201

    def test_only_the_owner_of_the_serving_release_rates_it(
            self, post: Any, keys: dict[str, str], registry: Registry,
            releases: dict[str, str]) -> None:
        """Issue 21: globex, granted acme's alias, decided acme's rollout with its ratings."""
        ledger = Ledger(registry.follower.engine)
        for rid in ("0b9c-granted", "0b9c-base"):
            status, body, _ = post({"request_id": rid, "success": False}, keys["globex"]
                                   if rid == "0b9c-granted" else keys["acme"])
            assert status == 403 and body == NOT_THE_OWNER, rid
            assert ledger.rating(rid) is None
        # its own alias's requests, globex rates; each rating names the release it rates
        assert post({"request_id": "0b9c-globex", "success": True}, keys["globex"])[0] == 201
        rating = ledger.rating("0b9c-globex")
        assert rating is not None and rating.release_digest == releases["g-chat"]

    def test_the_control_planes_own_requests_are_no_tenants_to_rate(
            self, post: Any, keys: dict[str, str]) -> None:
        for key in keys.values():
            status, body, _ = post({"request_id": "0b9c-gate", "success": True}, key)
            assert status == 404 and body == NO_SUCH_REQUEST

    def test_callers_and_bodies_are_checked(self, post: Any, keys: dict[str, str]) -> None:
        ok = {"request_id": "0b9c-acme", "success": True}
        assert post(ok, None)[0] == 401
        assert post(ok, "lp_not-a-key")[0] == 401
        for bad in ({"request_id": "0b9c-acme"}, {"request_id": "0b9c-acme", "success": 1},
                    {"request_id": "x" * 37, "success": True},
                    {"request_id": "../etc", "success": True}, ["0b9c-acme", True]):
            assert post(bad, keys["acme"])[0] == 400, bad
        assert post(None, keys["acme"], raw=b"{not json")[0] == 400


class TestFeedbackRouteSQLite(OnSQLite, FeedbackRouteContract):
    pass


class TestFeedbackRoutePostgres(OnPostgres, FeedbackRouteContract):
    pass
