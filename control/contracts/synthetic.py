"""Synthetic traffic: requests the control plane sends itself (the evaluation gate, a base
upgrade's shadow gate, rollout probes), told apart from every tenant's by the tenant its tickets
name.

Why the ticket's tenant, and not a flag a request carries: a ticket is signed by the control
plane, and gateways sign only for the tenant an API key resolves to, so no client can put a
synthetic tenant on a ticket (or take it off one). And no tenant can be *called* by a synthetic
name: tenant names match ``control.domain.names.NAME_RE`` (letters, digits, ``. _ -``), and
every synthetic tenant has a ``:``. So the mark cannot be forged by a tenant, cannot be used by
one to hide its own traffic, and needs no new ticket claim: hosts already record the ticket's
tenant on every ledger row.

What follows from the mark, each where it is decided:

- a rollout window (``control.contracts.ledger.Ledger.release_window``) leaves synthetic rows out
  of its requests, outcomes, refusals, latency and ratings, and counts them apart
  (``ReleaseWindow.synthetic``); an identity mismatch counts whoever sent the request, since it
  is a fault of the engine, not a tenant's experience;
- a tenant's own views never show them: they select the caller's tenant (``/v1/stats``, the
  feedback route), and no tenant is a synthetic one;
- the operator's views show them apart, under their own tenant name (``/v1/stats`` with the
  operator token groups by tenant).
"""

from __future__ import annotations

SYNTHETIC_PREFIX = "loraplane:"  # ':' is in no tenant name
GATE_TENANT = SYNTHETIC_PREFIX + "gate"  # the evaluation gate, on its own base or a new one
PROBE_TENANT = SYNTHETIC_PREFIX + "probe"  # a rollout's probes before each step


def is_synthetic(tenant: str | None) -> bool:
    """Whether ``tenant`` (a ticket's, a ledger row's) marks the control plane's own traffic."""
    return tenant is not None and tenant.startswith(SYNTHETIC_PREFIX)


__all__ = ["GATE_TENANT", "PROBE_TENANT", "SYNTHETIC_PREFIX", "is_synthetic"]
