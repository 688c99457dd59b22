"""Placement across Triton hosts: the affinity value a balancer hashes on.

The gateway's ticket answer carries ``affinity``; the bundled clients send it back in the
:data:`AFFINITY_HEADER` header, and the local balancer (``control.ops.balancer``: HAProxy,
``balance hdr(...)`` with consistent hashing) sends every request with one value to the same
host while it is up, so the adapters behind it stay resident where its requests go.

The value is a short hash of the route the ticket was issued for (tenant and alias), not of the
release or adapter digest: the ticket answer never says which arm of a canary split a ticket
landed on (``control.gateway.server``), and a per-arm value would. Both arms of a split are then
placed on one host, which keeps both resident there. It decides nothing: the header only places
a request. Authorization stays with the ticket, which every host verifies; a wrong or forged
value costs a cold load on another host, never access.
"""

from __future__ import annotations

import hashlib

AFFINITY_HEADER = "x-loraplane-affinity"
# The pool a request is for (the ticket answer's ``pool``): a balancer sends it to that pool's
# hosts, and a missing or unknown value to the shared pool's. Like the affinity value it only
# places: every host refuses a ticket whose pool is not its own.
POOL_HEADER = "x-loraplane-pool"
_DOMAIN = b"loraplane-affinity\0"


def affinity_of(tenant: str, alias: str) -> str:
    """The affinity value of tickets issued to ``tenant`` for ``alias`` (16 hex characters)."""
    return hashlib.sha256(_DOMAIN + tenant.encode() + b"\0" + alias.encode()).hexdigest()[:16]
