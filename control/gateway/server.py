"""The tenant-facing gateway (aiohttp): API key in, signed routing ticket out.

``POST /v1/tickets`` with ``Authorization: Bearer <api key>`` and ``{"alias": "..."}``.
401 when the key is missing or unknown; 403, with one fixed body, when the alias is unknown, not
granted to the caller, not servable or revoked: the caller cannot tell which, so the gateway never
confirms that another tenant's alias exists. 503 while the routing tables cannot be read, or
while no unretired signing key is held (the gateway never signs with a retired key).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping

from aiohttp import web
from aiohttp.typedefs import Handler

from control.contracts import telemetry
from control.gateway import observability, openai_api
from control.gateway.observability import GatewayMetrics
from control.gateway.ticket_office import NotGranted, SigningUnavailable, TicketOffice
from projections.route_cache import RoutingUnavailable

log = logging.getLogger("loraplane.gateway")

ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
SESSION_RE = re.compile(r"^[\x21-\x7e]{1,128}$")  # optional canary-split session id
MAX_BODY = 4096
UNAUTHORISED = {"error": "unauthorised: missing or unknown API key"}
FORBIDDEN = {"error": "forbidden: this alias is not available to your tenant"}
UNAVAILABLE = {"error": "routing temporarily unavailable; retry shortly"}
NO_SIGNING_KEY = {"error": "ticket signing unavailable: no active signing key; retry later"}
OFFICE_KEY = web.AppKey("office", TicketOffice)


def _json(status: int, body: Mapping[str, object]) -> web.Response:
    return web.json_response(body, status=status)


async def issue_ticket(request: web.Request) -> web.Response:
    office = request.app[OFFICE_KEY]
    auth = request.headers.get("Authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return _json(401, UNAUTHORISED)
    tenant = office.routing.tenant_for_api_key(key.strip())
    if tenant is None:
        return _json(401, UNAUTHORISED)
    if request.content_length is not None and request.content_length > MAX_BODY:
        return _json(400, {"error": "request body too large"})
    try:
        body = json.loads(await request.content.read(MAX_BODY + 1) or b"null")
    except ValueError:
        return _json(400, {"error": "body must be JSON: {\"alias\": \"...\"}"})
    alias = body.get("alias") if isinstance(body, dict) else None
    if not isinstance(alias, str) or not ALIAS_RE.match(alias):
        return _json(400, {"error": "field 'alias' must be an alias name"})
    session = body.get("session") if isinstance(body, dict) else None
    if session is not None and not (isinstance(session, str) and SESSION_RE.match(session)):
        return _json(400, {"error": "field 'session' must be 1-128 printable ASCII characters"})
    try:
        issued = office.issue(tenant, alias, session)
    except NotGranted:
        log.info("ticket refused", extra={"tenant": tenant})
        return _json(403, FORBIDDEN)
    c = issued.claims
    return _json(
        200,
        {
            "ticket": issued.token,
            "ticket_id": c.jti,
            "expires_at": c.exp,
            "model": c.model,
            "alias": alias,
            "adapter_digest": c.adapter,
            "release": issued.release,
        },
    )


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
) -> web.Application:
    """The gateway: tickets, health, ``/metrics``, ``/v1/stats`` and, given Triton URLs
    (host:port), the OpenAI-compatible routes of :mod:`control.gateway.openai_api`."""
    metrics = metrics or GatewayMetrics()
    app = web.Application(client_max_size=MAX_BODY, middlewares=[metrics.middleware(), fail_closed])
    app[OFFICE_KEY] = office
    app.router.add_post("/v1/tickets", issue_ticket)
    app.router.add_get("/healthz", healthz)
    observability.add_routes(app, office, metrics)
    if triton_urls:
        openai_api.add_routes(app, office, triton_urls, metrics=metrics,
                              tracer=telemetry.tracer("loraplane-gateway"),
                              model=office.settings.model_name)
    return app
