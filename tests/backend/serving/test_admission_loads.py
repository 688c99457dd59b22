"""No admission thread waits for an adapter load (issue 24): a request whose adapter is not
resident leaves its admission thread and comes back when the load ends, so that requests whose
adapters are resident (and base requests) are admitted meanwhile; a load that fails refuses
every request that waited on it, and nothing stays referenced either way.

Before: the service's eight admission threads each blocked on their request's load, so eight
requests waiting on one slow load held every request behind them, resident or not."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backend.serving.requests import IncomingRequest
from backend.serving.service import LoraService
from control.contracts.config import Settings
from tests.serving_home import Home, Sink, provision_home, wait_for

WAITERS = 12  # more than the admission threads (8)


@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("admission-loads")
    return provision_home(Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}"),
                          kit_dir)


@pytest.fixture
def service(home: Home) -> Iterator[LoraService]:
    svc = home.service(max_adapters=4)
    try:
        yield svc
    finally:
        svc.close()


def gate_fetch(svc: LoraService, digest: str, gate: threading.Event,
               fail: bool = False) -> threading.Event:
    """The store read of ``digest`` waits for ``gate`` (then fails when ``fail``); returns an
    event set once that read has started."""
    started = threading.Event()
    fetch: Callable[[str], object] = svc.cache.fetch

    def gated(d: str) -> object:
        if d == digest:
            started.set()
            assert gate.wait(60)
            if fail:
                raise OSError("the store is away")
        return fetch(d)

    svc.cache.fetch = gated  # type: ignore[assignment]
    return started


def send(home: Home, svc: LoraService, tenant: str, alias: str, i: int) -> Sink:
    sink = Sink()
    svc.submit(IncomingRequest(f"{i} Hello".encode(), home.ticket(tenant, alias),
                               max_tokens=4), sink)
    return sink


def test_requests_are_admitted_while_others_wait_for_a_load(home: Home,
                                                            service: LoraService) -> None:
    gate = threading.Event()
    started = gate_fetch(service, home.digests["beta"], gate)
    try:
        waiting = [send(home, service, "acme", "acme-beta", i) for i in range(WAITERS)]
        assert started.wait(60)
        wait_for(lambda: service.cache.references() == WAITERS,
                 "every waiter's reference on the loading adapter")
        # The load is held; a base request and one on another adapter are served meanwhile.
        base = send(home, service, "globex", "base", 100)
        other = send(home, service, "globex", "globex-gamma", 101)
        for sink in (base, other):
            assert sink.done.wait(30), "a request waited for another adapter's load"
            assert sink.final is not None and sink.final.ok, sink.final
        assert other.final is not None and other.final.adapter_digest == home.digests["gamma"]
        assert not any(s.done.is_set() for s in waiting)
    finally:
        gate.set()
    for sink in waiting:
        answer = sink.wait()
        assert answer.ok and answer.adapter_digest == home.digests["beta"], answer
    wait_for(lambda: service.cache.references() == 0, "every lease given back")


def test_a_failed_load_refuses_every_waiter_and_holds_nothing(home: Home,
                                                               service: LoraService) -> None:
    gate = threading.Event()
    started = gate_fetch(service, home.digests["alpha"], gate, fail=True)
    try:
        waiting = [send(home, service, "acme", "acme-alpha", i) for i in range(WAITERS)]
        assert started.wait(60)
        wait_for(lambda: service.cache.references() == WAITERS,
                 "every waiter's reference on the loading adapter")
    finally:
        gate.set()
    for sink in waiting:
        answer = sink.wait()
        assert not answer.ok and answer.status == "unavailable", answer
        assert home.digests["alpha"] not in answer.error  # a generic message
    wait_for(lambda: service.cache.references() == 0, "no reference left by the failed load")
    assert service.engine.pins() == {}
    # The adapter loads on the next request once the store is back.
    service.cache.fetch = service.store.read_verified
    assert send(home, service, "acme", "acme-alpha", 99).wait().ok
