"""Gateway metrics and the per-digest stats view (logs and traces: ``control.contracts.telemetry``).

The Prometheus metrics cost nothing until scraped; configured by environment:

``LORAPLANE_ADMIN_TOKEN``  the operator's bearer token for ``GET /v1/stats`` across all tenants;
                           unset means no caller is an operator.

Metric labels are bounded by construction: route templates, status codes, fixed outcome and
reason vocabularies. No tenant, alias, digest or request id is ever a label; per-digest figures
come from the request ledger through :func:`digest_stats`, scoped to the caller.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from control.contracts.ledger import request_ledger as t
from projections.tables import adapters

ADMIN_TOKEN_ENV = "LORAPLANE_ADMIN_TOKEN"
GRANTED = "granted"  # a tenant's /v1/stats entry for its requests on other tenants' adapters

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TICKET_OUTCOMES = {200: "issued", 400: "bad_request", 401: "unauthorised", 403: "forbidden",
                   408: "bad_request", 413: "bad_request"}  # a body too slow or too large


# --- gateway metrics --------------------------------------------------------------------------


class _GaugeSource(Collector):
    """Gauges whose values a callable gives at scrape time."""

    def __init__(self, source: Callable[[], Mapping[str, float]]) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, value in sorted(self.source().items()):
            yield GaugeMetricFamily(name, "exported by the process this gateway runs in",
                                    value=value)


class GatewayMetrics:
    """The gateway's Prometheus series, on a registry of its own (one per gateway)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loraplane_gateway_requests", "HTTP requests by route template "
                                "and status code.", ["route", "code"], registry=r)
        self.latency = Histogram("loraplane_gateway_request_seconds", "HTTP request latency by "
                                 "route template.", ["route"], buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.tickets = Counter("loraplane_gateway_tickets", "Ticket requests by outcome "
                               "(issued, unauthorised, forbidden, bad_request).", ["outcome"],
                               registry=r)
        self.tokens = Counter("loraplane_gateway_tokens", "Tokens through the OpenAI-compatible "
                              "routes, by kind (prompt, completion).", ["kind"], registry=r)
        self.upstream_errors = Counter("loraplane_gateway_upstream_errors", "Triton answers "
                                       "that were errors, by kind.", ["kind"], registry=r)

    def add_gauges(self, source: Callable[[], Mapping[str, float]]) -> None:
        """Export ``source()``'s values (metric name -> value) as gauges, read at each scrape:
        how a process running beside the gateway (the rollout controller's liveness) is seen
        on this ``/metrics`` without the gateway importing it."""
        self.registry.register(_GaugeSource(source))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def middleware(self) -> Callable[..., Awaitable[Any]]:
        """aiohttp middleware counting every request by route template and status."""
        from aiohttp import web

        @web.middleware
        async def measure(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
            info = request.match_info.route.resource
            route = info.canonical if info is not None else "unmatched"
            t0 = time.perf_counter()
            code = 500
            try:
                response = await handler(request)
                code = int(getattr(response, "status", 200))
                return response
            except web.HTTPException as e:
                code = e.status
                raise
            finally:
                self.requests.labels(route, str(code)).inc()
                self.latency.labels(route).observe(time.perf_counter() - t0)
                if route == "/v1/tickets":
                    self.tickets.labels(TICKET_OUTCOMES.get(code, "other")).inc()

        return measure


def metrics_response(metrics: GatewayMetrics) -> Any:
    from aiohttp import web

    resp = web.Response(body=metrics.exposition())
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


# --- per-digest stats from the ledger ---------------------------------------------------------


@dataclass(frozen=True)
class DigestStats:
    """Aggregates of ledger rows for one adapter digest (None: the base model alone)."""

    adapter_digest: str | None
    requests: int
    ok: int
    rejected: int
    failed: int
    tokens_in: int
    tokens_out: int
    mean_seconds: float | None
    tenant: str | None = None  # only in the operator's view


def digest_stats(engine: sa.engine.Engine, tenant: str | None, *,
                 unattributed: bool = False) -> list[DigestStats]:
    """Per-digest aggregates of the request ledger: ``tenant``'s own requests only, or (None)
    every tenant's, grouped by tenant as well. A tenant's view holds only rows whose tenant is
    the caller, and names only the digests of the caller's own adapters: its requests on
    adapters other tenants own (aliases they granted it) are one entry, :data:`GRANTED`.

    ``unattributed`` (operators only, with ``tenant`` None): one more entry, tenant and digest
    both None, for the requests no verified ticket names: missing, forged or ambiguous tickets,
    busy refusals, admission failures. Without it an operator would count far fewer refusals
    than the ledger holds.
    """
    cols: list[Any] = [t.c.adapter_digest]
    if tenant is None:
        cols.insert(0, t.c.tenant)
    else:
        # A tenant sees the digests of its own adapters only: requests it sent on aliases
        # other tenants granted it are counted together as GRANTED, so no owner's adapter
        # digest, nor a change of it mid-rollout, shows in another tenant's figures.
        own = sa.select(adapters.c.digest).where(adapters.c.tenant == tenant)
        cols = [sa.case((t.c.adapter_digest.is_(None), sa.null()),
                        (t.c.adapter_digest.in_(own), t.c.adapter_digest),
                        else_=sa.literal(GRANTED)).label("adapter_digest")]
    seconds = sa.case((t.c.finished_at.is_not(None), t.c.finished_at - t.c.admitted_at))
    q = sa.select(
        *cols,
        sa.func.count().label("requests"),
        sa.func.sum(sa.case((t.c.outcome == "ok", 1), else_=0)).label("ok"),
        sa.func.sum(sa.case((t.c.outcome == "rejected", 1), else_=0)).label("rejected"),
        sa.func.sum(sa.case((t.c.outcome == "failed", 1), else_=0)).label("failed"),
        sa.func.coalesce(sa.func.sum(t.c.tokens_in), 0).label("tokens_in"),
        sa.func.coalesce(sa.func.sum(t.c.tokens_out), 0).label("tokens_out"),
        sa.func.avg(sa.case((t.c.outcome == "ok", seconds))).label("mean_seconds"),
    ).group_by(*cols).order_by(*cols)
    # refusals of unproven tickets have no tenant: they are in no tenant's view
    if tenant is not None:
        q = q.where(t.c.tenant == tenant)
    elif not unattributed:
        q = q.where(t.c.tenant.is_not(None))
    with engine.connect() as conn:
        rows = conn.execute(q).all()
    return [
        DigestStats(
            adapter_digest=r.adapter_digest, requests=int(r.requests), ok=int(r.ok or 0),
            rejected=int(r.rejected or 0), failed=int(r.failed or 0),
            tokens_in=int(r.tokens_in or 0), tokens_out=int(r.tokens_out or 0),
            mean_seconds=None if r.mean_seconds is None else round(float(r.mean_seconds), 6),
            tenant=r.tenant if tenant is None else None,
        )
        for r in rows
    ]


def is_admin(token: str, configured: str | None = None) -> bool:
    """True when ``token`` is the operator token (``LORAPLANE_ADMIN_TOKEN``), in constant time."""
    want = configured if configured is not None else os.environ.get(ADMIN_TOKEN_ENV, "")
    return bool(want) and hmac.compare_digest(token.encode(), want.encode())


def stats_body(rows: Sequence[DigestStats], *, operator: bool) -> Mapping[str, Any]:
    items = []
    for r in rows:
        d = asdict(r)
        if not operator:
            d.pop("tenant")
        items.append(d)
    return {"scope": "all" if operator else "tenant", "digests": items}


# --- gateway routes ---------------------------------------------------------------------------


def add_routes(app: Any, office: Any, metrics: GatewayMetrics) -> None:
    """Mount ``GET /metrics`` (Prometheus) and ``GET /v1/stats`` (per-digest aggregates).

    ``/v1/stats`` with a tenant's API key answers that tenant's own figures; with the operator
    token (``LORAPLANE_ADMIN_TOKEN``) every tenant's; anything else gets 401.
    """
    from aiohttp import web

    async def metrics_route(_request: web.Request) -> web.StreamResponse:
        return metrics_response(metrics)

    async def stats_route(request: web.Request) -> web.StreamResponse:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return web.json_response({"error": "unauthorised: missing or unknown API key"},
                                     status=401)
        operator = is_admin(token)
        tenant = None if operator else office.routing.tenant_for_api_key(token)
        if not operator and tenant is None:
            return web.json_response({"error": "unauthorised: missing or unknown API key"},
                                     status=401)
        rows = digest_stats(office.routing.engine, tenant)
        return web.json_response(stats_body(rows, operator=operator))

    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/v1/stats", stats_route)
