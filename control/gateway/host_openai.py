"""Each Triton host's own OpenAI-compatible route (issue 25): ``POST /v1/completions`` and
``POST /v1/chat/completions``, where ``model`` names the ticket's route and the ticket travels
in a header, as the Gateway API Inference Extension's endpoint picker expects of a model server.

The picker reads ``model`` from the body and prefers hosts whose placement metrics list that
name as a running or waiting adapter (``backend.triton.placement_metrics``). A tenant never
learns an adapter digest (the ticket's arm is sealed), so ``model`` is the ticket's affinity
value instead: the answer of ``POST /v1/tickets`` gives it, the ticket carries it as a signed
claim, and hosts publish it in those metrics.

- The ticket: header :data:`HOST_TICKET_HEADER`, or ``Authorization: Bearer <ticket>``. None,
  two that differ, or one whose payload cannot be read gets :data:`TICKET_REFUSED` (401); so
  does one Triton refuses, whatever the reason (the ledger keeps it). No API key: Triton
  verifies the ticket, this server only reads its affinity claim to check ``model`` (a forged
  claim fails Triton's verification).
- ``model`` must equal the ticket's affinity claim; anything else (a ticket signed without the
  claim included) gets OpenAI's fixed 404, which names nothing.
- The body is parsed exactly as the gateway's OpenAI routes parse it
  (``control.gateway.openai_request``), forwarded to this host's Triton generate endpoints in
  the same shape (``control.gateway.openai_forward``), streaming included; ``x-session-id`` and
  ``user`` are ignored: the ticket fixed the release already.
- ``usage`` and ``finish_reason`` come from the request's ledger row, which Triton writes
  before it answers, read with this host's own database credential: ``length`` when the
  completion used the ``max_tokens`` the engine generated with (the release's default filled
  in where the request gave none).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import sqlalchemy as sa
from aiohttp import web

from control.contracts import wire
from control.contracts.ledger import request_ledger
from control.contracts.placement import HostUrl
from control.contracts.telemetry import span, traceparent_of
from control.contracts.tickets import MAX_TOKEN_BYTES, unverified_claims
from control.gateway import openai_forward as forward
from control.gateway.bodies import OPENAI_BODY_LIMIT
from control.gateway.openai_forward import TICKET_REFUSED, Upstream
from control.gateway.openai_request import (
    ApiError,
    Generation,
    not_found,
)

HOST_TICKET_HEADER = "x-loraplane-ticket"
UPSTREAM_KEY = web.AppKey("host_openai_upstream", Upstream)
LEDGER_KEY = web.AppKey("host_openai_ledger", sa.engine.Engine)


def ticket_of(headers: Mapping[str, str]) -> str:
    """The one ticket a request brings (header or bearer token), else TICKET_REFUSED."""
    getall = getattr(headers, "getall", None)
    given = list(getall(HOST_TICKET_HEADER, [])) if getall else (
        [headers[HOST_TICKET_HEADER]] if HOST_TICKET_HEADER in headers else [])
    scheme, _, bearer = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and bearer.strip():
        given.append(bearer.strip())
    tickets = {t.strip() for t in given}
    if len(tickets) != 1:  # none, or two that differ: ambiguity is refused everywhere
        raise TICKET_REFUSED
    return tickets.pop()


def affinity_claim(ticket: str) -> str | None:
    """The ticket's affinity claim, read without verifying (Triton verifies), or None when it
    has none; TICKET_REFUSED when its payload is unreadable."""
    if len(ticket) > MAX_TOKEN_BYTES or not ticket.isascii():
        raise TICKET_REFUSED
    try:
        value = unverified_claims(ticket).get("affinity")
    except Exception:  # any malformed token: one answer, whatever broke
        raise TICKET_REFUSED from None
    return value if isinstance(value, str) else None


def ledger_close(engine: sa.engine.Engine, rid: str) -> tuple[dict[str, int], str]:
    """(usage, finish_reason) of request ``rid`` from its ledger row."""
    t = request_ledger
    with engine.connect() as conn:
        row = conn.execute(sa.select(t.c.tokens_in, t.c.tokens_out, t.c.max_tokens)
                           .where(t.c.request_id == rid)).one_or_none()
    tin, tout, limit = (int(row[0] or 0), int(row[1] or 0), row[2]) if row else (0, 0, None)
    usage = {"prompt_tokens": tin, "completion_tokens": tout, "total_tokens": tin + tout}
    return usage, "length" if limit is not None and tout >= int(limit) else "stop"


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    try:
        ticket = ticket_of(request.headers)
        affinity = affinity_claim(ticket)
        _body, model, g = await forward.parsed_request(request, chat)
        if affinity is None or model != affinity:
            raise not_found()
        return await _complete(request, chat, g, ticket, model)
    except ApiError as e:
        return e.response()


async def _complete(request: web.Request, chat: bool, g: Generation, ticket: str,
                    model: str) -> web.StreamResponse:
    up = request.app[UPSTREAM_KEY]
    engine = request.app[LEDGER_KEY]
    created = int(time.time())

    def close(rid: str) -> tuple[dict[str, int], str]:
        return ledger_close(engine, rid)

    with span(up.tracer, "host.openai." + ("chat" if chat else "completions"),
              {"loraplane.stream": g.stream}) as s:
        name, inputs = await up.target(g.stream)
        body = forward.triton_body(inputs, g, ticket, traceparent_of(s))
        answers = forward.events(up, name, body, g.stream, [h.url for h in up.hosts])
        return await forward.respond(request, chat, g, model, created, answers, s, close)


def make_host_app(triton_http: str, ledger: sa.engine.Engine, *,
                  model: str = wire.MODEL) -> web.Application:
    """The route of one host: forwarding to its Triton at ``triton_http`` (host:port), reading
    usage from the ledger through ``ledger`` (the host's own credential)."""
    from opentelemetry import trace

    app = web.Application(client_max_size=OPENAI_BODY_LIMIT)
    up = Upstream([HostUrl(triton_http)], model=model, tracer=trace.NoOpTracer(),
                  ticket_refusals=True)
    app[UPSTREAM_KEY] = up
    app[LEDGER_KEY] = ledger
    app.cleanup_ctx.append(forward.open_session(up))
    forward.add_completion_routes(app, _serve)
    return app
