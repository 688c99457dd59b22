"""``GET /v1/receipts/{request_id}`` on the real aiohttp gateway, on SQLite and PostgreSQL: a
tenant fetches the receipt of its own request once a verified checkpoint covers it, and the
receipt verifies offline with only the recorded host key; before that it gets 409 with
Retry-After; another tenant's id and an unknown one get the same 404, byte for byte."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from backend.serving.recorder import LedgerWriter
from control.app.ledger_audit import load, sync
from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.ledger import Completion, Ledger, LedgerEntry, Outcome
from control.contracts.receipt import trusted_keys, verify_receipt
from control.contracts.tickets import TicketSigner
from control.contracts.tlog import ProofError
from control.gateway.receipts import NO_SUCH_REQUEST, NOT_THE_OWNER
from control.gateway.server import make_app
from control.gateway.ticket_office import TicketOffice
from projections.routing import RoutingView
from tests.fixtures_control import OnPostgres, OnSQLite, WithRegistry

D = "sha256:" + "a" * 64
HOST = "gw-host"
# each tenant's own adapter (the adapters projection says who owns it)
OWN = {"acme": "sha256:" + "c" * 64, "globex": "sha256:" + "d" * 64}


def _entry(rid: str, tenant: str, adapter: str | None = None, **kw: Any) -> LedgerEntry:
    return LedgerEntry(rid, f"ticket-{rid}", tenant, "lora_llm", HOST, D,
                       adapter or OWN[tenant], D, admitted_at=1.0, max_tokens=8,
                       temperature=0.0, top_p=1.0, **kw)


def _own(engine: Any) -> None:
    import datetime as dt

    from projections.tables import adapters

    with engine.begin() as conn:
        for tenant, digest in OWN.items():
            conn.execute(adapters.insert().values(
                digest=digest, tenant=tenant, alias=f"{tenant}-x", base_digest=D,
                tokenizer_digest=D, state="stable", rank=8, registered_at=dt.datetime.now(dt.UTC),
                owner="", training_data_version="", licence="", allowed_tasks=""))


def _answer(ledger: Ledger, requests: list[tuple[str, str]], adapter: str | None = None) -> None:
    """Admit and complete (rid, tenant) requests through a host's writer with its log, served
    by each tenant's own adapter or ``adapter``; the writer's close signs a checkpoint."""
    writer = LedgerWriter(ledger, host=HOST, checkpoint_s=3600)
    done = threading.Semaphore(0)
    for rid, tenant in requests:
        entry = _entry(rid, tenant, adapter)
        ledger.admit([entry])
        writer.complete(Completion(rid, Outcome.OK, 3, 5, served_digest=entry.adapter_digest),
                        lambda _ok: done.release(), output=f"the answer to {rid}")
    for _ in requests:
        assert done.acquire(timeout=30)
    writer.close()


Get = Any  # (request id, api key or None) -> (status, headers, body bytes)


class ReceiptRouteContract(WithRegistry):
    @pytest.fixture
    def keys(self, registry: Registry) -> dict[str, str]:
        return {t: registry.create_tenant(t, actor="op") for t in ("acme", "globex")}

    @pytest.fixture
    def get(self, settings: Settings, registry: Registry, keys: dict[str, str]) -> Iterator[Get]:
        engine = registry.follower.engine
        _own(engine)
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        app = make_app(TicketOffice(settings, RoutingView(engine), signer),
                       ledger=Ledger(engine))
        loop = asyncio.new_event_loop()  # an aiohttp app belongs to the loop it ran in
        client = TestClient(TestServer(app), loop=loop)
        loop.run_until_complete(client.start_server())

        def get(rid: str, key: str | None) -> tuple[int, dict[str, str], bytes]:
            async def go() -> tuple[int, dict[str, str], bytes]:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = await client.get(f"/v1/receipts/{rid}", headers=headers)
                return r.status, dict(r.headers), await r.read()

            return loop.run_until_complete(go())

        try:
            yield get
        finally:
            loop.run_until_complete(client.close())
            loop.close()

    def test_a_tenant_fetches_its_receipt_and_verifies_it_offline(
            self, get: Get, keys: dict[str, str], registry: Registry) -> None:
        engine = registry.follower.engine
        ledger = Ledger(engine)
        _answer(ledger, [("rq-acme-1", "acme"), ("rq-globex-1", "globex"),
                         ("rq-acme-2", "acme")])
        # Signed by the host, not yet verified by the control plane: not covered.
        status, headers, body = get("rq-acme-2", keys["acme"])
        assert status == 409 and b"not yet covered" in body and "Retry-After" in headers
        sync(registry, engine)
        status, headers, body = get("rq-acme-2", keys["acme"])
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        agg = load(registry, HOST)
        assert agg is not None
        trusted = trusted_keys("\n".join(agg.vkeys))
        checked = verify_receipt(body.decode(), b"the answer to rq-acme-2", trusted)
        assert (checked.entry["request_id"], checked.entry["tenant"], checked.index,
                checked.tree_size) == ("rq-acme-2", "acme", 2, 3)
        with pytest.raises(ProofError) as e:  # and it binds the exact text
            verify_receipt(body.decode(), b"another answer", trusted)
        assert e.value.check == "output"

    def test_another_tenants_id_and_an_unknown_one_read_the_same(
            self, get: Get, keys: dict[str, str], registry: Registry) -> None:
        engine = registry.follower.engine
        _answer(Ledger(engine), [("rq-globex-1", "globex")])
        sync(registry, engine)
        assert get("rq-globex-1", keys["globex"])[0] == 200
        theirs, unknown = get("rq-globex-1", keys["acme"]), get("rq-nobody", keys["acme"])
        assert theirs[0] == unknown[0] == 404
        assert theirs[2] == unknown[2] and b"globex" not in theirs[2]
        assert theirs[2].decode().count(NO_SUCH_REQUEST["error"]) == 1
        assert get("rq-globex-1", None)[0] == 401
        assert get("rq-globex-1", "not-a-key")[0] == 401
        assert get("rq/../x", keys["acme"])[0] in (400, 404)
        assert get("x" * 37, keys["acme"])[0] == 400

    def test_a_granted_tenant_gets_no_receipt_naming_the_owners_adapter(
            self, get: Get, keys: dict[str, str], registry: Registry) -> None:
        """Issue 21: globex's request answered by acme's adapter (an alias acme granted it)
        has a receipt whose entry names acme's adapter: globex is refused, with a body that
        names neither the adapter nor acme; its requests on its own adapter are served."""
        engine = registry.follower.engine
        _answer(Ledger(engine), [("rq-granted", "globex")], adapter=OWN["acme"])
        _answer(Ledger(engine), [("rq-own", "globex")])
        sync(registry, engine)
        status, _, body = get("rq-granted", keys["globex"])
        assert status == 403 and body.decode().count(NOT_THE_OWNER["error"]) == 1
        assert OWN["acme"].encode() not in body and OWN["acme"][7:].encode() not in body
        assert b"acme" not in body
        assert get("rq-own", keys["globex"])[0] == 200

    def test_running_unlogged_and_past_the_checkpoint_requests(
            self, get: Get, keys: dict[str, str], registry: Registry) -> None:
        engine = registry.follower.engine
        ledger = Ledger(engine)
        _answer(ledger, [("rq-acme-1", "acme")])
        sync(registry, engine)
        _answer(ledger, [("rq-acme-2", "acme")])  # checkpointed by the host, not verified
        ledger.admit([_entry("rq-running", "acme")])
        ledger.admit([_entry("rq-refused", "acme", outcome=Outcome.REJECTED,
                             reason="engine_unavailable", finished_at=2.0)])
        for rid in ("rq-acme-2", "rq-running"):
            status, headers, body = get(rid, keys["acme"])
            assert (status, headers.get("Retry-After")) == (409, "15"), rid
        status, _, body = get("rq-refused", keys["acme"])
        assert status == 404 and b"outside a host's log" in body
        assert get("rq-acme-1", keys["acme"])[0] == 200
        sync(registry, engine)  # the next verified checkpoint covers it
        assert get("rq-acme-2", keys["acme"])[0] == 200

    def test_an_archived_request_keeps_its_receipt(
            self, get: Get, keys: dict[str, str], registry: Registry, tmp_path: Any) -> None:
        """A row archived by ``audit archive`` is gone from the ledger; its log entry stays,
        so its tenant still gets the receipt, and another tenant still gets the same 404."""
        from control.app.ledger_archive import archive

        engine = registry.follower.engine
        _answer(Ledger(engine), [("rq-old", "acme")])
        sync(registry, engine)
        before = get("rq-old", keys["acme"])
        archive(registry, engine, 2.0, tmp_path / "archive.jsonl", actor="op")
        assert Ledger(engine).get("rq-old") is None
        after = get("rq-old", keys["acme"])
        assert after[0] == before[0] == 200 and after[2] == before[2]
        assert get("rq-old", keys["globex"])[2] == get("rq-nobody", keys["globex"])[2]


class TestReceiptRouteSQLite(OnSQLite, ReceiptRouteContract):
    pass


class TestReceiptRoutePostgres(OnPostgres, ReceiptRouteContract):
    pass
