"""Regression: a failing decode step must not release a queued request's adapter lease.

The scenario a reviewer reproduced on the serving path (issue 10, "What is broken today", item 1),
on one host with one device slot and two running sequences:

1. in one admission step: a row whose step fails and a row on adapter X cancelled before it
   started; a third row on X waits in the queue behind two long base rows (the reviewer's failing
   row had a temperature of 1e-39, which admission now refuses; the failure is injected here, at
   the prefill or at the decode step of the same turn, so the case still reaches the step);
2. the failing step used to end the cancelled job a second time, releasing its lease twice: the
   cache's reference count and the engine's pin on X dropped to 0 while the queued row still held
   its lease;
3. another tenant's adapter Y then evicted X and took its slot, and the queued row was answered
   with Y's weights, under X's digest, ledger row ``ok``.

The test drives the real ``LoraService`` (real engine on the tiny kit model, real cache, scheduler
and SQLite ledger) in-process. It holds the scheduler at chosen points by blocking inside the
sinks' ``cancelled()`` callbacks, which the scheduler calls between decode steps. The queued
row's answer is compared with PEFT's output for X alone: an independent reference, not the ticket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.serving.cache import CacheQuota
from backend.serving.scheduler import SchedulerLimits
from backend.serving.service import IncomingRequest, LoraService
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from tests.faults import FAIL_DECODE, FAIL_STEP, FaultyEngine
from tests.integration.reference import Reference
from tests.serving_home import WAIT_S, Home, Sink, provision_home
from tests.serving_home import wait_for as _wait


@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("regression-home")
    return provision_home(Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}"),
                          kit_dir)


@pytest.fixture(params=["prefill", "decode"])
def poison(request: pytest.FixtureRequest) -> str:
    """Which pass of the failing row's first scheduler turn fails: its prefill, or the decode
    step after it. Both end that turn with an exception no row can be blamed for, which is what
    ended the cancelled job a second time. (The reviewer's own poison, a temperature of 1e-39,
    is refused at admission now and no longer reaches a step: it was replaced.)"""
    return str(request.param)


@pytest.fixture
def service(home: Home, poison: str) -> Iterator[LoraService]:
    engine = FaultyEngine(home.kit_dir / "base", home.kit_dir / "tokenizer", device="cpu",
                          max_rank=home.settings.max_rank, max_adapters=1)
    # Y's load waits 1 s for X's slot (X's queued row holds it), then is refused.
    svc = home.service(engine=engine, limits=SchedulerLimits(max_running=2, max_queued=16),
                       host="regression", quota=CacheQuota(room_wait_s=1.0))
    try:
        yield svc
    finally:
        svc.close()


def test_failing_step_never_hands_a_queued_rows_slot_to_another_tenant(
        home: Home, service: LoraService, poison: str) -> None:
    x, y = home.digests["alpha"], home.digests["gamma"]
    t_x, t_base = home.ticket("acme", "acme-alpha"), home.ticket("acme", "base")
    t_y = home.ticket("globex", "globex-gamma")
    prompt = "Hello"

    def queued() -> int:
        return service.scheduler.load()[1]

    # P0 runs and holds the scheduler between steps while the queue fills up.
    fill = threading.Event()
    p0 = Sink(hold_until=fill.is_set)
    service.submit(IncomingRequest(b"Once upon a time", t_base, max_tokens=64), p0)
    assert p0.held.wait(WAIT_S)

    y_sink = Sink()
    # L1 holds the scheduler again, once it runs, until Y was placed or refused.
    l1 = Sink(hold_until=lambda: service.engine.slot_of(y) is not None or y_sink.done.is_set())
    marker = FAIL_STEP if poison == "prefill" else FAIL_DECODE
    failing = IncomingRequest(f"poison {marker}".encode(), t_base, max_tokens=8)
    poisoned = Sink()
    cancelled_x = Sink(cancelled=True)
    x_queued = Sink()
    order: list[tuple[IncomingRequest, Sink]] = [
        (failing, poisoned),
        (IncomingRequest(prompt.encode(), t_x, max_tokens=16), cancelled_x),
        (IncomingRequest(b"The cat", t_base, max_tokens=24), l1),
        (IncomingRequest(b"A red bird", t_base, max_tokens=24), Sink()),
        (IncomingRequest(prompt.encode(), t_x, max_tokens=16), x_queued),
    ]
    for n, (req, sink) in enumerate(order, start=1):
        service.submit(req, sink)
        _wait(lambda w=n: queued() == w, f"{n} queued")  # type: ignore[misc]
    p0.is_cancelled = True
    fill.set()  # P0 ends; [poison, cancelled X] (or [cancelled X, L1]) are admitted together

    assert l1.held.wait(WAIT_S)  # L1 is running: X's row is still queued behind it
    assert cancelled_x.done.wait(WAIT_S)
    time.sleep(0.3)  # let every release the failed step triggered land before Y asks for room
    service.submit(IncomingRequest(b"Hi", t_y, max_tokens=8), y_sink)

    assert x_queued.done.wait(WAIT_S) and y_sink.done.wait(WAIT_S)
    answer = x_queued.final
    assert answer is not None and answer.ok, answer
    reference = Reference(home.kit_dir / "base", home.kit_dir / "tokenizer")
    want_x = reference.generate(prompt, home.kit_dir / "adapters" / "alpha", 16)
    want_y = reference.generate(prompt, home.kit_dir / "adapters" / "gamma", 16)
    assert want_x != want_y  # else a swap would be invisible
    assert answer.text == want_x, f"X's row was computed by another adapter: {answer.text!r}"
    assert answer.adapter_digest == x
    row = Ledger(make_engine(home.settings.db_url)).get(answer.request_id)
    assert row is not None and row.outcome == "ok" and row.adapter_digest == x
    # Y was refused for want of a slot (X is leased) or served after X's row, correctly.
    y_answer = y_sink.final
    assert y_answer is not None
    if y_answer.ok:
        assert y_answer.adapter_digest == y
        assert y_answer.text == reference.generate("Hi", home.kit_dir / "adapters" / "gamma", 8)
    failed = poisoned.final
    # It reached the engine and failed there, with its step.
    assert failed is not None and not failed.ok and failed.outcome == "failed"
    assert service.engine.injected >= 1
    health = service.health()
    assert (health["leases"], health["pins"], health["violations"]) == (0, 0, 0), health
