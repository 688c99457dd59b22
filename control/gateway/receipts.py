"""``GET /v1/receipts/{request_id}``: a tenant fetches the receipt of one of its own requests.

The receipt is the c2sp.org/tlog-proof that ``loraplane receipt get`` writes: the request's
ledger entry, its position in its host's Merkle log, the inclusion proof and the checkpoint the
control plane verified (``control.contracts.receipt.verify_receipt`` checks it offline, with
nothing but the trusted keys). The gateway may not read the event store, so it reads the
control plane's read model of verified checkpoints (``ledger_verified``) beside the log.

Answers, with the caller's API key (``Authorization: Bearer``) as every tenant route:

- 200, ``text/plain``: the receipt.
- 401: no key, or an unknown one.
- 403, one fixed body: the request is the caller's, but was served by an adapter another tenant
  owns (an alias that tenant granted the caller). A receipt's entry names the adapter that
  served, which is the owner's to know (issue 21: a granted tenant learns neither the owner's
  adapter nor which arm of its rollout answered); its owner can fetch nothing of the caller's
  either, since receipts go to the requesting tenant only.
- 404, one fixed body: the id is unknown or another tenant's (the two read the same, so a
  tenant cannot probe other tenants' request ids); also a request of the caller's that never
  entered a host's log (refused before its engine saw it), which will never have a receipt.
  A request whose ledger row was archived (``loraplane audit archive``) is answered from its log
  entry once a verified checkpoint covers it, as if the row were still there.
- 409 with ``Retry-After``: the request is the caller's but not yet covered by a verified
  checkpoint (still running, or past its host's last verified checkpoint): retry after the next
  one (hosts sign every few seconds, the control plane verifies every ``VERIFY_S``).
- 503: the database cannot be read, or the host's log no longer gives its verified checkpoint
  (an operator's matter: ``audit verify --ledger`` locates the change).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from aiohttp import web
from sqlalchemy.engine import Connection, Engine

from control.contracts.ledger import Outcome, request_ledger
from control.contracts.ledger_log import first_verified, ledger_log, parse_leaf, position, prove
from control.gateway.ticket_office import TicketOffice
from projections.tables import adapters

log = logging.getLogger("loraplane.gateway.receipts")

UNAUTHORISED = {"error": "unauthorised: missing or unknown API key"}
NO_SUCH_REQUEST = {"error": "not found: no request with that id for your tenant"}
NEVER_LOGGED = {"error": "no receipt exists for this request: it was recorded before any "
                         "engine ran it, outside a host's log"}
NOT_YET = {"error": "not yet covered: this request is not yet covered by a verified "
                    "checkpoint of its host's log; retry after the next checkpoint"}
BROKEN = {"error": "receipt unavailable: the ledger log no longer matches its verified "
                   "checkpoint; the operator has been alerted"}
UNAVAILABLE = {"error": "the request ledger cannot be read right now; retry shortly"}
NOT_THE_OWNER = {"error": "receipts of requests served by another tenant's adapter (an alias "
                          "it granted you) are its owner's: a receipt names the adapter"}
RETRY_AFTER_S = 15  # about one control-plane verification interval (ledger_audit.VERIFY_S)
REQUEST_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")

ENGINE_KEY = web.AppKey("receipts_engine", Engine)
OFFICE_KEY = web.AppKey("receipts_office", TicketOffice)


@dataclass(frozen=True)
class Found:
    status: int
    body: dict[str, str] | None = None
    receipt: str | None = None


def find_receipt(engine: Engine, tenant: str, request_id: str) -> Found:
    """What ``tenant`` gets for ``request_id`` (module notes); blocking: run off the loop."""
    with engine.connect() as conn:
        row: Any = conn.execute(sa.select(request_ledger.c.tenant, request_ledger.c.outcome,
                                          request_ledger.c.adapter_digest).where(
            request_ledger.c.request_id == request_id)).first()
        if row is None:
            row = _archived(conn, request_id)
        if row is None or row.tenant != tenant:
            return Found(404, NO_SUCH_REQUEST)
        if row.adapter_digest is not None and conn.execute(
                sa.select(adapters.c.tenant).where(adapters.c.digest == row.adapter_digest)
        ).scalar() != tenant:
            return Found(403, NOT_THE_OWNER)
        at = position(conn, request_id)
        if at is None:
            if row.outcome == Outcome.RUNNING.value:
                return Found(409, NOT_YET)
            return Found(404, NEVER_LOGGED)
        host, index = at
        cover = first_verified(conn, host, index)
        if cover is None:
            return Found(409, NOT_YET)
        size, root_b64, note = cover
        text = prove(conn, host, index, size, root_b64, note)
    if text is None:
        log.error("host %s's ledger log no longer gives its verified checkpoint at size %d: "
                  "run `loraplane audit verify --ledger`", host, size)
        return Found(503, BROKEN)
    return Found(200, receipt=text)


@dataclass(frozen=True)
class _LoggedRow:
    tenant: str
    outcome: str
    adapter_digest: str | None


def _archived(conn: Connection, request_id: str) -> _LoggedRow | None:
    """The row of a request whose ledger row was archived (``loraplane audit archive``), as
    its log entry holds it, once a verified checkpoint covers that entry; else None. The entry
    is the row the host logged, bound by the checkpoint's root, so it answers who the request
    was for as the row did."""
    r = conn.execute(sa.select(ledger_log.c.host, ledger_log.c.idx, ledger_log.c.leaf).where(
        ledger_log.c.request_id == request_id).order_by(ledger_log.c.idx).limit(1)).first()
    if r is None or first_verified(conn, r.host, int(r.idx)) is None:
        return None
    doc = parse_leaf(r.leaf)
    return _LoggedRow(str(doc["tenant"]), str(doc["outcome"]), doc.get("adapter_digest"))


async def get_receipt(request: web.Request) -> web.Response:
    office = request.app[OFFICE_KEY]
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    tenant = (office.routing.tenant_for_api_key(key.strip())
              if scheme.lower() == "bearer" and key.strip() else None)
    if tenant is None:
        return web.json_response(UNAUTHORISED, status=401)
    request_id = request.match_info["request_id"]
    if not 0 < len(request_id) <= 36 or not set(request_id) <= REQUEST_ID_CHARS:
        return web.json_response({"error": "the request id must be the one an answer carried"},
                                 status=400)
    try:
        found = await asyncio.to_thread(find_receipt, request.app[ENGINE_KEY], tenant,
                                        request_id)
    except sa.exc.SQLAlchemyError:
        log.warning("reading a receipt failed", exc_info=True)
        return web.json_response(UNAVAILABLE, status=503, headers={"Retry-After": "5"})
    if found.receipt is not None:
        return web.Response(text=found.receipt, content_type="text/plain", charset="utf-8")
    headers = {"Retry-After": str(RETRY_AFTER_S)} if found.status == 409 else None
    return web.json_response(found.body, status=found.status, headers=headers)


def add_routes(app: web.Application, office: TicketOffice, engine: Engine) -> None:
    """Serve receipts from ``engine`` (the gateway's own credential) to ``office``'s tenants."""
    app[OFFICE_KEY] = office
    app[ENGINE_KEY] = engine
    app.router.add_get("/v1/receipts/{request_id}", get_receipt)
