"""Fair sharing of the adapter cache between tenants (issue 24): shares counted by ownership,
limits from each tenant's policy, eviction from the owners over their fair part, and the churn
attack (one tenant registering new versions in a loop and sending traffic to each).

The cache's rules are exercised here over a stand-in placement that keeps slots as a set, so a
thousand adapters and tens of thousands of requests run in seconds; the stand-in also checks,
on every unload, that no live lease holds the adapter. The same rules through the real engine,
registry projections and ticket are in ``test_owner_accounting_through_the_service``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.serving.cache import AdapterCache, CacheBudgets, CacheClaim, CacheQuota, CacheRefused
from backend.serving.lease import Lease
from backend.serving.service import IncomingRequest, LoraService
from control.contracts.config import Settings
from control.domain import TenantPolicy
from tests.integration.conftest import ACTOR
from tests.serving_home import Home, Sink, provision_home

SLOT = 1_000  # bytes per device slot in the stand-in
HOST = 400  # bytes of one adapter's prepared tensors on the host


@dataclass
class _Prepared:
    nbytes: int


class Slots:
    """A stand-in for the engine's slots: which digests are placed, and a check that none is
    unloaded while a lease holds it (``held`` is the test's own count of live leases)."""

    def __init__(self, slots: int) -> None:
        self.max_adapters = slots
        self.placed: set[str] = set()
        self.held: Counter[str] = Counter()
        self.unloaded_while_held: list[str] = []
        self.lock = threading.Lock()

    def read_adapter(self, source: Any) -> _Prepared:
        return _Prepared(HOST)

    def prepare(self, adapter: _Prepared) -> _Prepared:
        return adapter

    def place(self, digest: str, adapter: _Prepared) -> int:
        with self.lock:
            assert digest not in self.placed and len(self.placed) < self.max_adapters
            self.placed.add(digest)
        return SLOT

    def unload_adapter(self, digest: str) -> None:
        with self.lock:
            if self.held[digest] > 0:
                self.unloaded_while_held.append(digest)
            self.placed.discard(digest)

    def slot_bytes_for(self, adapter: _Prepared) -> int:
        return SLOT

    @property
    def plan(self) -> Any:
        raise AssertionError("the tests give the device budget")


def _cache(slots: int, *, host_slots: int | None = None, quota: CacheQuota | None = None
           ) -> tuple[AdapterCache, Slots]:
    placement = Slots(slots)
    cache = AdapterCache(placement, lambda d: {"adapter_model.safetensors": b"x" * 100},
                         budgets=CacheBudgets(device_bytes=SLOT * slots,
                                              host_bytes=HOST * (host_slots or 4 * slots),
                                              store_bytes=10**9),
                         quota=quota or CacheQuota(loads_per_minute=1e6, load_burst=10**6,
                                                   room_wait_s=0.0))
    return cache, placement


def _digest(tenant: str, i: int) -> str:
    return f"sha256:{tenant}-{i:06d}"


# -- ownership ---------------------------------------------------------------------------------

def test_an_adapter_counts_against_its_owner_not_the_tenant_that_loaded_it() -> None:
    cache, slots = _cache(8, quota=CacheQuota(resident_share=0.25, loads_per_minute=1e6,
                                              load_burst=10**6, room_wait_s=0.0))
    acme = [_digest("acme", i) for i in range(3)]
    globex = [_digest("globex", i) for i in range(2)]
    for d in globex:
        cache.release(cache.acquire(d, "globex"))
    # globex, granted acme's alias, loads acme's adapters: they fill acme's share (two slots of
    # eight), not globex's, so the third evicts acme's oldest and globex's own stay
    for d in acme:
        cache.release(cache.acquire(d, "globex", claim=CacheClaim("globex", "acme")))
    report = cache.report()
    assert {report[d].tenant for d in acme} == {"acme"}
    assert report[acme[0]].evictions == {"tenant_share": 1}
    assert slots.placed == {*globex, acme[1], acme[2]}


def test_an_owner_s_policy_share_and_a_requester_s_policy_rate_apply() -> None:
    cache, slots = _cache(8)
    # acme's policy gives it one slot in eight; the host's default would give it four
    for i in range(3):
        cache.release(cache.acquire(_digest("acme", i), "acme",
                                    claim=CacheClaim("acme", "acme", owner_share=0.125)))
    assert slots.placed == {_digest("acme", 2)}
    # initech's policy allows two loads a minute: a burst of two, then refused; what it
    # causes is charged to it even on acme's adapters, and acme's own rate is untouched
    asks = CacheClaim("initech", "acme", requester_loads_per_minute=2.0)
    cache.release(cache.acquire(_digest("acme", 10), "initech", claim=asks))
    cache.release(cache.acquire(_digest("acme", 11), "initech", claim=asks))
    with pytest.raises(CacheRefused) as refused:
        cache.acquire(_digest("acme", 12), "initech", claim=asks)
    assert refused.value.reason == "load_rate"
    cache.release(cache.acquire(_digest("acme", 12), "acme"))


def test_one_requester_cannot_fill_the_load_queue() -> None:
    cache, _slots = _cache(4, quota=CacheQuota(loads_per_minute=1e6, load_burst=10**6,
                                               max_pending_per_tenant=2, room_wait_s=0.0))
    gate = threading.Event()
    cache.fetch = lambda d: (gate.wait(10), {"w": b"x"})[1]  # loads block until the gate opens
    waiting = [threading.Thread(target=lambda d=d: cache.release(cache.acquire(d, "mallory")))
               for d in (_digest("mallory", 0), _digest("mallory", 1))]
    for t in waiting:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while cache._pending < 2 and time.monotonic() < deadline:  # both loads queued
            time.sleep(0.01)
        assert cache._pending == 2
        with pytest.raises(CacheRefused) as refused:
            cache.acquire(_digest("mallory", 2), "mallory")
        assert refused.value.reason == "load_queue_full"
        assert "mallory" not in str(refused.value) and "acme" not in str(refused.value)
    finally:
        gate.set()
        for t in waiting:
            t.join(10)
    cache.release(cache.acquire(_digest("acme", 0), "acme"))  # another tenant still loads


# -- the churn attack ----------------------------------------------------------------------------

VICTIMS = ("acme", "globex", "initech")
PER_VICTIM = 4  # adapters each victim uses: 12 in all, on 16 slots


def _victims_hit_rate(attacker: bool, *, requests: int = 3_000, seed: int = 7) -> float:
    """The victims' device hit rate over ``requests`` of theirs, Zipf-weighted over their
    adapters; with ``attacker``, each victim request is followed by one of the attacker's on a
    version it never used before."""
    cache, slots = _cache(16, host_slots=20)
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** 1.1 for k in range(PER_VICTIM)]
    hits = 0
    for n in range(requests):
        tenant = VICTIMS[n % len(VICTIMS)]
        d = _digest(tenant, rng.choices(range(PER_VICTIM), weights)[0])
        hits += d in slots.placed
        cache.release(cache.acquire(d, tenant))
        if attacker:
            cache.release(cache.acquire(_digest("mallory", n), "mallory"))
    assert not slots.unloaded_while_held
    return hits / requests


def test_a_tenant_churning_versions_does_not_lower_the_others_hit_rate() -> None:
    quiet = _victims_hit_rate(attacker=False)
    attacked = _victims_hit_rate(attacker=True)
    assert quiet > 0.95  # their twelve adapters fit the sixteen slots
    # within 10 % of the figure without the attacker (issue 24's bound); under the old rule
    # (global LRU, the attacker capped at half the device) it fell from 0.996 to 0.778
    assert attacked >= 0.9 * quiet, (quiet, attacked)


def test_the_churning_tenant_evicts_its_own_adapters() -> None:
    cache, slots = _cache(16, host_slots=20)
    for i in range(PER_VICTIM):
        cache.release(cache.acquire(_digest("acme", i), "acme"))
    for n in range(200):
        cache.release(cache.acquire(_digest("mallory", n), "mallory"))
    assert {_digest("acme", i) for i in range(PER_VICTIM)} <= slots.placed
    reasons = Counter(reason for r in cache.report().values() if r.tenant == "acme"
                      for reason in r.evictions)
    assert not reasons  # nothing of acme's left any tier


# -- a thousand adapters: a referenced adapter is never evicted ----------------------------------

ADAPTERS = 1_000
TENANTS = ("acme", "globex", "initech", "umbrella", "mallory")


class ThousandAdapters(RuleBasedStateMachine):
    """Requests over 1,000 adapters of five tenants on 32 slots, leases held and released in
    any order: no unload while a lease is live, each lease released once, the slots and the
    cache's own view agree, and every tier stays within its budget."""

    def __init__(self) -> None:
        super().__init__()
        self.cache, self.slots = _cache(32, host_slots=64,
                                        quota=CacheQuota(resident_share=0.5,
                                                         loads_per_minute=1e6,
                                                         load_burst=10**6, room_wait_s=0.0))
        self.leases: list[Lease] = []

    @rule(i=st.integers(0, ADAPTERS - 1), asker=st.sampled_from(TENANTS),
          share=st.sampled_from([None, 0.1, 0.5, 1.0]))
    def acquire(self, i: int, asker: str, share: float | None) -> None:
        owner = TENANTS[i % len(TENANTS)]
        d = _digest(owner, i)
        try:
            lease = self.cache.acquire(d, asker,
                                       claim=CacheClaim(asker, owner, owner_share=share))
        except CacheRefused as e:
            assert e.reason in ("no_room", "tenant_share")
            return
        self.slots.held[d] += 1
        self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(k=st.integers(0, 10**6), twice=st.booleans())
    def release(self, k: int, twice: bool) -> None:
        lease = self.leases.pop(k % len(self.leases))
        assert lease.digest is not None
        self.slots.held[lease.digest] -= 1
        self.cache.release(lease)
        if twice:  # a second release changes nothing, and is counted
            before = self.cache.violations.snapshot()["double_release"]
            self.cache.release(lease)
            assert self.cache.violations.snapshot()["double_release"] == before + 1

    @invariant()
    def consistent(self) -> None:
        assert not self.slots.unloaded_while_held
        report = self.cache.report()
        assert {d for d, r in report.items() if r.tier == "device"} == self.slots.placed
        assert self.cache.references() == sum(self.slots.held.values())
        usage = self.cache.usage()
        assert usage["device"] <= self.cache.budgets.device_bytes
        assert usage["host"] <= self.cache.budgets.host_bytes

    def teardown(self) -> None:
        for lease in self.leases:
            self.cache.release(lease)


TestThousandAdapters = ThousandAdapters.TestCase
TestThousandAdapters.settings = hsettings(max_examples=40, stateful_step_count=60,
                                          deadline=None)


# -- through the service: owner from the projections, limits from policy events -----------------

@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("fair-share-home")
    return provision_home(Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}"),
                          kit_dir)


@pytest.fixture
def service(home: Home) -> Iterator[LoraService]:
    svc = home.service(max_adapters=4)
    try:
        yield svc
    finally:
        svc.close()


def _served(svc: LoraService, home: Home, tenant: str, alias: str) -> None:
    sink = Sink()
    svc.submit(IncomingRequest(b"Hello", home.ticket(tenant, alias), max_tokens=2), sink)
    answer = sink.wait()
    assert answer.ok, answer.error


def test_owner_accounting_through_the_service(home: Home, service: LoraService) -> None:
    """globex, granted acme's alias, loads acme's adapter: the host counts it against acme (the
    release's owner in the projections); acme's and globex's policies set the limits."""
    home.registry.grant("globex", "acme-alpha", actor=ACTOR)
    home.registry.set_policy("acme", TenantPolicy(resident_share=0.25), actor=ACTOR)
    home.registry.set_policy("globex", TenantPolicy(loads_per_minute=1.0), actor=ACTOR)
    state = service.governance.current()
    alpha, beta = home.digests["alpha"], home.digests["beta"]
    assert state.cache_limits["acme"].resident_share == 0.25
    assert state.cache_limits["globex"].loads_per_minute == 1.0
    _served(service, home, "globex", "acme-alpha")  # globex's one load of the minute
    assert service.cache.report()[alpha].tenant == "acme"
    # acme's share (a quarter of four slots) holds one adapter: its beta evicts its alpha
    _served(service, home, "acme", "acme-beta")
    report = service.cache.report()
    assert report[beta].tenant == "acme" and report[alpha].evictions == {"tenant_share": 1}
    # globex has spent its minute's load: a cold load it would cause is refused, generically
    sink = Sink()
    service.submit(IncomingRequest(b"Hello", home.ticket("globex", "acme-alpha"),
                                   max_tokens=2), sink)
    refused = sink.wait()
    assert not refused.ok and refused.status == "unavailable"
    assert "acme" not in refused.error and "sha256" not in refused.error


# -- operator visibility -------------------------------------------------------------------------

def test_tier_gauges_on_the_metrics_port(tmp_path: Path) -> None:
    from backend.triton.metrics import BackendMetrics
    from control.contracts.db import make_engine
    from control.contracts.ledger import Ledger

    cache, _slots = _cache(2, host_slots=3, quota=CacheQuota(
        resident_share=1.0, loads_per_minute=1e6, load_burst=10**6, room_wait_s=0.0))
    for i in range(4):  # two on the device, three parsed on the host, four verified files
        cache.release(cache.acquire(_digest("acme", i), "acme"))
    metrics = BackendMetrics(None, Ledger(make_engine(f"sqlite:///{tmp_path / 'l.db'}")).engine,
                             "h", cache_tiers=cache.tiers)
    metrics.refresh_memory()
    usage = cache.usage()

    def gauge(name: str, tier: str) -> float:
        return metrics.value(f"loraplane_backend_cache_tier_{name}", tier=tier)

    assert [gauge("adapters", t) for t in ("device", "host", "store")] == [2, 3, 4]
    for tier in ("device", "host", "store"):
        assert gauge("bytes", tier) == usage[tier]
    assert gauge("budget_bytes", "device") == 2 * SLOT
    assert gauge("budget_bytes", "host") == 3 * HOST
    assert metrics.value("loraplane_backend_cache_pending_loads") == 0
