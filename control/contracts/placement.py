"""Placement across Triton hosts: the affinity value a balancer hashes on.

The gateway's ticket answer carries ``affinity``; the bundled clients send it back in the
:data:`AFFINITY_HEADER` header, and the local balancer (``control.ops.balancer``: HAProxy,
``balance hdr(...)`` with consistent hashing) sends every request with one value to the same
host while it is up, so the adapters behind it stay resident where its requests go.

The value is a short hash of the alias the ticket was issued for, not of the release or adapter
digest: the ticket answer never says which arm of a canary split a ticket landed on
(``control.gateway.server``), and a per-arm value would. Both arms of a split are then placed on
one host, which keeps both resident there. Whether it hashes the tenant too depends on the
alias's owner (``TicketOffice``):

- **The owner bounds its adapters' replicas** (``TenantPolicy.max_replicas``): the alias alone,
  so the owner's requests and every granted tenant's go to the same host, and an adapter bounded
  to few replicas (``control.contracts.replica_claims``) is not asked for on several hosts by
  honest clients.
- **Otherwise** (and for a base alias): the tenant and the alias, so one alias shared by many
  tenants spreads over the hosts, each tenant's requests staying on one, instead of every
  tenant's traffic queueing on the one host its alias hashes to. (HAProxy's consistent hashing
  cannot spread one value: its bounded loads, tried on 2026-12-06, cost affinity a tenth of
  its hits at four clients.) An owner that wants its adapter on few hosts sets ``max_replicas``.

A tenant that computes the alias-only value can tell which of the two its ticket carries, and
so whether the owner bounds replicas; a refusal for ``max_replicas`` tells it as much already.
It decides nothing: the header only places a request. Authorization stays with the ticket,
which every host verifies; a wrong or forged value costs a cold load on another host, never
access.

Where the control plane itself calls Triton hosts (the gateway's OpenAI routes, the rollout
controller's probes), it places the same way without a balancer: ``LORAPLANE_TRITON_URLS``
entries may name a host's pool (``gold=10.0.0.5:8000``; none: the shared pool), and
:func:`place` orders a request's candidates as the hosts of its ticket's pool, by rendezvous
hashing on the affinity value (a host's going away moves only the routes it held).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from control.contracts.config import SHARED_POOL, check_placement_name

AFFINITY_HEADER = "x-loraplane-affinity"
# The pool a request is for (the ticket answer's ``pool``): a balancer sends it to that pool's
# hosts, and a missing or unknown value to the shared pool's. Like the affinity value it only
# places: every host refuses a ticket whose pool is not its own.
POOL_HEADER = "x-loraplane-pool"
_DOMAIN = b"loraplane-affinity\0"


def affinity_of(alias: str, tenant: str | None = None) -> str:
    """The affinity value of tickets issued for ``alias`` (16 hex characters): without
    ``tenant``, the alias's alone, equal for its owner and every tenant granted it; with it,
    that tenant's own value for the alias (see the module notes for which the office signs)."""
    if tenant is None:
        return hashlib.sha256(_DOMAIN + b"alias\0" + alias.encode()).hexdigest()[:16]
    # length-prefixed, so no (tenant, alias) pair spells another's
    return hashlib.sha256(_DOMAIN + b"tenant-alias\0" + f"{len(tenant)}:{tenant}\0{alias}"
                          .encode()).hexdigest()[:16]


@dataclass(frozen=True)
class HostUrl:
    """A Triton host's ``host:port`` and the pool it serves (``Settings.host_pool``)."""

    url: str
    pool: str = SHARED_POOL

    def spec(self) -> str:
        """As ``LORAPLANE_TRITON_URLS`` spells it."""
        return self.url if self.pool == SHARED_POOL else f"{self.pool}={self.url}"


def parse_host_urls(specs: Iterable[str]) -> list[HostUrl]:
    """``host:port`` or ``POOL=host:port`` entries (blank ones skipped); a bad pool name raises
    ConfigError naming it."""
    hosts = []
    for spec in (s.strip() for s in specs):
        if not spec:
            continue
        pool, sep, url = spec.rpartition("=")
        pool = pool.strip()
        if sep:
            check_placement_name(f"the pool of Triton URL {url!r}", pool)
        hosts.append(HostUrl(url.strip(), pool if sep else SHARED_POOL))
    return hosts


def place(hosts: Sequence[HostUrl], pool: str, affinity: str) -> list[str]:
    """The URLs of ``pool``'s hosts, in the order to try them for a request of ``affinity``:
    highest rendezvous weight first, so every caller puts one route on the same host while it
    is up, and the routes of a host that goes away spread over the rest."""
    members = [h.url for h in hosts if h.pool == pool]
    return sorted(members, key=lambda url: hashlib.sha256(
        _DOMAIN + affinity.encode() + b"\0" + url.encode()).digest(), reverse=True)
