"""Placement across Triton hosts: the affinity value a balancer hashes on.

The gateway's ticket answer carries ``affinity``; the bundled clients send it back in the
:data:`AFFINITY_HEADER` header, and the local balancer (``control.ops.balancer``: HAProxy,
``balance hdr(...)`` with consistent hashing) sends every request with one value to the same
host while it is up, so the adapters behind it stay resident where its requests go.

The value is a short hash of the alias the ticket was issued for, not of the release or adapter
digest: the ticket answer never says which arm of a canary split a ticket landed on
(``control.gateway.server``), and a per-arm value would. Both arms of a split are then placed on
one host, which keeps both resident there. Nor does it hash the tenant: the owner's requests and
every granted tenant's for one alias go to the same host, so an adapter that its owner bounds to
few replicas (``control.contracts.replica_claims``) is not asked for on several hosts by honest
clients (an alias names one owner's route, so the hash reveals nothing its callers do not
know). It decides nothing: the header only places
a request. Authorization stays with the ticket, which every host verifies; a wrong or forged
value costs a cold load on another host, never access.

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


def affinity_of(alias: str) -> str:
    """The affinity value of tickets issued for ``alias``, to its owner or any tenant granted
    it (16 hex characters)."""
    return hashlib.sha256(_DOMAIN + b"alias\0" + alias.encode()).hexdigest()[:16]


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
