"""What the adapter cache (``backend.serving.cache``) keeps per digest, how it makes room in a
tier, and how its load records leave it; all of it under the cache's lock unless said.

- :class:`CacheEntry`: one digest's tiers, references, load state and statistics.
- :func:`evict_for_device` / :func:`make_tier_room`: one attempt at room for an adapter on the
  device (its owner's share, the budget, the slots), or in the host or store tier; only
  unreferenced adapters leave the device, the owners over their fair part first
  (``backend.serving.fair_share.fair_victim``).
- :class:`RecordOutbox`: load records made under the lock, handed to the cache's ``on_event``
  after it, in order. The handler may write a database (``backend.serving.load_records``), and a
  commit under the lock stalled every request's acquire and the scheduler's lease releases.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from backend.serving.engine import AdapterSource, PreparedAdapter
from backend.serving.fair_share import CacheRefused, fair_victim
from control.contracts.config import ADAPTER_BYTES_ENV, ADAPTER_SLOTS_ENV

log = logging.getLogger("loraplane.cache")

# Digests the cache keeps statistics for after they left every tier: beyond this many, the least
# recently used of those go (a tenant churning versions would otherwise grow the map forever, and
# every eviction reads it). Revoked tombstones and anything held, loading or resident stay.
REMEMBERED = 4096

# (digest, outcome loaded|failed|unloaded, started_at, seconds, resident bytes, reason)
LoadEvent = Callable[[str, str, float, float, int | None, str | None], None]
Record = tuple[str, str, float, float, int | None, str | None]


@dataclass
class CacheEntry:
    digest: str
    tenant: str | None = None
    path: AdapterSource | None = None  # store tier: verified files
    store_bytes: int = 0
    host: PreparedAdapter | None = None  # host tier: prepared for the slots, outside any lock
    host_bytes: int = 0
    device_bytes: int = 0
    on_device: bool = False
    refs: int = 0
    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_failures: int = 0
    last_load_seconds: float | None = None
    evictions: dict[str, int] = field(default_factory=dict)
    revoked: bool = False
    loading: Future[None] | None = None
    # Hosts that may hold it in a slot at once, from its owner's policy (None: no bound),
    # whether this host holds a claim on one of them (``backend.serving.replicas``), and whether
    # its owner's own requests asked for it here since it was last placed (its claim then ranks
    # before granted tenants' claims)
    max_replicas: int | None = None
    claimed: bool = False
    owner_asked: bool = False
    last_used: float = 0.0  # the cache's clock when a request last took or gave back a reference

    @property
    def unclaimed(self) -> bool:
        """Bounded, with no claim held here (never made: the bound came after it was placed;
        or lost): it takes no request before a claim, and leaves its slot when its last
        request ends, as a revoked adapter does."""
        return self.max_replicas is not None and not self.claimed


def evict_for_device(entries: OrderedDict[str, CacheEntry], e: CacheEntry, need: int,
                     share: int, budget: int, max_adapters: int,
                     share_of: Callable[[str | None], float],
                     unload: Callable[[CacheEntry, str], None]) -> None:
    """One attempt at room for ``e`` (``need`` bytes) within its owner's ``share``, the device
    ``budget`` and ``max_adapters`` slots; CacheRefused when what blocks it is referenced.
    ``entries``: the device-resident ones, least recently used first (``unload`` takes them
    out); the caller holds the engine's lock, so this looks through slots, not every digest."""
    owner = e.tenant

    def evict_one(reason: str, *, of_owner: bool = False) -> bool:
        if of_owner:  # the owner's least recently used
            victim = next((x for x in entries.values()  # oldest first
                           if x is not e and x.on_device and x.refs == 0
                           and x.tenant == owner), None)
        else:
            victim = fair_victim(entries.values(), e, need, budget, share_of,
                                 held=lambda x: x.device_bytes,
                                 evictable=lambda x: x.on_device and x.refs == 0)
        if victim is None:
            return False
        unload(victim, reason)
        return True

    if owner is not None and share < budget:
        while sum(x.device_bytes for x in entries.values()
                  if x.on_device and x.tenant == owner) + need > share:
            if not evict_one("tenant_share", of_owner=True):
                raise CacheRefused("tenant_share", "tenant's resident share is in use")
    while bytes_in(entries.values(), "device") + need > budget:
        if not evict_one("device_budget"):
            raise CacheRefused("no_room", f"the device budget ({ADAPTER_BYTES_ENV}) is held "
                                          "by running requests")
    while sum(1 for x in entries.values() if x.on_device) >= max_adapters:
        if not evict_one("slots_full"):
            raise CacheRefused("no_room", f"every adapter slot ({ADAPTER_SLOTS_ENV}) is held "
                                          "by running requests")


def make_tier_room(entries: OrderedDict[str, CacheEntry], tier: str, need: int, budget: int,
                   keep: CacheEntry, share_of: Callable[[str | None], float]) -> None:
    """Drop what ``tier`` (host or store) holds of other adapters until ``need`` fits."""
    if need > budget:
        raise CacheRefused("no_room", f"adapter larger than the {tier} budget")
    while bytes_in(entries.values(), tier) + need > budget:
        victim = (fair_victim(entries.values(), keep, need, budget, share_of,
                              held=lambda x: x.host_bytes,
                              evictable=lambda x: x.loading is None and holds(x, "host"))
                  if tier == "host" else
                  next((x for x in entries.values() if x is not keep
                        and x.loading is None and holds(x, tier)), None))
        if victim is None:
            raise CacheRefused("no_room", f"{tier} budget in use")
        drop_tier(victim, tier)
        victim.evictions[f"{tier}_budget"] = victim.evictions.get(f"{tier}_budget", 0) + 1


def forget_cold(entries: OrderedDict[str, CacheEntry]) -> None:
    """Drop the oldest entries that hold nothing beyond :data:`REMEMBERED`."""
    excess = len(entries) - REMEMBERED
    if excess > 0:
        cold = [d for d, x in entries.items()
                if not (x.on_device or x.refs or x.loading or x.revoked or x.host or x.path)]
        for d in cold[:excess]:
            del entries[d]


def bytes_in(entries: Iterable[CacheEntry], tier: str) -> int:
    if tier == "device":
        return sum(x.device_bytes for x in entries if x.on_device)
    return sum(x.host_bytes if tier == "host" else x.store_bytes for x in entries)


def holds(x: CacheEntry, tier: str) -> bool:
    return x.host is not None if tier == "host" else x.path is not None


def drop_tier(x: CacheEntry, tier: str) -> None:
    if tier == "host":
        x.host, x.host_bytes = None, 0
    else:
        x.path, x.store_bytes = None, 0


def dir_bytes(source: AdapterSource) -> int:
    if isinstance(source, Mapping):
        return sum(len(b) for b in source.values())
    return sum(p.stat().st_size for p in Path(source).rglob("*") if p.is_file())


class RecordOutbox:
    """Load records made under the cache's ``lock``, delivered after it (see the module notes).
    ``deliver`` is looked up at each delivery (the cache's current ``on_event``)."""

    def __init__(self, lock: threading.Condition, deliver: Callable[[], LoadEvent]) -> None:
        self._lock, self._deliver = lock, deliver
        self._records: list[Record] = []
        self._emitting = threading.Lock()

    def add(self, record: Record) -> None:
        """Caller holds the cache's lock."""
        self._records.append(record)

    def emit(self) -> None:
        """Deliver what is waiting, in order, one thread at a time. Caller does not hold the
        lock. Never waits for another thread's delivery: while one thread delivers, another's
        records are left to it (it looks again after it lets go)."""
        while self._emitting.acquire(blocking=False):
            try:
                while True:
                    with self._lock:
                        records, self._records = self._records, []
                    if not records:
                        break
                    for digest, outcome, started, seconds, nbytes, reason in records:
                        # The load record is evidence, but a database outage must not wedge the
                        # cache: a waiter would otherwise never learn how the load ended.
                        try:
                            self._deliver()(digest, outcome, started, seconds, nbytes, reason)
                        except Exception:
                            log.exception("could not record adapter %s (%s)", outcome, reason)
            finally:
                self._emitting.release()
            with self._lock:  # records made after the last look, by a thread that left them
                if not self._records:
                    return
