"""What the adapter cache does for governance: revocation, and shedding an adapter whose
replica claim this host lost; the slot-emptying both share.

A base of ``backend.serving.cache.AdapterCache``, kept apart so each reads on its own: every
method here takes the engine's lock before the cache's (see ``AdapterCache._place``), and an
entry it marks (revoked, or unclaimed) takes no new reference and leaves its slot when its last
request ends.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from backend.serving.cache_entries import CacheEntry, RecordOutbox, drop_tier, holds


class ReplicaClaimer(Protocol):
    """This host's claims on bounded adapters' replicas (``backend.serving.replicas``)."""

    def claim(self, digest: str, bound: int | None, *, for_owner: bool) -> None: ...
    def unloaded(self, digest: str) -> None: ...


class SlotHolder(Protocol):
    """What emptying a slot needs of the engine."""

    def unload_adapter(self, digest: str) -> None: ...


class CacheGovernance:
    """Revocation and replica shedding over the cache's entries (the cache's lock guards
    them)."""

    engine: SlotHolder
    replicas: ReplicaClaimer | None
    on_purge: Callable[[str], object]
    clock: Callable[[], float]
    _lock: threading.Condition
    _entries: OrderedDict[str, CacheEntry]
    _device: OrderedDict[str, CacheEntry]
    _outbox: RecordOutbox

    def revoke(self, digest: str) -> None:
        """Purge ``digest`` from every tier; unload it now or when its last request ends."""
        with self._engine_lock(), self._lock:  # the engine's lock first (see _place)
            e = self._entries.get(digest)
            if e is None:
                e = self._entries[digest] = CacheEntry(digest)
            e.revoked = True
            for tier in ("host", "store"):
                if holds(e, tier):
                    drop_tier(e, tier)
                    e.evictions["revoked"] = e.evictions.get("revoked", 0) + 1
            if e.on_device and e.refs == 0:
                self._unload(e, "revoked")
        self._outbox.emit()
        self.on_purge(digest)

    def replica_need(self, digest: str, idle_s: float | None = None) -> tuple[int, bool] | None:
        """The replica bound a claim on ``digest`` needs now, and whether the owner's own
        requests asked for it here: None when it is neither in a slot nor loading here (its
        claim may go), or when it has no bound. ``idle_s``: a bounded adapter that no request
        has used for that long leaves its slot now (eviction reason ``replica_idle``) and its
        claim may go: a host the balancer no longer sends its requests to (they moved back
        after a failover) must not keep one of its few places from the host they go to."""
        with self._lock:
            e = self._entries.get(digest)
            if e is None or e.revoked or e.max_replicas is None or not (
                    e.on_device or e.loading is not None):
                return None
            if not self._idle(e, idle_s):
                return e.max_replicas, e.owner_asked
        with self._engine_lock(), self._lock:  # the engine's lock first (see _place)
            if not self._idle(e, idle_s):  # a request took it meanwhile
                return (e.max_replicas, e.owner_asked) if e.max_replicas is not None else None
            self._unload(e, "replica_idle")
        self._outbox.emit()
        return None

    def _idle(self, e: CacheEntry, idle_s: float | None) -> bool:
        return (idle_s is not None and e.on_device and e.refs == 0 and e.loading is None
                and self.clock() - e.last_used >= idle_s)

    def shed(self, digest: str) -> None:
        """This host lost its claim on one of ``digest``'s replicas: take no new request for it
        here, and leave its slot now or when its last request ends (as a revocation does)."""
        with self._engine_lock(), self._lock:  # the engine's lock first (see _place)
            e = self._entries.get(digest)
            if e is None or not e.on_device:
                return
            e.claimed = False
            if e.refs == 0:
                self._unload(e, "max_replicas")
        self._outbox.emit()

    def is_revoked(self, digest: str) -> bool:
        with self._lock:
            e = self._entries.get(digest)
            return bool(e and e.revoked)

    def _engine_lock(self) -> AbstractContextManager[object]:
        """The engine's own lock, when it has one (``placement_lock``): taken before the
        cache's wherever a slot is filled or emptied."""
        lock = getattr(self.engine, "placement_lock", None)
        return lock if lock is not None else nullcontext()

    def _unload(self, x: CacheEntry, reason: str) -> None:
        self.engine.unload_adapter(x.digest)
        x.on_device, x.device_bytes, x.claimed, x.owner_asked = False, 0, False, False
        self._device.pop(x.digest, None)
        x.evictions[reason] = x.evictions.get(reason, 0) + 1
        self._outbox.add((x.digest, "unloaded", time.time(), 0.0, None, reason))
        if self.replicas is not None:
            self.replicas.unloaded(x.digest)
