"""The host's bound on requests in flight, and each tenant's part of it once its ticket is verified.

A request is in flight from the moment it arrives until it is answered. Past the host's bound
(``SchedulerLimits.in_flight_bound``) a request is refused as busy before its ticket is read:
under overload the host spends nothing it can avoid, so that refusal has no tenant.

One bound shared first come, first served let one tenant decide whether the others got in at
all: the fair waiting room (``backend.serving.tenant_queues``) keeps a flood to its part of the
queue, but requests waiting for an adapter's load stay in flight without limit, so a tenant that
sent a few hundred requests for one cold adapter held the whole bound for as long as the load
took, and every other tenant was refused as busy. So once a request's ticket is verified it
counts against its tenant, and a tenant may hold at most an equal part of the bound between the
tenants holding requests in flight *and one more*: a tenant that arrives finds room, whoever
holds the rest. A lone tenant may hold half the bound (the default bound is four times the
queue and the running rows together, so half is still twice what the host can queue). A request
over its tenant's part is refused as busy right after verification (ledger reason
``tenant_busy``, the tenant on its row) and leaves the bound at once.

What is left to another tenant: requests not verified yet count against nobody, so a tenant that
sends faster than the admission threads verify can still fill the bound for a moment; that is
overload of the host itself, which the network in front of it has to limit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from control.contracts.ledger import TENANT_BUSY_REASON

TENANT_BUSY = TENANT_BUSY_REASON  # the ledger's reason for a request over its tenant's part


class InFlightBook:
    """Requests in flight: those not verified yet, and each tenant's verified ones."""

    def __init__(self, bound: Callable[[], int]) -> None:
        """``bound``: the host's bound, read at every arrival (the limits may be replaced)."""
        self.bound = bound
        self._lock = threading.Lock()
        self._unverified: set[str] = set()
        self._tenant_of: dict[str, str] = {}  # request id -> its verified tenant
        self._held: dict[str, int] = {}  # tenant -> its verified requests in flight

    def enter(self, request_id: str) -> bool:
        """Count an arriving request; False (nothing counted) when the bound is reached."""
        with self._lock:
            if len(self._unverified) + len(self._tenant_of) >= self.bound():
                return False
            self._unverified.add(request_id)
            return True

    def verified(self, request_id: str, tenant: str) -> bool:
        """The request's ticket names ``tenant``: count it against the tenant; False when the
        tenant holds its part already (the request stays counted, unverified, until done)."""
        with self._lock:
            if request_id not in self._unverified:
                raise KeyError(f"request {request_id} is not in flight unverified")
            held = self._held.get(tenant, 0)
            if held >= self._part(tenant):
                return False
            self._unverified.discard(request_id)
            self._tenant_of[request_id] = tenant
            self._held[tenant] = held + 1
            return True

    def _part(self, tenant: str) -> int:
        """What ``tenant`` may hold now: the bound split evenly between the other tenants
        holding requests, this one, and one more (at least 1). Called under the lock."""
        others = len(self._held) - (tenant in self._held)
        return max(1, self.bound() // (others + 2))

    def done(self, request_id: str) -> None:
        """The request was answered: it leaves the bound (an unknown id changes nothing)."""
        with self._lock:
            tenant = self._tenant_of.pop(request_id, None)
            if tenant is None:
                self._unverified.discard(request_id)
                return
            left = self._held[tenant] - 1
            if left:
                self._held[tenant] = left
            else:
                del self._held[tenant]

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._held.get(tenant, 0)

    def total(self) -> int:
        with self._lock:
            return len(self._unverified) + len(self._tenant_of)
