"""This host's side of ``max_replicas``: claim before placing, renew while held, give up after.

An adapter whose owner's policy bounds its replicas (``TenantPolicy.max_replicas``) is placed in
a device slot only after this host holds one of its claims
(``control.contracts.replica_claims``); the cache calls :meth:`ReplicaGuard.claim` from the load
worker, before the store is read, so a refused claim costs one database transaction and no
load. A refusal is the cache's ``CacheRefused("max_replicas")``: the request is refused as
unavailable with that reason on its ledger row, and a balancer or client tries another host.

While the adapter stays in its slot, a thread of this guard renews the claim every third of the
lease, all of this host's claims in one transaction per tick; the claims of adapters that left
their slot since the last tick are given up in that same transaction (one commit per tick, not
one per adapter that left). A claim is held for the owner's requests once the owner's own requests
ask for the adapter here (``CacheEntry.owner_asked``), which ranks it before claims held for
granted tenants only. A renewal that fails (the bound shrank; the
claim lapsed while this host was cut off and another host took the replica; or it was held for
granted tenants' requests and the owner's own requests claimed the place on another host) *sheds*
the adapter: the cache takes no new request for it here and unloads it when its last running request
ends, as a revocation does. When the cache unloads an adapter, its claim is given up at once on this
guard's thread (the cache's load records arrive under no lock, but on request and scheduler threads
that must not wait on the database): a tick of the adapters unloaded meanwhile, which renews instead
a claim whose adapter is loading or resident again by then. A release that fails is not retried:
the claim lapses within one lease.

Adapters with no bound never touch the table: a deployment that sets no ``max_replicas`` pays
one statement at start (the claims a previous process of this host left are given up: it holds
none of them now, and they would keep other hosts out until they lapsed). Without a database
answer a bounded adapter is not loaded (``replicas_unknown``): the bound is the owner's policy,
and a host that cannot count the replicas cannot keep it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from backend.serving.fair_share import CacheRefused

log = logging.getLogger("loraplane.backend.replicas")

# How long a refused claim is answered from memory (at most a third of a lease): the places are
# as taken a second later, and asking the table on every request would be one transaction each.
REFUSAL_KEPT_S = 0.25
REFUSED_MESSAGE = ("this adapter is held by as many hosts as its owner allows "
                   "(max_replicas); another host serves it")


class Claims(Protocol):
    """The claims table as this guard uses it (``control.contracts.replica_claims``)."""

    def claim(self, digest: str, bound: int, *, for_owner: bool) -> bool: ...
    def renew(self, needs: Mapping[str, tuple[int, bool]],
              release: Iterable[str] = ()) -> set[str]: ...
    def release_all(self) -> int: ...


class HeldAdapters(Protocol):
    """What the guard asks of the adapter cache."""

    def replica_need(self, digest: str, idle_s: float | None = None
                     ) -> tuple[int, bool] | None: ...
    def shed(self, digest: str) -> None: ...


class ReplicaGuard:
    """Claims, renewals and releases of this host's bounded adapters."""

    def __init__(self, open_claims: Callable[[], Claims], lease_s: float,
                 idle_s: float | None = None) -> None:
        """``open_claims`` opens the table (its leases ``lease_s`` long); called at start (to
        give up what a previous run of this host left), on the first bounded load, and again
        after a failure. ``idle_s``: a bounded adapter no request used for that long leaves
        its slot and its claim goes (None: it stays while the cache keeps it)."""
        self.open_claims, self.lease_s, self.idle_s = open_claims, lease_s, idle_s
        # (digest, for the owner?) -> until when a refusal stands without asking the table
        # again: a hot adapter placed on a host past its bound cost a transaction per request
        self._refused: dict[tuple[str, bool], float] = {}
        self._claims: Claims | None = None
        self._lock = threading.Lock()  # one claim, renewal or release at a time
        self._held: set[str] = set()
        self._unloaded: set[str] = set()
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cache: HeldAdapters | None = None
        self.lost = 0  # renewals refused: adapters shed

    def start(self, cache: HeldAdapters) -> ReplicaGuard:
        self.cache = cache
        self._thread = threading.Thread(target=self._run, name="replica-claims", daemon=True)
        self._thread.start()
        return self

    def claim(self, digest: str, bound: int | None, *, for_owner: bool) -> None:
        """Hold one of ``digest``'s replicas before placing it (``bound`` None: unbounded, no
        claim); CacheRefused when the bound is taken or cannot be counted. ``for_owner``: the
        adapter's owner's own requests ask for it (the claim ranks before grantees')."""
        if bound is None:
            return
        with self._lock:
            now = time.monotonic()
            if self._refused.get((digest, for_owner), 0.0) > now:
                raise CacheRefused("max_replicas", REFUSED_MESSAGE)
            try:
                granted = self._table().claim(digest, bound, for_owner=for_owner)
            except Exception:
                self._claims = None  # opened afresh next time
                log.warning("could not count the replicas of %s; not loading it", digest,
                            exc_info=True)
                raise CacheRefused("replicas_unknown", "adapter placement cannot be checked "
                                   "now, retry later") from None
            if not granted:
                if len(self._refused) > 4096:  # stale entries of adapters asked once
                    self._refused = {k: t for k, t in self._refused.items() if t > now}
                self._refused[(digest, for_owner)] = now + min(REFUSAL_KEPT_S, self.lease_s / 3)
                raise CacheRefused("max_replicas", REFUSED_MESSAGE)
            self._refused.pop((digest, for_owner), None)
            self._held.add(digest)

    def unloaded(self, digest: str) -> None:
        """The cache took ``digest`` out of its slot: give its claim up soon (on this guard's
        thread; no database work on the caller's)."""
        with self._wake:
            if digest in self._held:
                self._unloaded.add(digest)
                self._wake.notify()

    def held(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def renew_once(self) -> None:
        """Renew every claim held, give up those whose adapter left, shed those refused."""
        with self._wake:
            self._unloaded.clear()
        self._renew(self.held())

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop renewing and give every claim up (another host may take them at once)."""
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._lock:
            gone, self._held = sorted(self._held), set()
            if gone:
                try:  # one transaction for all of them
                    self._table().renew({}, release=gone)
                except Exception:  # they lapse on their own within one lease
                    self._claims = None
                    log.warning("could not give up this host's replica claims", exc_info=True)

    # -- on the guard's thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:  # what a previous process of this host claimed: it holds none of it now
            with self._lock:
                if not self._held and self._table().release_all():
                    log.info("gave up the replica claims a previous run of this host left")
        except Exception:  # they lapse on their own within one lease
            self._claims = None
            log.warning("could not clear this host's old replica claims", exc_info=True)
        while not self._stop.is_set():
            with self._wake:
                if not self._unloaded:
                    self._wake.wait(self.lease_s / 3)
                gone, self._unloaded = self._unloaded, set()
            if self._stop.is_set():
                return
            try:
                if gone:
                    self._renew(gone)  # gives them up unless they are back in a slot
                else:
                    self.renew_once()
            except Exception:  # a database outage: the claims lapse, loads are refused
                log.warning("could not renew this host's replica claims", exc_info=True)

    def _renew(self, digests: Iterable[str]) -> None:
        """One tick over ``digests`` still held here, in one transaction: renew the claims whose
        adapter is in its slot (or loading), give up those whose adapter left, and shed those
        refused."""
        assert self.cache is not None
        with self._lock:
            needs: dict[str, tuple[int, bool]] = {}
            gone: list[str] = []
            for digest in sorted(set(digests) & self._held):
                # read under this lock: a load that starts after it claims again once free
                need = self.cache.replica_need(digest, self.idle_s)
                if need is None:
                    gone.append(digest)
                else:
                    needs[digest] = need
            if not needs and not gone:
                return
            # Not held from now, whatever the table answers: given up, or (the transaction
            # failed) lapsing within one lease; a load that comes meanwhile claims again.
            self._held.difference_update(gone)
            try:
                lost = self._table().renew(needs, release=gone)
            except Exception:
                self._claims = None
                raise
            # Their rows are gone: the others fill the bound (or an owner's claim outranks a
            # grantee's one), and this host still holds each until its running requests end.
            # A request that comes meanwhile claims it again, or is refused.
            self._held -= lost
        for digest in sorted(lost):
            self.lost += 1
            log.warning("lost this host's replica claim on %s: shedding it", digest)
            self.cache.shed(digest)

    def _table(self) -> Claims:
        if self._claims is None:
            self._claims = self.open_claims()
        return self._claims
