"""Revocation reaches admitted work, in-process (real engine, cache, scheduler, SQLite ledger and
registry; the same through the real tritonserver is tests/integration/test_kill_switch.py).

- Default (drain): the revocation forbids new resolution; a request already running finishes
  ``ok``; a request queued behind others and not started is refused as ``revoked`` with the
  generic refusal, its lease given back.
- ``immediate`` (the kill switch): running requests and streams on the digest end before their
  next token, each with the generic refusal and a row ``outcome=revoked`` whose ``tokens_out``
  counts the tokens the client received; other tenants' rows run on, untouched.
- A draining revocation may be escalated to the kill switch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.serving.scheduler import SchedulerLimits
from backend.serving.service import IncomingRequest, LoraService
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, LedgerEntry
from control.contracts.tickets import GENERIC_REFUSAL
from control.domain import IllegalTransition
from tests.faults import EndlessEngine
from tests.integration.conftest import ACTOR
from tests.integration.reference import Reference
from tests.serving_home import Home, Sink, provision_home, wait_for

KILL_WITHIN_S = 1.0


@pytest.fixture
def home(kit_dir: Path, tmp_path: Path) -> Home:
    # One home per test: each revokes for good.
    return provision_home(Settings(home=tmp_path, db_url=f"sqlite:///{tmp_path / 'l.db'}"),
                          kit_dir)


def _endless(home: Home, max_adapters: int = 4) -> EndlessEngine:
    return EndlessEngine(home.kit_dir / "base", home.kit_dir / "tokenizer", device="cpu",
                         max_rank=home.settings.max_rank, max_adapters=max_adapters)


@pytest.fixture
def service(home: Home) -> Iterator[LoraService]:
    # Two running rows at most: a third request waits in the queue, admitted, not started. No
    # row stops at eos (the kit's adapters answer in a dozen tokens): streams run while revoked.
    svc = home.service(engine=_endless(home), limits=SchedulerLimits(max_running=2,
                                                                     max_queued=16))
    try:
        yield svc
    finally:
        svc.close()


def _row(home: Home, request_id: str) -> LedgerEntry:
    row = Ledger(make_engine(home.settings.db_url)).get(request_id)
    assert row is not None, request_id
    return row


class Timed(Sink):
    """A sink that stamps every streamed piece with the time it arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[float] = []

    def piece(self, text: str, request_id: str, adapter_digest: str) -> None:
        super().piece(text, request_id, adapter_digest)
        self.stamps.append(time.monotonic())


def _streams_started(sinks: list[Timed]) -> None:
    wait_for(lambda: all(len(s.pieces) >= 2 for s in sinks), "the streams to start", 30)


def test_drain_finishes_running_work_and_refuses_what_has_not_started(home: Home) -> None:
    # One running row: the second request waits in the queue, admitted, not started.
    service = home.service(limits=SchedulerLimits(max_running=1, max_queued=16))
    try:
        _drain(home, service)
    finally:
        service.close()


def _drain(home: Home, service: LoraService) -> None:
    alpha = home.digests["alpha"]
    queued = Sink()
    # The running stream holds the scheduler (between steps) until the queued request is
    # answered: that answer can only come from the revocation, never from being served.
    running = Timed()
    running.hold_until = queued.done.is_set
    service.submit(IncomingRequest(b"Once upon a time", home.ticket("acme", "acme-alpha"),
                                   max_tokens=48, stream=True), running)
    assert running.held.wait(30)
    service.submit(IncomingRequest(b"Hello", home.ticket("acme", "acme-alpha"), max_tokens=8),
                   queued)
    wait_for(lambda: service.scheduler.load()[1] == 1, "the second request to queue", 30)

    home.registry.revoke(alpha, "test: drain", actor=ACTOR)
    refused = queued.wait()
    assert not refused.ok and refused.error == GENERIC_REFUSAL and refused.status == "invalid_arg"
    row = _row(home, refused.request_id)
    assert (row.outcome, row.reason, row.tokens_out) == ("rejected", "revoked", 0)

    # Admitted and started: it drains, served by alpha, all of it.
    answer = running.wait()
    assert answer.ok, answer
    reference = Reference(home.kit_dir / "base", home.kit_dir / "tokenizer")
    assert "".join(running.pieces) == reference.generate(
        "Once upon a time", home.kit_dir / "adapters" / "alpha", 48)
    assert _row(home, answer.request_id).outcome == "ok"
    wait_for(lambda: alpha not in service.engine.resident_adapters(), "alpha to unload", 10)
    h = service.health()
    assert (h["leases"], h["pins"], h["violations"]) == (0, 0, 0), h


def test_the_kill_switch_ends_running_streams_at_once_and_spares_other_tenants(
        home: Home, service: LoraService) -> None:
    alpha = home.digests["alpha"]
    killed = [Timed(), Timed()]
    for sink in killed:
        service.submit(IncomingRequest(b"Once upon a time", home.ticket("acme", "acme-alpha"),
                                       max_tokens=230, stream=True), sink)
    _streams_started(killed)
    queued, other = Sink(), Timed()
    service.submit(IncomingRequest(b"Hello", home.ticket("acme", "acme-alpha"), max_tokens=8),
                   queued)
    # globex's request waits behind the two alpha streams; once they end it runs, untouched.
    service.submit(IncomingRequest(b"Hello", home.ticket("globex", "globex-gamma"),
                                   max_tokens=8, stream=True), other)

    t0 = time.monotonic()
    home.registry.revoke(alpha, "test: licence withdrawn", actor=ACTOR, immediate=True)
    for sink in killed:
        answer = sink.wait()
        assert not answer.ok and answer.outcome == "revoked", answer
        assert (answer.error, answer.status) == (GENERIC_REFUSAL, "invalid_arg")
        last = max(sink.stamps)
        assert last - t0 < KILL_WITHIN_S, f"a token arrived {last - t0:.2f}s after the command"
        row = _row(home, answer.request_id)
        assert (row.outcome, row.reason) == ("revoked", "immediate")
        # What the client received, counted in tokens: one piece per token at most.
        assert 0 < row.tokens_out < 230 and len(sink.pieces) <= row.tokens_out
    assert queued.wait().error == GENERIC_REFUSAL
    assert _row(home, queued.final.request_id).reason == "revoked"  # type: ignore[union-attr]
    survivor = other.wait()
    assert survivor.ok and survivor.adapter_digest == home.digests["gamma"]
    wait_for(lambda: alpha not in service.engine.resident_adapters(), "alpha to unload", 10)
    h = service.health()
    assert (h["leases"], h["pins"], h["violations"]) == (0, 0, 0), h


def test_a_draining_revocation_can_be_escalated_to_the_kill_switch(
        home: Home, service: LoraService) -> None:
    alpha = home.digests["alpha"]
    sink = Timed()
    service.submit(IncomingRequest(b"Once upon a time", home.ticket("acme", "acme-alpha"),
                                   max_tokens=230, stream=True), sink)
    _streams_started([sink])
    home.registry.revoke(alpha, "test: first, drain", actor=ACTOR)
    time.sleep(0.3)
    assert not sink.done.is_set()  # draining: it runs on
    t0 = time.monotonic()
    home.registry.revoke(alpha, "test: now a security event", actor=ACTOR, immediate=True)
    answer = sink.wait()
    assert answer.outcome == "revoked" and max(sink.stamps) - t0 < KILL_WITHIN_S
    adapter = home.registry.adapter(alpha)
    assert adapter.revoked_immediately and adapter.revoke_reason == "test: first, drain"
    with pytest.raises(IllegalTransition):  # nothing left to escalate
        home.registry.revoke(alpha, "again", actor=ACTOR, immediate=True)


def test_the_kill_switch_reaches_a_busy_host(home: Home) -> None:
    # A busy host: eight streams of three tenants' adapters fill every running row, more wait.
    svc = home.service(engine=_endless(home), limits=SchedulerLimits(max_running=8,
                                                                     max_queued=64))
    try:
        alpha = home.digests["alpha"]
        streams: list[tuple[str, Timed]] = []
        for i in range(12):
            alias = ("acme-alpha", "acme-beta", "globex-gamma")[i % 3]
            tenant = "globex" if alias.startswith("globex") else "acme"
            sink = Timed()
            svc.submit(IncomingRequest(b"Once upon a time", home.ticket(tenant, alias),
                                       max_tokens=230, stream=True), sink)
            streams.append((alias, sink))
        wait_for(lambda: svc.scheduler.load()[0] == 8, "eight running rows", 30)
        t0 = time.monotonic()
        home.registry.revoke(alpha, "test: busy host", actor=ACTOR, immediate=True)
        for alias, sink in streams:
            if alias != "acme-alpha":
                continue
            answer = sink.wait()
            assert answer.outcome in ("revoked", "rejected"), answer
            if sink.stamps:
                assert max(sink.stamps) - t0 < KILL_WITHIN_S
        for alias, sink in streams:
            if alias != "acme-alpha":  # other adapters run to their max_tokens, untouched
                answer = sink.wait()
                assert answer.ok and len(sink.pieces) > 0, answer
    finally:
        svc.close()
