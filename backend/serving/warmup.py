"""The warm-up after a restart: load the adapters the host held before traffic arrives.

A restarted host starts with empty slots, so its first request on every hot adapter pays a cold
load. With ``LORAPLANE_WARMUP_ADAPTERS`` = N (default 0: off), the host reads its own load
records (``adapter_loads``, its rows only under row-level security) for the adapters its slots
held when it last ran, most recently loaded first, and loads up to N of them on a background
thread while it already serves.

Governance decides first, as for a request, from the same snapshot: an adapter that is revoked,
that no release names any more, or whose owner's placement no longer allows this host (a tenant
moved to a dedicated pool, or out of this region) is skipped. A preload counts against the
owner's resident share and spends the owner's load rate, like the owner's own request would;
it never takes more than the cache gives (a refusal only ends that preload). The host's log
says what was preloaded and what was skipped, by reason, never by tenant.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from backend.serving.cache import AdapterCache, CacheClaim, CacheRefused
from projections.host_view import GovernanceState

log = logging.getLogger("loraplane.warmup")


class WarmupService(Protocol):
    @property
    def cache(self) -> AdapterCache: ...
    @property
    def host(self) -> str: ...


@dataclass
class WarmupReport:
    """What one warm-up did: digests loaded, skipped by reason, and how long it took."""

    wanted: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def allowed_here(state: GovernanceState, owner: str, pool: str, region: str) -> bool:
    """Whether ``owner``'s placement lets its adapters be held on a host of ``pool`` in
    ``region``: its dedicated pool (or the shared one) and one of its regions (or any)."""
    where = state.placements.get(owner)
    wanted_pool = where.pool if where is not None and where.pool is not None else "shared"
    regions = where.regions if where is not None else ()
    return wanted_pool == pool and (not regions or region in regions)


def warm_up(service: WarmupService, digests: list[str], state: GovernanceState, *,
            pool: str, region: str, report: WarmupReport | None = None) -> WarmupReport:
    """Preload ``digests`` in order, each one governance still allows here; blocking."""
    report = report or WarmupReport()
    report.wanted = list(digests)
    t0 = time.perf_counter()
    try:
        for digest in digests:
            owner = state.owner_of(digest)
            if digest in state.revoked:
                report.skip("revoked")
            elif owner is None:
                report.skip("no_release")
            elif not allowed_here(state, owner, pool, region):
                report.skip("placement")
            else:
                limits = state.cache_limits.get(owner)
                claim = CacheClaim(owner, owner,
                                   limits.resident_share if limits is not None else None,
                                   limits.loads_per_minute if limits is not None else None,
                                   limits.max_replicas if limits is not None else None)
                try:
                    service.cache.release(service.cache.acquire(digest, owner, claim=claim))
                    report.loaded.append(digest)
                except CacheRefused as e:
                    report.skip(e.reason)
    finally:
        report.seconds = time.perf_counter() - t0
        report.done.set()
    log.info("warm-up: preloaded %d of %d adapters in %.2f s; skipped %s", len(report.loaded),
             len(report.wanted), report.seconds, report.skipped or "none")
    return report
