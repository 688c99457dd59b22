"""The governed adapter cache: budgets, LRU, references, tenant limits, revocation, report."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.serving.cache import AdapterCache, CacheBudgets, CacheQuota, CacheRefused
from backend.serving.engine import Engine
from control.tools.kit import KitManifest
from tests.artifacts import perturbed_copy

NAMES = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def adapters(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    manifest = KitManifest.load(kit_dir)
    root = tmp_path_factory.mktemp("cache")
    return {"sha256:" + f"{i:02x}" * 32: perturbed_copy(
        kit_dir / manifest.adapters[NAMES[i % 3]].path, root / f"a{i}", 1.0 + 0.01 * i)
        for i in range(6)}


@pytest.fixture
def engine(kit_dir: Path) -> Engine:
    return Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=8,
                  max_adapters=8)


def _per_adapter(engine: Engine, path: Path) -> int:
    return engine.slot_bytes_for(engine.read_adapter(path))


class Events(list[tuple[str, str, str | None]]):
    def __call__(self, digest: str, outcome: str, _started: float, _s: float,
                 _nbytes: int | None, reason: str | None) -> None:
        self.append((digest, outcome, reason))


def _cache(engine: Engine, adapters: dict[str, Path], *, device_slots: int,
           quota: CacheQuota | None = None, events: Events | None = None) -> AdapterCache:
    one = _per_adapter(engine, next(iter(adapters.values())))
    return AdapterCache(engine, adapters.__getitem__,
                        budgets=CacheBudgets(device_bytes=one * device_slots,
                                             host_bytes=10**9, store_bytes=10**9),
                        quota=quota or CacheQuota(resident_share=1.0, room_wait_s=0.0),
                        on_event=events)


def test_accounting_matches_real_tensor_bytes(engine: Engine,
                                              adapters: dict[str, Path]) -> None:
    cache = _cache(engine, adapters, device_slots=4)
    digests = list(adapters)[:3]
    for d in digests:
        cache.release(cache.acquire(d, "acme"))
    usage = cache.usage()
    real_device = sum(t.numel() * t.element_size() for d in digests
                      for t in engine.slot_tensors(d))
    real_host = sum(engine.read_adapter(adapters[d]).nbytes for d in digests)
    real_files = sum(p.stat().st_size for d in digests for p in adapters[d].rglob("*")
                     if p.is_file())
    assert abs(usage["device"] - real_device) <= 0.05 * real_device
    assert abs(usage["host"] - real_host) <= 0.05 * real_host
    assert usage["store"] == real_files


def test_lru_evicts_only_unreferenced_adapters(engine: Engine,
                                               adapters: dict[str, Path]) -> None:
    events = Events()
    cache = _cache(engine, adapters, device_slots=2, events=events)
    a, b, c, d = list(adapters)[:4]
    held = cache.acquire(a, "acme")  # a running request holds a
    cache.release(cache.acquire(b, "acme"))
    cache.release(cache.acquire(c, "acme"))  # evicts b (unreferenced), never a
    assert set(engine.resident_adapters()) == {a, c}
    assert (b, "unloaded", "device_budget") in events
    lease_c = cache.acquire(c, "acme")
    with pytest.raises(CacheRefused) as e:  # a and c both referenced: no room, nothing evicted
        cache.acquire(d, "acme")
    assert e.value.reason == "no_room"
    assert set(engine.resident_adapters()) == {a, c}
    cache.release(held)
    cache.release(lease_c)
    cache.release(cache.acquire(d, "acme"))  # now the least recently used (a) goes
    assert set(engine.resident_adapters()) == {c, d}
    report = cache.report()
    assert report[a].evictions == {"device_budget": 1}
    assert report[c].hits == 1 and report[c].misses == 1
    assert report[b].tier == "host"  # evicted from the device, still parsed on the host
    assert report[d].resident_bytes == engine.resident_adapters()[d]
    assert report[d].last_load_seconds is not None and report[d].active_requests == 0


def test_tenant_share_keeps_one_tenant_from_pushing_out_another(
        engine: Engine, adapters: dict[str, Path]) -> None:
    cache = _cache(engine, adapters, device_slots=4,
                   quota=CacheQuota(resident_share=0.5, room_wait_s=0.0))
    a, b, c, d, e = list(adapters)[:5]
    cache.release(cache.acquire(a, "globex"))
    cache.release(cache.acquire(b, "globex"))
    for x in (c, d, e):  # acme churns three versions in a two-adapter share
        cache.release(cache.acquire(x, "acme"))
    resident = set(engine.resident_adapters())
    assert {a, b} <= resident  # globex's adapters stayed
    assert cache.report()[c].evictions == {"tenant_share": 1}


def test_load_rate_and_bounded_load_queue(engine: Engine, adapters: dict[str, Path]) -> None:
    cache = _cache(engine, adapters, device_slots=8,
                   quota=CacheQuota(resident_share=1.0, loads_per_minute=0.001, load_burst=2))
    a, b, c = list(adapters)[:3]
    cache.release(cache.acquire(a, "acme"))
    cache.release(cache.acquire(b, "acme"))
    with pytest.raises(CacheRefused) as e:
        cache.acquire(c, "acme")
    assert e.value.reason == "load_rate"
    cache.release(cache.acquire(c, "globex"))  # another tenant's budget is its own
    cache.release(cache.acquire(a, "acme"))  # hits cost no load
    queued = _cache(engine, adapters, device_slots=8,
                    quota=CacheQuota(resident_share=1.0, max_pending_loads=0))
    with pytest.raises(CacheRefused) as e:
        queued.acquire(list(adapters)[4], "acme")
    assert e.value.reason == "load_queue_full"


def test_revocation_purges_and_drains(engine: Engine, adapters: dict[str, Path]) -> None:
    events = Events()
    purged: list[str] = []
    cache = _cache(engine, adapters, device_slots=4, events=events)
    cache.on_purge = purged.append
    a = next(iter(adapters))
    lease = cache.acquire(a, "acme")  # a running request
    cache.revoke(a)
    assert purged == [a]
    assert a in engine.resident_adapters()  # drains: the running request finishes on it
    with pytest.raises(CacheRefused) as e:
        cache.acquire(a, "acme")
    assert e.value.reason == "revoked"
    cache.release(lease)
    assert a not in engine.resident_adapters()
    assert (a, "unloaded", "revoked") in events
    assert cache.usage() == {"device": 0, "host": 0, "store": 0}


def test_failed_load_is_reported_and_holds_nothing(engine: Engine, adapters: dict[str, Path],
                                                   tmp_path: Path) -> None:
    events = Events()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    digest = "sha256:" + "ee" * 32
    cache = AdapterCache(engine, lambda _d: bad, on_event=events)
    with pytest.raises(CacheRefused) as e:
        cache.acquire(digest, "acme")
    assert e.value.reason == "load_failed"
    r = cache.report()[digest]
    assert r.load_failures == 1 and r.active_requests == 0 and r.tier == "store"
    assert events[-1][:2] == (digest, "failed")
    assert engine.resident_adapters() == {}


def test_a_load_waits_for_a_referenced_slot_to_be_released(engine: Engine,
                                                           adapters: dict[str, Path]) -> None:
    import threading

    cache = _cache(engine, adapters, device_slots=2,
                   quota=CacheQuota(resident_share=1.0, room_wait_s=30.0))
    a, b, c = list(adapters)[:3]
    held = [cache.acquire(a, "acme"), cache.acquire(b, "acme")]  # both slots referenced
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(cache.acquire(c, "acme")))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and c not in engine.resident_adapters()  # waiting, not refused
    cache.release(held[1])  # b's last request ends: its slot may be reused
    waiter.join(10)
    assert not waiter.is_alive() and len(got) == 1
    assert set(engine.resident_adapters()) == {a, c}  # b evicted, a (still held) never
    cache.release(held[0])
    cache.release(got[0])  # type: ignore[arg-type]
    assert cache.references() == 0


def test_a_wait_for_room_ends_in_a_refusal_when_nothing_is_released(
        engine: Engine, adapters: dict[str, Path]) -> None:
    cache = _cache(engine, adapters, device_slots=1,
                   quota=CacheQuota(resident_share=1.0, room_wait_s=0.3))
    a, b = list(adapters)[:2]
    held = cache.acquire(a, "acme")
    with pytest.raises(CacheRefused) as e:
        cache.acquire(b, "acme")
    assert e.value.reason == "no_room" and cache.references() == 1
    cache.release(held)


def test_a_slow_load_record_stalls_no_other_request(engine: Engine,
                                                    adapters: dict[str, Path]) -> None:
    """The record of an eviction is handed to ``on_event`` (a database write on a host) after
    the cache's lock is released: while one is slow, a request for a resident adapter is
    served and a lease is released. Before, the eviction's record was written under the lock,
    and both waited for the write (issue 24: the scheduler stalled on the cache's lock)."""
    import threading

    gate, entered = threading.Event(), threading.Event()
    events = Events()

    def slow(digest: str, outcome: str, started: float, s: float, nbytes: int | None,
             reason: str | None) -> None:
        if outcome == "unloaded":
            entered.set()
            assert gate.wait(30)
        events(digest, outcome, started, s, nbytes, reason)

    cache = _cache(engine, adapters, device_slots=2)
    cache.on_event = slow
    a, b, c = list(adapters)[:3]
    held = cache.acquire(a, "acme")
    cache.release(cache.acquire(b, "acme"))
    loader = threading.Thread(target=lambda: cache.release(cache.acquire(c, "acme")))
    loader.start()  # evicts b; its record waits on the gate
    try:
        assert entered.wait(30)
        served: list[bool] = []

        def request() -> None:
            cache.acquire(a, "acme").release()
            served.append(True)

        hit = threading.Thread(target=request)
        hit.start()
        hit.join(5)
        assert served == [True], "a hit waited for another adapter's eviction record"
        released = threading.Thread(target=held.release)
        released.start()
        released.join(5)
        assert not released.is_alive(), "a lease release waited for an eviction record"
    finally:
        gate.set()
        loader.join(30)
    assert [e[:2] for e in events] == [(a, "loaded"), (b, "loaded"), (b, "unloaded"),
                                       (c, "loaded")]  # in the order they happened
