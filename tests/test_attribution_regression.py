"""Regression: a failing decode step must not release a queued request's adapter lease.

The scenario a reviewer reproduced on the serving path (issue 10, "What is broken today", item 1),
on one host with one device slot and two running sequences:

1. in one admission step: a row whose sampling fails (temperature 1e-39) and a row on adapter X
   cancelled before it started; a third row on X waits in the queue behind two long base rows;
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.engine import Engine
from backend.ledger import Ledger
from backend.scheduler import SchedulerLimits
from backend.service import Answer, IncomingRequest, LoraService
from control.config import Settings
from control.db import make_engine
from control.ticket_office import TicketOffice
from control.tickets import TicketSigner
from projections.routing import RoutingView
from tests.integration.conftest import ACTOR, provision
from tests.integration.reference import Reference

WAIT_S = 60.0


@dataclass
class Home:
    settings: Settings
    base_digest: str
    digests: dict[str, str]  # kit adapter name -> digest
    office: TicketOffice
    kit_dir: Path

    def ticket(self, tenant: str, alias: str) -> dict[str, object]:
        """Request parameters carrying a fresh ticket for ``alias``."""
        return {"lora_ticket": self.office.issue(tenant, alias).token}


@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("regression-home")
    settings = Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}")
    settings.ensure_dirs()
    reg, _kit, _keys, digests = provision(settings, kit_dir)
    signer, _ = TicketSigner.load_or_create(settings.keys_dir)
    reg.record_signing_key(signer.kid, signer.public_b64, actor=ACTOR)
    routing = RoutingView(make_engine(settings.db_url))
    base = routing.bases()[0].digest
    return Home(settings, base, digests, TicketOffice(settings, routing, signer), kit_dir)


class Sink:
    """An answer sink whose ``cancelled()`` can hold the scheduler thread at a gate."""

    def __init__(self, *, cancelled: bool = False,
                 hold_until: Callable[[], bool] | None = None) -> None:
        self.is_cancelled = cancelled
        self.hold_until = hold_until
        self.held = threading.Event()
        self.done = threading.Event()
        self.final: Answer | None = None

    def cancelled(self) -> bool:
        if self.hold_until is not None:
            self.held.set()
            deadline = time.monotonic() + WAIT_S
            while not self.hold_until() and time.monotonic() < deadline:
                time.sleep(0.005)
            self.hold_until = None
        return self.is_cancelled

    def piece(self, text: str, request_id: str, adapter_digest: str) -> None:
        pass

    def answer(self, a: Answer) -> None:
        self.final = a
        self.done.set()


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def service(home: Home) -> Iterator[LoraService]:
    engine = Engine(home.kit_dir / "base", home.kit_dir / "tokenizer", device="cpu",
                    max_rank=home.settings.max_rank, max_adapters=1)
    svc = LoraService(home.settings, home.base_digest, host="regression", engine=engine,
                      limits=SchedulerLimits(max_running=2, max_queued=16),
                      prefix_cache_bytes=0)
    try:
        yield svc
    finally:
        svc.close()


def test_failing_step_never_hands_a_queued_rows_slot_to_another_tenant(
        home: Home, service: LoraService) -> None:
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
    poison = Sink()
    cancelled_x = Sink(cancelled=True)
    x_queued = Sink()
    order: list[tuple[IncomingRequest, Sink]] = [
        (IncomingRequest(b"poison", t_base, max_tokens=8, temperature=1e-39, seed=1), poison),
        (IncomingRequest(prompt.encode(), t_x, max_tokens=16), cancelled_x),
        (IncomingRequest(b"The cat", t_base, max_tokens=24), l1),
        (IncomingRequest(b"A red bird", t_base, max_tokens=24), Sink()),
        (IncomingRequest(prompt.encode(), t_x, max_tokens=16), x_queued),
    ]
    for n, (req, sink) in enumerate(order, start=1):
        service.submit(req, sink)
        if sink is poison:
            # Refused at admission (a valid fix) or queued (the reviewer's setup).
            _wait(lambda: poison.done.is_set() or queued() == 1, "the poison row")
        else:
            want = n - (1 if poison.done.is_set() else 0)
            _wait(lambda w=want: queued() == w, f"{want} queued")  # type: ignore[misc]
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
