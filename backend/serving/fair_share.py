"""Fair sharing of one host's adapter cache between tenants (issue 24).

What each cold load and each eviction owes to whom, apart from the cache's own bookkeeping
(``backend.serving.cache``, which calls these under its lock):

- :class:`CacheClaim`: whom a request's adapter counts against. Its owner (the tenant whose
  release names it, from the registry through the ticket's verified ``release`` claim) holds the
  resident share; the requester, whoever causes a cold load, spends the load rate and its part
  of the load queue.
- :class:`FairShare`: each requester's token bucket and pending loads, each owner's share as its
  policy last gave it (the host's :class:`CacheQuota` when the policy says nothing).
- :func:`fair_victim`: when a tier is full, the least recently used evictable adapter among the
  owners over their fair part of it (the tier's budget split between the owners in it, and the
  one loading, by share); plain LRU only when no owner is over. A tenant that churns versions
  is over its part first, so it evicts its own adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar


class CacheRefused(Exception):
    """The cache cannot make the adapter resident now; ``reason`` is a short code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CacheQuota:
    """Limits on the shared cache: each tenant's share of the device budget and rate of cold
    loads, and the load queue all tenants share (what a tenant may *register* is another
    thing, ``control.domain.TenantPolicy``)."""

    resident_share: float = 0.5  # of the device budget
    loads_per_minute: float = 120.0
    load_burst: int = 16  # under a tenant policy's rate, at most a minute's worth of it
    max_pending_loads: int = 64  # the bounded load queue, all tenants together
    max_pending_per_tenant: int = 8  # one tenant's part of it (the requester's)
    # How long a load waits for a referenced adapter to be released before it is refused
    # for want of room (every slot, the budget or the tenant's share held by live requests).
    room_wait_s: float = 10.0


@dataclass(frozen=True)
class CacheClaim:
    """Whom a request's adapter counts against: its ``owner`` holds the resident share, the
    ``requester`` spends the load rate. A limit that is None is the host's (:class:`CacheQuota`)."""

    requester: str | None
    owner: str | None
    owner_share: float | None = None  # of the device and host budgets
    requester_loads_per_minute: float | None = None
    owner_max_replicas: int | None = None  # hosts that may hold the adapter in a slot at once


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class _Owned(Protocol):
    @property
    def tenant(self) -> str | None: ...


E = TypeVar("E", bound=_Owned)


class FairShare:
    """Per-tenant shares, load rates and pending loads of one cache; the cache's lock guards
    every call."""

    def __init__(self, quota: CacheQuota, clock: Callable[[], float]) -> None:
        self.quota, self.clock = quota, clock
        self._buckets: dict[str | None, _Bucket] = {}
        self._pending_by: dict[str | None, int] = {}  # requester -> its loads queued or running
        self._shares: dict[str | None, float | None] = {}  # owner -> share its policy gave last

    def note_share(self, owner: str | None, share: float | None) -> None:
        self._shares[owner] = share

    def share_of(self, owner: str | None) -> float:
        share = self._shares.get(owner)
        return self.quota.resident_share if share is None else share

    def admit(self, claim: CacheClaim, pending: int) -> None:
        """Refuse a cold load past the bounded load queue (``pending`` loads in it), the
        requester's part of it, or the requester's load rate (a token bucket)."""
        tenant = claim.requester
        if pending >= self.quota.max_pending_loads:
            raise CacheRefused("load_queue_full", "too many adapter loads queued, retry later")
        if self._pending_by.get(tenant, 0) >= self.quota.max_pending_per_tenant:
            raise CacheRefused("load_queue_full", "too many of your adapter loads are queued, "
                                                  "retry later")
        now = self.clock()
        burst = float(self.quota.load_burst)
        per_minute = claim.requester_loads_per_minute
        if per_minute is None:
            per_minute = self.quota.loads_per_minute
        else:  # a policy's rate: its burst is at most a minute's worth of it
            burst = min(burst, max(1.0, per_minute))
        b = self._buckets.get(tenant)
        if b is None:
            b = self._buckets[tenant] = _Bucket(burst, now)
        b.tokens = min(burst, b.tokens + (now - b.stamp) * per_minute / 60.0)
        b.stamp = now
        if b.tokens < 1.0:
            raise CacheRefused("load_rate", "adapter load rate exceeded, retry later")
        b.tokens -= 1.0

    def started(self, requester: str | None) -> None:
        self._pending_by[requester] = self._pending_by.get(requester, 0) + 1

    def finished(self, requester: str | None) -> None:
        left = self._pending_by.get(requester, 0) - 1
        if left > 0:
            self._pending_by[requester] = left
        else:
            self._pending_by.pop(requester, None)


H = TypeVar("H", bound=Hashable)


def over_fair_part(usage: Mapping[H, int], budget: int,
                   weight: Callable[[H], float] = lambda _: 1.0) -> dict[H, float]:
    """The holders in ``usage`` (bytes each, the one about to add counted with what it adds)
    over their fair part of ``budget``, each with how far over: ``budget`` split between them
    in proportion to ``weight`` (evenly by default). The one rule of both caches that share
    bytes between tenants: adapters here, prompt prefixes in ``backend.serving.prefix_cache``."""
    weights = {o: weight(o) for o in usage}
    total = sum(weights.values())
    parts = {o: budget * w / total for o, w in weights.items()}
    return {o: used - parts[o] for o, used in usage.items() if used > parts[o]}


def fair_victim(entries: Iterable[E], keep: E, need: int, budget: int,
                share_of: Callable[[str | None], float], *, held: Callable[[E], int],
                evictable: Callable[[E], bool]) -> E | None:
    """The first (least recently used) of ``entries`` that is evictable, is not ``keep``, and
    belongs to an owner over its fair part of ``budget``; else the first evictable one. An
    owner's fair part is ``budget`` split between the owners holding bytes (``held``) and
    ``keep``'s owner, which is about to add ``need``, in proportion to their shares."""
    ordered = list(entries)
    usage: dict[str | None, int] = {keep.tenant: need}
    for x in ordered:
        if held(x):
            usage[x.tenant] = usage.get(x.tenant, 0) + held(x)
    over = over_fair_part(usage, budget, share_of)
    first_any: E | None = None
    for x in ordered:
        if x is keep or not evictable(x):
            continue
        if x.tenant in over:
            return x
        first_any = first_any or x
    return first_any
