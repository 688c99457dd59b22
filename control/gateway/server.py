"""The tenant-facing gateway (aiohttp): API key in, signed routing ticket out.

``POST /v1/tickets`` with ``Authorization: Bearer <api key>`` and ``{"alias": "..."}``.
401 when the key is missing or unknown; 403, with one fixed body, when the alias is unknown, not
granted to the caller, not servable or revoked: the caller cannot tell which, so the gateway never
confirms that another tenant's alias exists. 503 while the routing tables cannot be read, or
while no unretired signing key is held (the gateway never signs with a retired key).

The answer holds the ticket, its id, expiry, model and alias: nothing that says which arm of a
canary split the ticket landed on (no release, no adapter digest). A client that is told its arm
can re-draw sessions until it lands on the one it wants (two tries at 50 %), and weigh its own
feedback by arm. The ticket carries the arm sealed (``control.contracts.tickets``), and the
host's answer names the adapter that served to the release's owner only. What was served to whom
stays server-side: the ledger names the release and the adapter of every request.

An optional ``"session"`` in the body names the client's session: the session keeps the
release it first resolved (``control.domain.session``) until it ends or its pin expires
(``LORAPLANE_SESSION_TTL_S``). ``DELETE /v1/sessions/{session}?alias=ALIAS`` ends one of the
caller's own sessions; it answers 204 whether or not such a session existed, so it tells
nothing about sessions, aliases or tenants.

``POST /v1/feedback`` with ``{"request_id": "...", "success": true|false}`` records the calling
tenant's rating of one of its own requests (the ``request_id`` its answer carried), which the
rollout controller weighs a canary by. A request id that is unknown or another tenant's gets the
same 404 with one fixed message, so ids of other tenants' requests cannot be probed. Only the
owner of the release that served the request rates it: a tenant's request on an alias it was
granted by another tenant (or on the base alone) gets 403, because the owner's rollout must not
be decided by whoever it grants (``control.contracts.ledger``). One rating per request: a second
is refused with 409 and the first stays (a window's recorded figures must match the table an
auditor reads later). A rating of a request that did not end ``ok`` is recorded as given and
counts as a failure, never a success.

``GET /v1/receipts/{request_id}`` answers the receipt of one of the caller's own requests
(:mod:`control.gateway.receipts`): 404 alike for unknown and other tenants' ids, 409 with
``Retry-After`` until a verified checkpoint covers it.

Bodies (tickets and feedback) are read whole, at most 4096 bytes, and parsed strictly
(:mod:`control.gateway.bodies`): 413 above the limit, whether or not Content-Length is sent;
400 for anything but one JSON object (a key given twice included); 408 for a body that does
not arrive within 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from control.contracts import telemetry
from control.contracts.db import make_engine
from control.contracts.ledger import AlreadyRated, Ledger, NotRatable, NotTheOwner
from control.domain import SESSION_RE, DomainError
from control.gateway import observability, openai_api, receipts
from control.gateway.bodies import (
    OPENAI_BODY_LIMIT,
    TICKET_BODY_LIMIT,
    BodyError,
    read_json_object,
)
from control.gateway.observability import GatewayMetrics
from control.gateway.ticket_office import NotGranted, SigningUnavailable, TicketOffice
from projections.route_cache import RoutingUnavailable

log = logging.getLogger("loraplane.gateway")

ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
UNAUTHORISED = {"error": "unauthorised: missing or unknown API key"}
FORBIDDEN = {"error": "forbidden: this alias is not available to your tenant"}
UNAVAILABLE = {"error": "routing temporarily unavailable; retry shortly"}
NO_SIGNING_KEY = {"error": "ticket signing unavailable: no active signing key; retry later"}
NO_SUCH_REQUEST = {"error": "not found: no request with that id for your tenant"}
ALREADY_RATED = {"error": "this request already has feedback; a rating is never replaced"}
NOT_THE_OWNER = {"error": "feedback on this request is its release owner's: your tenant uses "
                          "an alias another tenant owns (or the base model alone)"}
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9-]{1,36}$")  # the ledger's request ids (uuid4)
OFFICE_KEY = web.AppKey("office", TicketOffice)
LEDGER_KEY = web.AppKey("ledger", Ledger)


def _json(status: int, body: Mapping[str, object]) -> web.Response:
    return web.json_response(body, status=status)


async def _body(request: web.Request, shape: str) -> dict[str, Any]:
    """The body of a ticket or feedback request as a JSON object, read whole within
    ``TICKET_BODY_LIMIT`` (:mod:`control.gateway.bodies`); BodyError (413 too large, 400 not an
    object, 408 too slow) telling the caller the shape expected."""
    try:
        return await read_json_object(request, TICKET_BODY_LIMIT)
    except BodyError as e:
        if e.status == 400:
            raise BodyError(400, f"{e.message}; expected {shape}") from None
        raise


async def issue_ticket(request: web.Request) -> web.Response:
    office = request.app[OFFICE_KEY]
    auth = request.headers.get("Authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return _json(401, UNAUTHORISED)
    tenant = office.routing.tenant_for_api_key(key.strip())
    if tenant is None:
        return _json(401, UNAUTHORISED)
    try:
        body = await _body(request, '{"alias": "...", "session": "..." (optional)}')
    except BodyError as e:
        return _json(e.status, {"error": e.message})
    alias = body.get("alias")
    if not isinstance(alias, str) or not ALIAS_RE.match(alias):
        return _json(400, {"error": "field 'alias' must be an alias name"})
    session = body.get("session")
    if session is not None and not (isinstance(session, str) and SESSION_RE.match(session)):
        return _json(400, {"error": "field 'session' must be 1-128 printable ASCII characters"})
    try:
        if session is not None and office.pins is not None:
            # A new or moved pin is an event-store write: off the event loop.
            issued = await asyncio.to_thread(office.issue, tenant, alias, session)
        else:
            issued = office.issue(tenant, alias, session)
    except NotGranted:
        log.info("ticket refused", extra={"tenant": tenant})
        return _json(403, FORBIDDEN)
    c = issued.claims
    # No release and no adapter digest: the arm stays server-side (see the module notes).
    # ``affinity`` and ``pool``: what a balancer places by, the ticket's signed affinity claim
    # (a hash of the alias, and of the tenant unless the owner bounds replicas; equal on every
    # arm), and the pool the ticket may run in (control.contracts.placement); hosts check the
    # pool themselves, so neither is more than a placement hint.
    return _json(200, {"ticket": issued.token, "ticket_id": c.jti, "expires_at": c.exp,
                       "model": c.model, "alias": alias,
                       "affinity": c.affinity, "pool": c.pool})


async def end_session(request: web.Request) -> web.Response:
    """``DELETE /v1/sessions/{session}?alias=ALIAS``: end one of the caller's sessions.

    204 whether a pin was ended or there was none: the answer says nothing about sessions of
    other tenants, or whether the alias exists."""
    office = request.app[OFFICE_KEY]
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    tenant = (office.routing.tenant_for_api_key(key.strip())
              if scheme.lower() == "bearer" and key.strip() else None)
    if tenant is None:
        return _json(401, UNAUTHORISED)
    alias = request.query.get("alias")
    if alias is None or not ALIAS_RE.match(alias):
        return _json(400, {"error": "query parameter 'alias' must be an alias name"})
    session = request.match_info["session"]
    if not SESSION_RE.match(session):
        return _json(400, {"error": "the session id must be 1-128 printable ASCII characters"})
    if office.pins is None:
        return _json(404, {"error": "this gateway does not keep sessions"})
    # A name no pin can have (an alias the registry would refuse) has nothing to end.
    with contextlib.suppress(DomainError):
        await asyncio.to_thread(office.end_session, tenant, alias, session)
    return web.Response(status=204)


async def rate_request(request: web.Request) -> web.Response:
    """``POST /v1/feedback``: the caller rates one of its own requests (see the module notes).

    201 with the rating; 401 without a known API key; 400 for a malformed body; 404 for an id
    that is unknown or not the caller's (one answer); 409 when it was rated already."""
    office = request.app[OFFICE_KEY]
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    tenant = (office.routing.tenant_for_api_key(key.strip())
              if scheme.lower() == "bearer" and key.strip() else None)
    if tenant is None:
        return _json(401, UNAUTHORISED)
    try:
        body = await _body(request, '{"request_id": "...", "success": true}')
    except BodyError as e:
        return _json(e.status, {"error": e.message})
    request_id, success = body.get("request_id"), body.get("success")
    if not isinstance(request_id, str) or not REQUEST_ID_RE.match(request_id):
        return _json(400, {"error": "field 'request_id' must be the request id an answer carried"})
    if not isinstance(success, bool):
        return _json(400, {"error": "field 'success' must be true or false"})
    try:
        # A database write: off the event loop.
        rating = await asyncio.to_thread(request.app[LEDGER_KEY].rate, request_id, tenant,
                                         success, owner_of=_release_owner(office))
    except NotRatable:
        return _json(404, NO_SUCH_REQUEST)
    except NotTheOwner:
        return _json(403, NOT_THE_OWNER)
    except AlreadyRated:
        return _json(409, ALREADY_RATED)
    return _json(201, {"request_id": rating.request_id, "success": rating.success,
                       "rated_at": rating.rated_at})


def _release_owner(office: TicketOffice) -> Callable[[str], str | None]:
    """Release digest -> the tenant that owns it (None: a base-only or unknown release), read
    from the routing projection the office resolves tickets on."""
    def owner(release: str) -> str | None:
        row = office.routing.release(release)
        return None if row is None else row.get("tenant")
    return owner


@web.middleware
async def fail_closed(request: web.Request, handler: Handler) -> web.StreamResponse:
    """503 while the routing tables cannot be read (no ticket from a view that may have missed
    a revocation, see :mod:`projections.route_cache`) or no unretired signing key is held."""
    try:
        return await handler(request)
    except RoutingUnavailable:
        log.warning("routing unavailable", extra={"path": request.path})
        return _json(503, UNAVAILABLE)
    except SigningUnavailable:
        return _json(503, NO_SIGNING_KEY)  # the office logged why, once per rescan


async def healthz(_request: web.Request) -> web.Response:
    return _json(200, {"status": "ok"})


def make_app(
    office: TicketOffice,
    *,
    triton_urls: list[str] | None = None,
    metrics: GatewayMetrics | None = None,
    ledger: Ledger | None = None,
    gauges: Callable[[], Mapping[str, float]] | None = None,
) -> web.Application:
    """The gateway: tickets, feedback, health, ``/metrics``, ``/v1/stats`` and, given Triton URLs
    (host:port), the OpenAI-compatible routes of :mod:`control.gateway.openai_api`. ``gauges``:
    values of the process the gateway runs in, exported on ``/metrics`` too (``serve`` passes the
    rollout controller's liveness)."""
    metrics = metrics or GatewayMetrics()
    if gauges is not None:
        metrics.add_gauges(gauges)
    # Routes read their bodies through control.gateway.bodies, each with its own limit;
    # client_max_size bounds only request.read()/post(), which no route uses: set it to the
    # largest route limit so that it never contradicts one.
    app = web.Application(client_max_size=max(TICKET_BODY_LIMIT, OPENAI_BODY_LIMIT),
                          middlewares=[metrics.middleware(), fail_closed])
    app[OFFICE_KEY] = office
    # The request ledger the feedback route checks ownership in and writes ratings to.
    app[LEDGER_KEY] = ledger or Ledger(make_engine(office.settings.gateway_db_url))
    receipts.add_routes(app, office, app[LEDGER_KEY].engine)  # GET /v1/receipts/{request_id}
    app.router.add_post("/v1/tickets", issue_ticket)
    app.router.add_post("/v1/feedback", rate_request)
    app.router.add_delete("/v1/sessions/{session}", end_session)
    app.router.add_get("/healthz", healthz)
    observability.add_routes(app, office, metrics)
    if triton_urls:
        openai_api.add_routes(app, office, triton_urls, metrics=metrics,
                              tracer=telemetry.tracer("loraplane-gateway"),
                              model=office.settings.model_name)
    return app
