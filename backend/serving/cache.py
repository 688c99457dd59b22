"""The governed adapter cache: which adapters are on the device, on the host, or staged.

Three tiers, each with a byte budget:

- ``device``: the adapter sits in an engine slot (bytes = one whole slot: the engine allocates
  its slot banks in full, see ``backend.serving.memory``, so a slot costs the same whatever it
  holds);
- ``host``: parsed and validated tensors on the host, ready to place (bytes = those tensors);
- ``store``: the adapter's files were verified against its digest in the artifact store and this
  host may read them (bytes = the files). The shared store itself is never deleted from; leaving
  this tier only means the next load verifies the files again.

Rules: least recently used among *unreferenced* adapters goes first; an adapter referenced by a
queued or running request is never evicted or unloaded; cold loads go through a bounded queue and
run on kept load workers, one intra-op thread each
(``backend.serving.load_workers``); each tenant may hold at most ``resident_share`` of the device
budget (never less than one slot, so every tenant can be served whenever the budget holds an
adapter at all) and start at most ``loads_per_minute`` cold loads, so one tenant churning versions
cannot push everyone out.

Fair sharing (issue 24) is by ownership: an adapter's bytes count against the tenant that owns it
(the release owner the ticket's verified ``release`` claim names), never against the tenant whose
request happened to load it first, so a tenant granted another's alias neither fills its own share
with them nor frees the owner's. A cold load spends the *requester's* load rate and pending-load
allowance (whoever causes the work pays for it). Each tenant's share and rate come from its policy
(``TenantPolicy.resident_share`` / ``loads_per_minute``, carried in a :class:`CacheClaim`); the
host's settings are the defaults. When a tier is full, the victim is the least recently used
unreferenced adapter among the owners holding more than their fair part of that tier: the tier
split between the owners resident in it (and the one loading) in proportion to their shares. Only
when no owner is over its part does plain LRU decide. So a tenant that churns versions evicts its
own adapters, and every other tenant keeps at least its fair part of the device and host tiers.

The device budget is, unless given, what the engine's slot banks hold
(``LORAPLANE_ADAPTER_BYTES``, see ``backend.serving.memory``); an adapter larger than it is refused
as ``device_budget``.
Revocation purges every tier at once and unloads from the device as soon as no request holds it.
A revoked digest stays in the cache as a tombstone: nothing can load it again, not even a request
that passed the revocation check just before the revocation landed.

An adapter whose owner bounds its replicas (``TenantPolicy.max_replicas``) is placed only after
this host claims one of them (``backend.serving.replicas``, from the load worker, before the
store is read); one whose claim is lost, or was never made because the bound came later, takes no
request until it is claimed and leaves its slot when its last request ends
(``backend.serving.cache_governance``).

References are held through :class:`backend.serving.lease.Lease` handles, released exactly once; a
count
that would go negative raises :class:`backend.serving.lease.InvariantViolation` and is counted,
never
clamped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

from backend.serving import load_workers
from backend.serving.cache_entries import (
    CacheEntry,
    LoadEvent,
    RecordOutbox,
    bytes_in,
    dir_bytes,
    evict_for_device,
    forget_cold,
    holds,
    make_tier_room,
)
from backend.serving.cache_governance import CacheGovernance, ReplicaClaimer
from backend.serving.engine import AdapterSource, HostAdapter, PreparedAdapter
from backend.serving.fair_share import (
    CacheClaim,
    CacheQuota,
    CacheRefused,
    FairShare,
)
from backend.serving.lease import Lease, Violations
from backend.serving.load_workers import LoadWorkers
from backend.serving.memory import MemoryPlan
from control.contracts.config import ADAPTER_BYTES_ENV

log = logging.getLogger("loraplane.cache")

__all__ = ["AdapterCache", "CacheBudgets", "CacheClaim", "CacheQuota", "CacheRefused",
           "DigestReport"]


class AdapterPlacement(Protocol):
    """What the cache needs of the engine."""

    def read_adapter(self, source: AdapterSource) -> HostAdapter: ...
    def prepare(self, adapter: HostAdapter) -> PreparedAdapter: ...
    def place(self, digest: str, adapter: PreparedAdapter) -> int: ...
    def unload_adapter(self, digest: str) -> None: ...
    def slot_bytes_for(self, adapter: PreparedAdapter) -> int: ...
    @property
    def max_adapters(self) -> int: ...
    @property
    def plan(self) -> MemoryPlan: ...


@dataclass(frozen=True)
class CacheBudgets:
    """Byte budgets per tier; ``device_bytes`` None: what the engine's slot banks hold."""

    device_bytes: int | None = None
    host_bytes: int = 1024 * 2**20
    store_bytes: int = 4096 * 2**20


@dataclass
class DigestReport:
    """What the cache knows of one digest (operators' view)."""

    digest: str
    tier: str  # device | host | store | none
    tenant: str | None
    resident_bytes: int
    host_bytes: int
    store_bytes: int
    active_requests: int
    hits: int
    misses: int
    loads: int
    load_failures: int
    last_load_seconds: float | None
    evictions: dict[str, int]
    revoked: bool


class AdapterCache(CacheGovernance):
    """Budgets, LRU, references and tenant limits over the engine's adapter slots."""

    engine: AdapterPlacement

    def __init__(
        self,
        engine: AdapterPlacement,
        fetch: Callable[[str], AdapterSource],
        *,
        budgets: CacheBudgets | None = None,
        quota: CacheQuota | None = None,
        on_event: LoadEvent | None = None,
        on_purge: Callable[[str], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        violations: Violations | None = None,
    ) -> None:
        self.engine = engine
        # One count of broken invariants per host: the engine's, when it keeps one.
        found = getattr(engine, "violations", None)
        self.violations = violations or (found if isinstance(found, Violations)
                                         else Violations())
        # digest -> the adapter's verified files; the store hands over the very bytes it
        # hashed, so nothing can change between the check and the parse
        self.fetch = fetch
        budgets = budgets or CacheBudgets()
        self._device_budget = (engine.plan.adapter_capacity_bytes
                               if budgets.device_bytes is None else budgets.device_bytes)
        self.budgets = replace(budgets, device_bytes=self._device_budget)
        self.quota = quota or CacheQuota()
        self.on_event = on_event if on_event is not None else (lambda *_: None)
        self.on_purge = on_purge if on_purge is not None else (lambda _d: None)
        self.clock = clock
        self._lock = threading.Condition()
        # load records made under the lock, handed to on_event after it, in order
        self._outbox = RecordOutbox(self._lock, lambda: self.on_event)
        self._refs = 0  # every entry's refs together
        self._room_changes = 0  # counts the moments room may have come (a load waiting looks)
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # LRU order: oldest first
        # The device-resident ones, in the same order: what an eviction looks through holding
        # the engine's lock (the slots, not every digest the cache remembers)
        self._device: OrderedDict[str, CacheEntry] = OrderedDict()
        self._pending = 0
        self._fair = FairShare(self.quota, clock)  # per-tenant shares, rates, queue parts
        # Loads run on kept, confined threads, shared by the process's caches: one intra-op
        # thread each (backend.serving.load_workers), so their tensor work does not spread
        # over the cores decoding runs on.
        self._workers: LoadWorkers = load_workers.SHARED
        # This host's claims on bounded adapters' replicas (backend.serving.replicas; None:
        # every adapter unbounded here)
        self.replicas: ReplicaClaimer | None = None

    # -- requests ---------------------------------------------------------------------------

    def acquire(self, digest: str, tenant: str | None, timeout_s: float = 120.0, *,
                claim: CacheClaim | None = None) -> Lease:
        """Reference ``digest`` and make it device-resident; blocks while it loads.

        ``claim`` says who owns the adapter and who asks (None: ``tenant`` is both). The
        reference is taken before any load starts, so the adapter cannot be evicted between
        being placed and being used; the returned lease gives it back, once. Raises
        ``CacheRefused`` (and holds nothing) on failure, or when the load takes longer than
        ``timeout_s`` (the reference goes when it ends).
        """
        pending = self.acquire_async(digest, tenant, claim=claim)
        try:
            return pending.result(timeout=timeout_s)
        except FutureTimeout:
            if pending.cancel():  # the load's end gives the reference back (_settle)
                raise CacheRefused("load_failed", "adapter load timed out") from None
            return pending.result()  # it ended meanwhile

    def acquire_async(self, digest: str, tenant: str | None, *,
                      claim: CacheClaim | None = None) -> Future[Lease]:
        """As :meth:`acquire`, without waiting: a future of the lease, done at once when the
        adapter is resident (or refused), else when its load ends (on the loading thread; a
        caller with more to do moves it elsewhere). A future cancelled before then holds
        nothing once the load ends. A refusal is the future's ``CacheRefused``."""
        claim = claim or CacheClaim(tenant, tenant)
        out: Future[Lease] = Future()
        try:
            with self._lock:
                e = self._entries.get(digest)
                if e is not None and e.revoked:
                    raise CacheRefused("revoked", "adapter revoked")
                if e is None:
                    e = self._entries[digest] = CacheEntry(digest, claim.owner)
                elif claim.owner is not None:
                    e.tenant = claim.owner  # the verified owner, whoever loaded it before
                e.max_replicas = claim.owner_max_replicas
                e.last_used = self.clock()
                if claim.requester is not None and claim.requester == claim.owner:
                    e.owner_asked = True
                self._fair.note_share(claim.owner, claim.owner_share)
                self._entries.move_to_end(digest)
                if e.on_device and not e.unclaimed:
                    self._device.move_to_end(digest)
                    e.hits += 1
                    e.refs += 1
                    self._refs += 1
                    out.set_result(self._lease(digest))
                    return out
                e.misses += 1
                future = e.loading
                if future is None:
                    self._fair.admit(claim, self._pending)
                    future = e.loading = Future()
                    self._pending += 1
                    self._fair.started(claim.requester)
                    self._workers.submit(partial(self._load, e, claim.requester, future))
                e.refs += 1
                self._refs += 1
        except CacheRefused as refused:
            out.set_exception(refused)
            return out
        future.add_done_callback(partial(self._settle, digest, out))
        return out

    def _settle(self, digest: str, out: Future[Lease], load: Future[None]) -> None:
        """The load ``out`` waited on ended: its lease, or its reference back and the refusal."""
        if not out.set_running_or_notify_cancel():  # its caller gave up: nothing is held
            self._drop_ref(digest)
            return
        exc = load.exception()
        if exc is None:
            out.set_result(self._lease(digest))
            return
        self._drop_ref(digest)
        out.set_exception(exc if isinstance(exc, CacheRefused)
                          else CacheRefused("load_failed", "adapter could not be loaded"))

    def _lease(self, digest: str) -> Lease:
        lease = Lease(digest, self.violations)
        lease.attach(lambda: self._drop_ref(digest))
        return lease

    def release(self, lease: Lease) -> None:
        """Release a request's lease: its reference goes; a revoked adapter unloads when the
        last one goes. Releasing a lease again changes nothing (counted as a violation)."""
        lease.release()

    def references(self) -> int:
        """References held by live leases, all adapters together (0 when idle); counted as
        they come and go (the metrics read it after every batch)."""
        with self._lock:
            return self._refs

    def _drop_ref(self, digest: str) -> None:
        with self._lock:
            e = self._entries.get(digest)
            if e is None or e.refs < 1:
                self.violations.raise_("negative_ref", f"reference on {digest}")
            assert e is not None
            e.refs -= 1
            self._refs -= 1
            e.last_used = self.clock()
            unload = e.refs == 0 and (e.revoked or e.unclaimed) and e.on_device
            if e.refs == 0:
                self._room_changes += 1
                self._lock.notify_all()  # a load may be waiting for room
        if unload:  # the engine's lock first (see _place); a revoked entry takes no new refs
            with self._engine_lock(), self._lock:
                if e.refs == 0 and e.on_device and (e.revoked or e.unclaimed):
                    self._unload(e, "revoked" if e.revoked else "max_replicas")
        self._outbox.emit()

    # -- loading ----------------------------------------------------------------------------

    def _load(self, e: CacheEntry, requester: str | None, future: Future[None]) -> None:
        started = time.time()
        t0 = time.perf_counter()
        bound = e.max_replicas  # set by the acquire that started this load
        try:
            if self.replicas is not None:  # before the store is read: a refusal costs no load
                self.replicas.claim(e.digest, bound, for_owner=e.owner_asked)
        except CacheRefused as refused:  # not a failed load: no record counts against it
            self._ended(e, requester, future, refused)
            return
        try:
            with self._lock:
                path, host = e.path, e.host
                kept = e.on_device  # in its slot with no claim, claimed now: keep it there
                e.claimed = bound is not None
            if not kept and host is None:
                if path is None:
                    path = self.fetch(e.digest)  # store read + digest check
                    nbytes = dir_bytes(path)
                    with self._lock:
                        make_tier_room(self._entries, "store", nbytes, self.budgets.store_bytes, e,
                                       self._fair.share_of)
                        e.path, e.store_bytes = path, nbytes
                # parse, validate and convert to the slots' layout here, with no lock held:
                # placing then only copies, so a cold load does not stall decoding
                host = self.engine.prepare(self.engine.read_adapter(path))
                with self._lock:
                    make_tier_room(self._entries, "host", host.nbytes, self.budgets.host_bytes, e,
                                   self._fair.share_of)
                    e.host, e.host_bytes = host, host.nbytes
            if not kept:
                assert host is not None
                self._place(e, host, started, t0)
        except BaseException as exc:
            reason = exc.reason if isinstance(exc, CacheRefused) else type(exc).__name__[:64]
            with self._lock:
                e.load_failures += 1
                self._outbox.add((e.digest, "failed", started, time.perf_counter() - t0,
                                      None, reason))
            if self.replicas is not None:
                self.replicas.unloaded(e.digest)  # a claim made for nothing goes at once
            self._ended(e, requester, future, exc)
        else:
            self._ended(e, requester, future, None)

    def _ended(self, e: CacheEntry, requester: str | None, future: Future[None],
               exc: BaseException | None) -> None:
        """A load's end, whatever it was: the load queue's bookkeeping, its records, and its
        waiters told (``exc`` None: it is in its slot)."""
        with self._lock:
            e.loading = None
            self._pending -= 1
            self._fair.finished(requester)
            forget_cold(self._entries)
            self._room_changes += 1
            self._lock.notify_all()
        self._outbox.emit()  # its own record, and what an eviction on the way recorded
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)

    def _place(self, e: CacheEntry, host: PreparedAdapter, started: float, t0: float) -> None:
        """Evict unreferenced adapters until ``e`` fits its owner's share, the budget and the
        slots, then place it in a slot.

        The engine's lock is taken before the cache's: it is held through each batch step, and
        a load waiting for a step to end while holding the cache's lock stalled every request's
        ``acquire`` and the scheduler's lease releases behind it. When every candidate is
        referenced by queued or running requests, wait (neither lock held) up to
        ``room_wait_s`` for one to be released: those requests finish on their own, so room
        comes; a refusal only after the wait."""
        budget = self._device_budget
        need = self.engine.slot_bytes_for(host)
        if need > budget:
            raise CacheRefused("device_budget",
                               f"one adapter needs {need} bytes of device memory, the adapter "
                               f"budget ({ADAPTER_BYTES_ENV}) gives {budget}")
        deadline = time.monotonic() + self.quota.room_wait_s
        while True:
            with self._engine_lock(), self._lock:
                seen = self._room_changes
                if e.revoked:
                    raise CacheRefused("revoked", "adapter revoked")
                # At least one slot: a share smaller than an adapter would refuse its tenant
                # everything.
                share = max(int(self._fair.share_of(e.tenant) * budget), need)
                try:
                    evict_for_device(self._device, e, need, share, budget,
                                     self.engine.max_adapters, self._fair.share_of, self._unload)
                except CacheRefused:
                    if deadline - time.monotonic() <= 0:
                        raise
                else:
                    nbytes = self.engine.place(e.digest, host)
                    e.on_device, e.device_bytes = True, nbytes
                    self._device[e.digest] = e
                    e.loads += 1
                    e.last_load_seconds = seconds = time.perf_counter() - t0
                    self._outbox.add((e.digest, "loaded", started, seconds, nbytes, None))
                    return
            self._outbox.emit()  # what the attempt evicted before it found the rest referenced
            with self._lock:  # woken when a reference drops, unless one dropped meanwhile
                if self._room_changes == seen:
                    self._lock.wait(timeout=max(0.0, min(deadline - time.monotonic(), 0.5)))

    def _used(self, tier: str) -> int:
        return bytes_in(self._entries.values(), tier)

    # -- governance -------------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        """Accounted bytes per tier."""
        with self._lock:
            return {t: self._used(t) for t in ("device", "host", "store")}

    def tiers(self) -> dict[str, dict[str, int]]:
        """Per tier: adapters held, bytes and budget; and the loads queued or running now
        (under ``loads``), for operators' gauges."""
        with self._lock:
            return _tiers(self._entries.values(), self.budgets, self._pending,
                          self.quota.max_pending_loads)

    def report(self) -> dict[str, DigestReport]:
        """Per digest: tier, bytes, active requests, hits/misses, loads, evictions."""
        with self._lock:
            return {d: _report(e) for d, e in self._entries.items()}


def _tiers(entries: Iterable[CacheEntry], budgets: CacheBudgets, pending: int,
           max_pending: int) -> dict[str, dict[str, int]]:
    held = list(entries)
    out = {t: {"adapters": sum(1 for x in held if (x.on_device if t == "device"
                                                    else holds(x, t))),
               "bytes": bytes_in(held, t),
               "budget": int({"device": budgets.device_bytes, "host": budgets.host_bytes,
                              "store": budgets.store_bytes}[t] or 0)}
           for t in ("device", "host", "store")}
    out["loads"] = {"pending": pending, "max": max_pending}
    return out


def _report(e: CacheEntry) -> DigestReport:
    return DigestReport(
        digest=e.digest,
        tier="device" if e.on_device else "host" if e.host else "store" if e.path else "none",
        tenant=e.tenant, resident_bytes=e.device_bytes, host_bytes=e.host_bytes,
        store_bytes=e.store_bytes, active_requests=e.refs, hits=e.hits, misses=e.misses,
        loads=e.loads, load_failures=e.load_failures, last_load_seconds=e.last_load_seconds,
        evictions=dict(e.evictions), revoked=e.revoked)


