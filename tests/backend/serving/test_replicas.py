"""``max_replicas`` on the host: three adapter caches, each on its own kit engine (three hosts),
claiming replicas in one SQLite database through ``backend.serving.replicas``.

Shows: a bounded adapter is placed by at most its bound of hosts, and the refused host reads no
store and records no failed load; an eviction gives the claim up for another host; a claim lost
(the lease lapsed while another host took the place) sheds the adapter: no new request is served
on it, and it leaves its slot when its running request ends; claimed again, a shed adapter keeps
its slot without a reload; a tick renews the claims held and gives up those of adapters that
left in one transaction; unbounded adapters never touch the table; a database that cannot
answer refuses bounded loads only; closing gives every claim up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine as DbEngine

from backend.serving.cache import AdapterCache, CacheBudgets, CacheClaim, CacheQuota, CacheRefused
from backend.serving.engine import Engine
from backend.serving.replicas import REFUSAL_KEPT_S, ReplicaGuard
from backend.serving.service import Answer, IncomingRequest, LoraService
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.replica_claims import ReplicaTable
from control.domain import TenantPolicy
from control.tools.kit import KitManifest
from tests.artifacts import perturbed_copy
from tests.integration.conftest import ACTOR
from tests.serving_home import Sink, provision_home

BOUNDED = CacheClaim("acme", "acme", owner_max_replicas=2)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Events(list[tuple[str, str, str | None]]):
    def __call__(self, digest: str, outcome: str, _started: float, _s: float,
                 _nbytes: int | None, reason: str | None) -> None:
        self.append((digest, outcome, reason))


@dataclass
class Host:
    name: str
    engine: Engine
    cache: AdapterCache
    guard: ReplicaGuard
    events: Events
    reads: list[str]


@pytest.fixture(scope="module")
def adapters(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    manifest = KitManifest.load(kit_dir)
    root = tmp_path_factory.mktemp("replicas")
    return {"sha256:" + f"{i + 1:02x}" * 32: perturbed_copy(
        kit_dir / manifest.adapters["alpha"].path, root / f"a{i}", 1.0 + 0.01 * i)
        for i in range(3)}


@pytest.fixture
def db(tmp_path: Path) -> Iterator[DbEngine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'replicas.db'}")
    yield engine
    engine.dispose()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def hosts(kit_dir: Path, adapters: dict[str, Path], db: DbEngine,
          clock: Clock) -> Iterator[Callable[[str], Host]]:
    made: list[Host] = []

    def host(name: str, *, slots: int = 2, opener: Callable[[], ReplicaTable] | None = None,
             idle_s: float | None = None) -> Host:
        engine = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=8,
                        max_adapters=slots)
        reads: list[str] = []
        events = Events()

        def fetch(digest: str) -> Path:
            reads.append(digest)
            return adapters[digest]

        one = engine.slot_bytes_for(engine.read_adapter(next(iter(adapters.values()))))
        cache = AdapterCache(engine, fetch, budgets=CacheBudgets(one * slots, 10**9, 10**9),
                             quota=CacheQuota(resident_share=1.0, room_wait_s=0.0),
                             on_event=events)
        guard = ReplicaGuard(opener or (lambda: ReplicaTable(db, name, lease_s=9.0,
                                                             clock=clock)), 9.0, idle_s)
        cache.replicas = guard.start(cache)
        made.append(Host(name, engine, cache, guard, events, reads))
        return made[-1]

    yield host
    for h in made:
        h.guard.close()


def _eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.02)


def _refused(cache: AdapterCache, digest: str, claim: CacheClaim = BOUNDED) -> str:
    with pytest.raises(CacheRefused) as caught:
        cache.acquire(digest, "acme", claim=claim)
    return caught.value.reason


def test_a_bounded_adapter_is_placed_by_at_most_its_bound_of_hosts(
        hosts: Callable[[str], Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    a, b, c = hosts("host-a"), hosts("host-b"), hosts("host-c")
    digest = next(iter(adapters))
    for h in (a, b):
        h.cache.release(h.cache.acquire(digest, "acme", claim=BOUNDED))
    assert _refused(c.cache, digest) == "max_replicas"
    assert c.reads == [] and digest not in c.engine.resident_adapters()
    assert not [e for e in c.events if e[1] == "failed"]  # a refusal is not a failed load
    assert c.cache.references() == 0
    assert ReplicaTable(db, "reader", clock=clock).holders(digest) == ["host-a", "host-b"]
    # another adapter of the same owner is counted apart
    other = list(adapters)[1]
    c.cache.release(c.cache.acquire(other, "acme", claim=BOUNDED))


def test_an_eviction_gives_the_claim_up_for_another_host(
        hosts: Callable[..., Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    first, second, third = adapters
    a, b = hosts("host-a", slots=1), hosts("host-b")
    one = CacheClaim("acme", "acme", owner_max_replicas=1)
    a.cache.release(a.cache.acquire(first, "acme", claim=one))
    assert _refused(b.cache, first, one) == "max_replicas"
    a.cache.release(a.cache.acquire(second, "acme", claim=one))  # the only slot: first leaves
    assert any(e[:2] == (first, "unloaded") for e in a.events)
    _eventually(lambda: ReplicaTable(db, "reader", clock=clock).holders(first) == [], 1.0)
    time.sleep(REFUSAL_KEPT_S)  # host-b answers its refusal from memory that long
    b.cache.release(b.cache.acquire(first, "acme", claim=one))
    assert ReplicaTable(db, "reader", clock=clock).holders(first) == ["host-b"]
    assert third not in a.guard.held()


def test_a_lost_claim_sheds_the_adapter_after_its_running_request(
        hosts: Callable[..., Host], adapters: dict[str, Path], clock: Clock) -> None:
    digest = next(iter(adapters))
    one = CacheClaim("acme", "acme", owner_max_replicas=1)
    a, b = hosts("host-a"), hosts("host-b")
    running = a.cache.acquire(digest, "acme", claim=one)
    clock.t += 10.0  # host-a was cut off for longer than its lease: its claim lapsed
    b.cache.release(b.cache.acquire(digest, "acme", claim=one))
    a.guard.renew_once()  # back: its renewal is refused, so it sheds
    assert a.guard.lost == 1
    assert _refused(a.cache, digest, one) == "max_replicas"  # no new request here
    assert digest in a.engine.resident_adapters()  # the running one finishes on it
    a.cache.release(running)
    assert digest not in a.engine.resident_adapters()
    assert (digest, "unloaded", "max_replicas") in a.events
    assert a.cache.references() == 0


def test_a_shed_adapter_claimed_again_keeps_its_slot(
        hosts: Callable[..., Host], adapters: dict[str, Path], clock: Clock,
        db: DbEngine) -> None:
    digest = next(iter(adapters))
    one = CacheClaim("acme", "acme", owner_max_replicas=1)
    a, b = hosts("host-a"), hosts("host-b")
    running = a.cache.acquire(digest, "acme", claim=one)
    clock.t += 10.0
    b.cache.release(b.cache.acquire(digest, "acme", claim=one))
    a.guard.renew_once()
    b.guard.close()  # host-b goes away, giving its claim up
    loads = a.cache.report()[digest].loads
    a.cache.release(a.cache.acquire(digest, "acme", claim=one))  # claimed again: served
    assert a.cache.report()[digest].loads == loads  # from the slot it never left
    a.cache.release(running)
    assert digest in a.engine.resident_adapters()
    assert ReplicaTable(db, "reader", clock=clock).holders(digest) == ["host-a"]


def test_a_bound_set_after_placing_is_claimed_before_the_next_request(
        hosts: Callable[..., Host], adapters: dict[str, Path], clock: Clock,
        db: DbEngine) -> None:
    """Placed while its owner set no bound, an adapter is claimed by the next request after the
    bound comes: where another host holds the only replica, it is refused and leaves its slot;
    where the place is free, it is served from the slot it is in."""
    first, second = list(adapters)[:2]
    one = CacheClaim("acme", "acme", owner_max_replicas=1)
    a, b = hosts("host-a"), hosts("host-b")
    for digest in (first, second):
        a.cache.release(a.cache.acquire(digest, "acme"))  # no bound yet: no claim
    b.cache.release(b.cache.acquire(first, "acme", claim=one))  # the bound: b claims first
    assert _refused(a.cache, first, one) == "max_replicas"
    assert first not in a.engine.resident_adapters()
    assert (first, "unloaded", "max_replicas") in a.events
    loads = a.cache.report()[second].loads
    a.cache.release(a.cache.acquire(second, "acme", claim=one))
    assert a.cache.report()[second].loads == loads
    reader = ReplicaTable(db, "reader", clock=clock)
    assert (reader.holders(first), reader.holders(second)) == (["host-b"], ["host-a"])


def test_a_granted_tenants_traffic_never_keeps_the_owner_from_its_adapter(
        hosts: Callable[[str], Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    """acme bounds its adapter to one host and grants it to globex. globex's requests (placed
    on host-b by its own affinity, or a forged one) take the only place first; acme's own
    requests on host-a still get it, and host-b sheds it at its next renewal, so globex's next
    request there is refused. On host-a, globex's requests share acme's place."""
    a, b = hosts("host-a"), hosts("host-b")
    digest = next(iter(adapters))
    owners = CacheClaim("acme", "acme", owner_max_replicas=1)
    grantees = CacheClaim("globex", "acme", owner_max_replicas=1)
    held = b.cache.acquire(digest, "globex", claim=grantees)  # b holds it for globex
    assert _refused(a.cache, digest, grantees) == "max_replicas"  # another grantee's: refused
    a.cache.release(a.cache.acquire(digest, "acme", claim=owners))  # the owner's: served
    reader = ReplicaTable(db, "reader", clock=clock)
    assert reader.holders(digest) == ["host-a", "host-b"]
    b.guard.renew_once()  # b learns it lost its place; its running request keeps its slot
    assert reader.holders(digest) == ["host-a"] and b.guard.lost == 1
    assert digest in b.engine.resident_adapters()
    assert _refused(b.cache, digest, grantees) == "max_replicas"
    b.cache.release(held)
    assert digest not in b.engine.resident_adapters()
    a.cache.release(a.cache.acquire(digest, "globex", claim=grantees))  # shares a's place
    a.guard.renew_once()
    assert reader.holders(digest) == ["host-a"] and a.guard.lost == 0


def test_a_grantees_place_becomes_the_owners_when_the_owner_asks_there(
        hosts: Callable[[str], Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    """A place first claimed for a grantee's requests is claimed as the owner's at the next
    renewal once the owner's own requests use it there, so another host's claim for the owner
    is refused rather than taking it."""
    a, b = hosts("host-a"), hosts("host-b")
    digest = next(iter(adapters))
    owners = CacheClaim("acme", "acme", owner_max_replicas=1)
    grantees = CacheClaim("globex", "acme", owner_max_replicas=1)
    a.cache.release(a.cache.acquire(digest, "globex", claim=grantees))
    a.cache.release(a.cache.acquire(digest, "acme", claim=owners))  # served from a's slot
    a.guard.renew_once()
    assert _refused(b.cache, digest, owners) == "max_replicas"
    a.guard.renew_once()
    assert ReplicaTable(db, "reader", clock=clock).holders(digest) == ["host-a"]
    assert a.guard.lost == 0 and digest in a.engine.resident_adapters()


def test_one_renewal_transaction_holds_every_claim(
        hosts: Callable[..., Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    """A host holding three bounded adapters renews them in one call of the table per tick
    (before: one transaction per adapter every third of a lease)."""
    calls: list[tuple[str, int]] = []

    class Watched(ReplicaTable):
        def renew(self, needs: Mapping[str, tuple[int, bool]],
                  release: Iterable[str] = ()) -> set[str]:
            calls.append(("renew", len(needs)))
            return super().renew(needs, release)

        def release(self, digest: str) -> None:
            calls.append(("release", 1))
            super().release(digest)

    h = hosts("host-a", slots=3, opener=lambda: Watched(db, "host-a", clock=clock))
    for digest in adapters:
        h.cache.release(h.cache.acquire(digest, "acme", claim=BOUNDED))
    h.guard.renew_once()
    assert calls == [("renew", 3)]
    reader = ReplicaTable(db, "reader", clock=clock)
    assert all(reader.holders(d) == ["host-a"] for d in adapters)


def test_one_transaction_per_tick_renews_and_gives_up(
        hosts: Callable[..., Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    """A tick where two bounded adapters left their slot (idle) and one stays (a request runs on
    it) is one call of the table and one database transaction: the two claims are given up in
    the renewal's transaction (before: one release transaction each, then the renewal)."""
    calls: list[tuple[str, int, int]] = []
    transactions: list[str] = []
    tick = threading.current_thread()  # the guard's own thread may tick too: not counted

    class Watched(ReplicaTable):
        def renew(self, needs: Mapping[str, tuple[int, bool]],
                  release: Iterable[str] = ()) -> set[str]:
            release = list(release)
            if threading.current_thread() is tick:
                calls.append(("renew", len(needs), len(release)))
            return super().renew(needs, release)

        def release(self, digest: str) -> None:
            if threading.current_thread() is tick:
                calls.append(("release", 0, 1))
            super().release(digest)

    def began(_conn: object) -> None:
        if threading.current_thread() is tick:
            transactions.append("begin")

    h = hosts("host-a", slots=3, idle_s=0.5,
              opener=lambda: Watched(db, "host-a", clock=clock))
    *idle, busy = adapters
    for digest in idle:
        h.cache.release(h.cache.acquire(digest, "acme", claim=BOUNDED))
    running = h.cache.acquire(busy, "acme", claim=BOUNDED)
    time.sleep(0.6)  # the two others sat unused for their idle time
    sa.event.listen(db, "begin", began)
    try:
        h.guard.renew_once()
    finally:
        sa.event.remove(db, "begin", began)
    assert calls == [("renew", 1, 2)]
    assert transactions == ["begin"]
    reader = ReplicaTable(db, "reader", clock=clock)
    assert [reader.holders(d) for d in adapters] == [[], [], ["host-a"]]
    assert h.guard.held() == {busy} and h.guard.lost == 0
    h.cache.release(running)


def test_an_idle_holder_gives_its_place_up_for_the_host_its_requests_go_to(
        hosts: Callable[..., Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    """After a failover host-b holds the only place; the requests go back to host-a, which is
    refused while host-b's place stands. host-b, no longer asked, gives the place up and empties
    the slot once the adapter sat unused for its idle time, and host-a is served. While a
    request runs on it, or one came within the idle time, an adapter is never idle."""
    a, b = hosts("host-a"), hosts("host-b", idle_s=0.5)
    digest = next(iter(adapters))
    one = CacheClaim("acme", "acme", owner_max_replicas=1)
    running = b.cache.acquire(digest, "acme", claim=one)
    time.sleep(0.6)
    b.guard.renew_once()  # a request still runs on it: not idle
    assert digest in b.engine.resident_adapters()
    b.cache.release(running)
    b.guard.renew_once()  # used a moment ago
    assert ReplicaTable(db, "r", clock=clock).holders(digest) == ["host-b"]
    assert _refused(a.cache, digest, one) == "max_replicas"
    time.sleep(0.6)
    b.guard.renew_once()
    assert ReplicaTable(db, "r", clock=clock).holders(digest) == []
    assert digest not in b.engine.resident_adapters()
    assert ("unloaded", "replica_idle") in {(e[1], e[2]) for e in b.events if e[0] == digest}
    time.sleep(REFUSAL_KEPT_S)  # past the time host-a answers a refusal from memory
    a.cache.release(a.cache.acquire(digest, "acme", claim=one))


def test_a_refused_claim_is_answered_from_memory_for_a_moment(
        hosts: Callable[..., Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    """A hot adapter placed on a host past its bound asks the table once, not per request."""
    calls: list[str] = []

    class Watched(ReplicaTable):
        def claim(self, digest: str, bound: int, *, for_owner: bool = True) -> bool:
            calls.append(digest)
            return super().claim(digest, bound, for_owner=for_owner)

    a = hosts("host-a")
    b = hosts("host-b", opener=lambda: Watched(db, "host-b", clock=clock))
    digest = next(iter(adapters))
    one = CacheClaim("acme", "acme", owner_max_replicas=1)
    a.cache.release(a.cache.acquire(digest, "acme", claim=one))
    assert all(_refused(b.cache, digest, one) == "max_replicas" for _ in range(5))
    assert calls == [digest]
    # a grantee's refusal says nothing of the owner's precedence: remembered apart
    other = list(adapters)[1]
    a.cache.release(a.cache.acquire(other, "globex",
                                    claim=CacheClaim("globex", "acme", owner_max_replicas=1)))
    grantee = CacheClaim("globex", "acme", owner_max_replicas=1)
    assert [_refused(b.cache, other, grantee) for _ in range(3)] == ["max_replicas"] * 3
    assert calls == [digest, other]
    a.cache.release(a.cache.acquire(other, "acme", claim=one))  # the owner's on a: a's now
    a.guard.renew_once()
    assert _refused(b.cache, other, one) == "max_replicas"  # asked: a's claim is the owner's
    assert calls == [digest, other, other]


def test_unbounded_adapters_never_touch_the_table(
        hosts: Callable[..., Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    calls: list[str] = []

    class Watched(ReplicaTable):
        def claim(self, digest: str, bound: int, *, for_owner: bool = True) -> bool:
            calls.append("claim")
            return super().claim(digest, bound, for_owner=for_owner)

        def renew(self, needs: Mapping[str, tuple[int, bool]],
                  release: Iterable[str] = ()) -> set[str]:
            calls.append("renew")
            return super().renew(needs, release)

        def release(self, digest: str) -> None:
            calls.append("release")
            super().release(digest)

    h = hosts("host-a", opener=lambda: Watched(db, "host-a", clock=clock))
    for digest in adapters:
        h.cache.release(h.cache.acquire(digest, "acme"))  # evictions too: two slots, three
    h.guard.renew_once()
    assert calls == []


def test_a_restarted_host_gives_up_what_its_previous_run_claimed(
        hosts: Callable[..., Host], adapters: dict[str, Path], db: DbEngine,
        clock: Clock) -> None:
    digest = next(iter(adapters))
    one = CacheClaim("acme", "acme", owner_max_replicas=1)
    assert ReplicaTable(db, "host-a", clock=clock).claim(digest, 1)  # a run that died
    b = hosts("host-b")
    hosts("host-a")  # host-a again: it holds nothing, so its old claim goes at once
    _eventually(lambda: ReplicaTable(db, "r", clock=clock).holders(digest) == [], 2.0)
    b.cache.release(b.cache.acquire(digest, "acme", claim=one))


def test_a_database_that_cannot_answer_refuses_only_bounded_loads(
        hosts: Callable[..., Host], adapters: dict[str, Path]) -> None:
    def opener() -> ReplicaTable:
        raise OSError("database down")

    h = hosts("host-a", opener=opener)
    bounded, free = list(adapters)[:2]
    assert _refused(h.cache, bounded) == "replicas_unknown"
    assert h.reads == []
    h.cache.release(h.cache.acquire(free, "acme"))


def test_closing_gives_every_claim_up(hosts: Callable[..., Host], adapters: dict[str, Path],
                                      db: DbEngine, clock: Clock) -> None:
    h = hosts("host-a", slots=3)
    for digest in adapters:
        h.cache.release(h.cache.acquire(digest, "acme", claim=BOUNDED))
    reader = ReplicaTable(db, "reader", clock=clock)
    assert all(reader.holders(d) == ["host-a"] for d in adapters)
    h.guard.close()
    assert all(reader.holders(d) == [] for d in adapters)


# -- through the service: the bound from a policy event, a refusal with its ledger row ----------

def test_two_services_hold_a_bounded_adapter_once(kit_dir: Path, tmp_path: Path) -> None:
    """acme's policy bounds its adapters to one replica: of two hosts on one database, the one
    that loads acme-alpha first serves it; the other refuses it as unavailable, with the reason
    on its ledger row and nothing of the adapter in its answer, and serves globex's adapter."""
    home = provision_home(Settings(home=tmp_path, db_url=f"sqlite:///{tmp_path / 'lp.db'}"),
                          kit_dir)
    home.registry.set_policy("acme", TenantPolicy(max_replicas=1), actor=ACTOR)
    first, second = home.service(host="host-1"), home.service(host="host-2")
    try:
        assert first.governance.current().cache_limits["acme"].max_replicas == 1

        def ask(svc: LoraService, tenant: str, alias: str) -> Answer:
            sink = Sink()
            svc.submit(IncomingRequest(b"Hello", home.ticket(tenant, alias), max_tokens=2),
                       sink)
            return sink.wait()

        assert ask(first, "acme", "acme-alpha").ok
        refused = ask(second, "acme", "acme-alpha")
        assert not refused.ok and refused.status == "unavailable"
        assert "sha256" not in str(refused.error) and "acme" not in str(refused.error)
        assert ask(second, "globex", "globex-gamma").ok
        second.writer.close()
        db = make_engine(home.settings.db_url)
        rows = Ledger(db).query(tenant="acme")
        assert sorted((r.host, r.outcome, r.reason) for r in rows) == [
            ("host-1", "ok", None), ("host-2", "rejected", "adapter_max_replicas")]
        assert ReplicaTable(db, "r").holders(home.digests["alpha"]) == ["host-1"]
    finally:
        first.close()
        second.close()
