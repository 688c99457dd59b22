"""What the hostile self-test aims at: a running deployment, and the routes it makes there."""

from __future__ import annotations

from dataclasses import dataclass

from control.contracts.config import Settings

ACTOR = "selftest"  # who every event the suite records says acted


@dataclass(frozen=True)
class Target:
    """A running deployment, as the operator sees it."""

    settings: Settings
    gateway_url: str
    http_url: str  # host:port
    grpc_url: str  # host:port
    metrics_url: str | None = None  # Triton's metrics endpoint, e.g. http://host:8002/metrics
    base: str | None = None  # the served base digest (default: the only one registered)


@dataclass(frozen=True)
class TicketRoute:
    """One of the suite's own aliases, which it asks tickets for: whose it is, and the adapter
    it points at (not ``projections.routing.Route``, a row of the routing table)."""

    tenant: str
    alias: str
    digest: str


def short(digest: str | None) -> str:
    """A digest as failure lines show it (the suite's own digests only)."""
    return (digest or "base").removeprefix("sha256:")[:12]
