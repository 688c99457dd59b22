"""OpenAI-compatible routes of the gateway: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (with SSE streaming).

The caller authenticates with its tenant API key (``Authorization: Bearer``). ``model`` is an
alias the tenant is granted: the gateway resolves it on the routing projection, signs a routing
ticket exactly as ``POST /v1/tickets`` would, and forwards the request with that ticket to
Triton's generate extension (``/v2/models/lora_llm/generate``, ``generate_stream`` when
streaming). An unknown, ungranted, unservable or revoked name gets one fixed 404 that names
nothing else; there is never a fallback to another model.

Sessions. The ``x-session-id`` header names the caller's session (a multi-turn chat, a stream
that may reconnect); without it, OpenAI's ``user`` field serves as the session id. A session
keeps the release it first resolved until it ends (``DELETE /v1/sessions/{session}``) or its
pin expires (``control.domain.session``); a request with neither is its own session.

Chat template. The reference kit has none, so chat messages are rendered with this documented
role-prefixed template (one line per message, then the assistant's turn)::

    system: <content>\\n
    user: <content>\\n
    assistant: <content>\\n
    ...
    assistant:

Requests. The body is read whole (at most 64 KiB, else 413; :mod:`control.gateway.bodies`) and
parsed strictly: a key given twice, ``NaN`` or ``Infinity`` is refused. Every field the gateway
uses is checked for its JSON type before anything else happens, and a wrong one gets 400 in
OpenAI's error shape with ``param`` naming it: ``model``, ``prompt`` (a string, or a list of
one string) and ``user`` strings, ``messages`` as the template below needs them, ``stream`` a
boolean, ``stream_options`` an object whose ``include_usage`` is a boolean, ``n`` (only 1),
``max_tokens``/``max_completion_tokens`` and ``seed`` integers, ``temperature`` and ``top_p``
numbers; null counts as not given. The sampling values must lie in the ranges a Triton host
applies (:mod:`control.contracts.sampling`), so what a host would refuse is refused here, with
a message naming the field, before a ticket is signed: ``max_tokens`` 1..512; ``temperature``
0 (greedy) or 0.01..2 (OpenAI documents 0..2, hosts take 0 or 0.01..10: the intersection);
``top_p`` 0.001..1; ``seed`` any signed 64-bit integer, negative ones included (the hosts'
``seed`` input is INT64, and OpenAI sets no range; the gateway used to refuse negative seeds,
which only made it stricter than the hosts for no reason). Other fields are ignored.

Token usage comes from the request's ledger row (written by the backend before it answers), so
``usage`` reports exactly what the ledger recorded.

Streaming. Where the hosts serve the decoupled engine model ``lora_llm_stream`` (continuous
batching), a streamed request goes to its ``generate_stream`` with ``stream: true`` and every
token piece becomes one SSE chunk. Where they do not, the request goes to ``lora_llm``'s
``generate_stream`` and its single answer becomes one chunk holding the whole completion.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from aiohttp import web

from control.contracts import wire
from control.contracts.ledger import request_ledger
from control.contracts.placement import affinity_of, parse_host_urls
from control.contracts.sampling import (
    DEFAULT_MAX_TOKENS,
)
from control.contracts.telemetry import span, traceparent_of
from control.domain import SESSION_RE
from control.gateway.observability import GatewayMetrics
from control.gateway.openai_forward import (
    BUSY,
    Upstream,
    add_completion_routes,
    events,
    open_session,
    parsed_request,
    respond,
    triton_body,
)
from control.gateway.openai_request import (
    ApiError,
    Generation,
    bad_request,
    not_found,
    wrong_type,
)
from control.gateway.ticket_office import NotGranted, TicketOffice
from projections.tables import grants

log = logging.getLogger("loraplane.gateway")

SESSION_HEADER = "x-session-id"


UPSTREAM_KEY = web.AppKey("openai_upstream", Upstream)
OFFICE_KEY = web.AppKey("openai_office", TicketOffice)


def _tenant(request: web.Request) -> str:
    office = request.app[OFFICE_KEY]
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    tenant = (office.routing.tenant_for_api_key(key.strip())
              if scheme.lower() == "bearer" and key.strip() else None)
    if tenant is None:
        raise ApiError(401, "Missing or unknown API key.", "invalid_request_error",
                       "invalid_api_key")
    return tenant


def _finish_reason(request: web.Request, g: Generation, issued: Any,
                   usage: Mapping[str, int]) -> str:
    """``length`` when the answer used every token it was allowed: the client's max_tokens, else
    the release's default, else the sampling contract's."""
    limit = g.max_tokens
    if limit is None:
        release = (request.app[OFFICE_KEY].routing.release(issued.release)
                   if issued.release else None)
        defaults = (release or {}).get("inference_defaults") or {}
        limit = int(defaults.get(wire.MAX_TOKENS, DEFAULT_MAX_TOKENS))
    return "length" if usage["completion_tokens"] >= limit else "stop"


def _session(request: web.Request, user: object) -> str | None:
    """The caller's session id: the ``x-session-id`` header, else OpenAI's ``user`` field."""
    header = request.headers.get(SESSION_HEADER)
    if header is not None:
        if not SESSION_RE.match(header):
            raise bad_request(f"header {SESSION_HEADER} must be 1-128 printable ASCII characters")
        return header
    if user is not None and not isinstance(user, str):
        raise wrong_type("user", "a string", user)
    if not isinstance(user, str) or not 0 < len(user) <= 128:
        return None
    # Any user name keeps one release; one with spaces or non-ASCII is named by its hash.
    return user if SESSION_RE.match(user) else "user:" + hashlib.sha256(
        user.encode()).hexdigest()[:40]


async def _issue(request: web.Request, tenant: str, model: str, session: str | None) -> Any:
    """Resolve ``model`` for ``tenant`` and sign a ticket (the one place a ticket is signed on
    these routes: every check on the body has passed before it)."""
    office = request.app[OFFICE_KEY]
    try:
        if session is not None and office.pins is not None:
            # A new or moved pin is an event-store write: off the event loop.
            return await asyncio.to_thread(office.issue, tenant, model, session)
        return office.issue(tenant, model, session)
    except NotGranted:
        log.info("openai model refused", extra={"tenant": tenant})
        raise not_found() from None


def _usage(request: web.Request, request_ids: list[str]) -> dict[str, int]:
    t = request_ledger
    office = request.app[OFFICE_KEY]
    q = sa.select(sa.func.coalesce(sa.func.sum(t.c.tokens_in), 0),
                  sa.func.coalesce(sa.func.sum(t.c.tokens_out), 0)
                  ).where(t.c.request_id.in_(request_ids))
    with office.routing.engine.connect() as conn:
        tin, tout = conn.execute(q).one()
    usage = {"prompt_tokens": int(tin), "completion_tokens": int(tout),
             "total_tokens": int(tin) + int(tout)}
    metrics = request.app[UPSTREAM_KEY].metrics
    if metrics is not None:
        metrics.tokens.labels("prompt").inc(usage["prompt_tokens"])
        metrics.tokens.labels("completion").inc(usage["completion_tokens"])
    return usage


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    try:
        tenant = _tenant(request)
        # Everything the gateway can check is checked before a ticket is signed: a request a
        # host would refuse never costs a signature, a pin or an upstream call.
        body, model, g = await parsed_request(request, chat)
        session = _session(request, body.get("user"))
        issued = await _issue(request, tenant, model, session)
        return await _complete(request, chat, g, issued, model)
    except ApiError as e:
        return e.response()


async def _complete(request: web.Request, chat: bool, g: Generation, issued: Any,
                    alias: str) -> web.StreamResponse:
    up = request.app[UPSTREAM_KEY]
    created = int(time.time())
    attrs = {"loraplane.tenant": issued.claims.tenant, "loraplane.ticket_id": issued.claims.jti,
             "loraplane.adapter_digest": issued.claims.adapter or "",
             "loraplane.stream": g.stream}

    def close(rid: str) -> tuple[dict[str, int], str]:
        usage = _usage(request, [rid])
        return usage, _finish_reason(request, g, issued, usage)

    with span(up.tracer, "gateway.openai." + ("chat" if chat else "completions"), attrs) as s:
        model, inputs = await up.target(g.stream)
        body = triton_body(inputs, g, issued.token, traceparent_of(s))
        hosts = up.order(issued.claims.pool, issued.claims.affinity or affinity_of(issued.alias))
        if not hosts:  # an operator's mistake (no host of the pool listed), not the tenant's
            log.warning("no Triton host of the ticket's pool %s is listed (%s)",
                        issued.claims.pool, "LORAPLANE_TRITON_URLS")
            raise ApiError(503, BUSY, "server_error")
        answers = events(up, model, body, g.stream, hosts)
        return await respond(request, chat, g, alias, created, answers, s, close)


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the aliases the caller is granted that resolve now; nothing else."""
    try:
        tenant = _tenant(request)
    except ApiError as e:
        return e.response()
    office = request.app[OFFICE_KEY]
    with office.routing.engine.connect() as conn:
        aliases = sorted(str(a) for a in conn.execute(
            sa.select(grants.c.alias).where(grants.c.tenant == tenant)).scalars())
    data = [{"id": a, "object": "model", "created": 0, "owned_by": tenant}
            for a in aliases if office.routing.resolve(tenant, a) is not None]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: one granted alias, else the fixed 404."""
    try:
        tenant = _tenant(request)
        alias = request.match_info["model"]
        if request.app[OFFICE_KEY].routing.resolve(tenant, alias) is None:
            raise not_found()
    except ApiError as e:
        return e.response()
    return web.json_response({"id": alias, "object": "model", "created": 0, "owned_by": tenant})


def add_routes(app: web.Application, office: TicketOffice, triton_urls: list[str], *,
               tracer: Any = None, metrics: GatewayMetrics | None = None,
               model: str = wire.MODEL) -> None:
    """Mount the OpenAI-compatible routes on ``app``, forwarding to ``triton_urls``."""
    from opentelemetry import trace

    if not triton_urls:
        raise ValueError("the OpenAI-compatible routes need at least one Triton URL")
    up = Upstream(parse_host_urls(triton_urls), model=model, tracer=tracer or trace.NoOpTracer(),
                  metrics=metrics)
    app[UPSTREAM_KEY] = up
    app[OFFICE_KEY] = office
    app.cleanup_ctx.append(open_session(up))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    add_completion_routes(app, _serve)
