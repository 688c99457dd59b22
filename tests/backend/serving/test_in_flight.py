"""The in-flight bound is shared between tenants (``backend.serving.in_flight``).

Through a real service on the kit engine: a tenant that floods the host with requests waiting for
one cold adapter's load no longer holds the whole bound, so another tenant's request is served
meanwhile (before, it was refused as busy until the load ended). A state machine checks the book
against what the bound means under any interleaving of arrivals, verifications and answers.
"""

from __future__ import annotations

import threading
from pathlib import Path

import sqlalchemy as sa
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.serving.in_flight import TENANT_BUSY, InFlightBook
from backend.serving.requests import IncomingRequest
from backend.serving.scheduler import SchedulerLimits
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import request_ledger
from tests.serving_home import Sink, provision_home, wait_for

BOUND = 8


def test_a_flood_waiting_for_a_load_leaves_room_for_another_tenant(
        kit_dir: Path, tmp_path: Path) -> None:
    """globex sends 3 x BOUND requests for its adapter while its load is held back; acme's
    request, sent meanwhile, is served. globex holds at most half the bound, and its requests
    past that are refused as busy, each with a ledger row naming globex and ``tenant_busy``."""
    home = provision_home(Settings(home=tmp_path, db_url=f"sqlite:///{tmp_path / 'lp.db'}"),
                          kit_dir)
    svc = home.service(limits=SchedulerLimits(max_running=4, max_queued=4,
                                              max_in_flight=BOUND))
    warm = Sink()  # acme's adapter resident first: only globex's load is held back
    svc.submit(IncomingRequest(b"Hello", home.ticket("acme", "acme-alpha"), max_tokens=2), warm)
    assert warm.wait().ok
    release, fetched = threading.Event(), threading.Event()
    fetch = svc.cache.fetch

    def held_back(digest: str) -> object:
        release.wait(120)
        fetched.set()
        return fetch(digest)

    svc.cache.fetch = held_back  # type: ignore[method-assign]
    try:
        flood = [Sink() for _ in range(3 * BOUND)]
        for sink in flood:
            svc.submit(IncomingRequest(b"flood", home.ticket("globex", "globex-gamma"),
                                       max_tokens=2), sink)
        wait_for(lambda: sum(s.final is not None for s in flood) >= 3 * BOUND - BOUND // 2,
                 "the flood's excess refused", timeout_s=20)
        assert svc.intake.book.held("globex") == BOUND // 2
        mine = Sink()
        svc.submit(IncomingRequest(b"Hello", home.ticket("acme", "acme-alpha"), max_tokens=2),
                   mine)
        answer = mine.wait()
        assert answer.ok, answer
        assert not fetched.is_set()  # served while globex's load was still held back
        release.set()
        answers = [s.wait() for s in flood]
        assert sum(a.ok for a in answers) == BOUND // 2
        refused = [a for a in answers if not a.ok]
        assert all(a.status == "unavailable" for a in refused)
        t = request_ledger
        with make_engine(home.settings.db_url).connect() as conn:
            rows = conn.execute(sa.select(t.c.tenant, t.c.reason).where(
                t.c.request_id.in_([a.request_id for a in refused]))).all()
        busy = [r for r in rows if r.reason == TENANT_BUSY]
        assert busy and all(r.tenant == "globex" for r in busy)
        assert {r.reason for r in rows} <= {TENANT_BUSY, "busy"}  # busy: before verification
        wait_for(lambda: svc.intake.book.total() == 0, "every request to leave the bound")
    finally:
        release.set()
        svc.close()


class Book(RuleBasedStateMachine):
    """Arrivals, verifications and answers of three tenants against a bound of 8. Checked
    against what the bound means: an arrival is refused only at the bound; a tenant holding
    nothing is never refused at verification (a newcomer always finds room); a tenant is
    refused only while it holds at least an equal part between the tenants in flight and one
    more; the counts are the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.book = InFlightBook(lambda: BOUND)
        self.unverified: list[str] = []
        self.verified: dict[str, str] = {}  # request -> tenant
        self.n = 0

    def held(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tenant in self.verified.values():
            out[tenant] = out.get(tenant, 0) + 1
        return out

    @rule()
    def arrive(self) -> None:
        self.n += 1
        rid = f"r{self.n}"
        before = len(self.unverified) + len(self.verified)
        entered = self.book.enter(rid)
        assert entered == (before < BOUND)
        if entered:
            self.unverified.append(rid)

    @precondition(lambda self: self.unverified)
    @rule(pick=st.integers(0, 100), tenant=st.sampled_from(["t0", "t1", "t2"]))
    def verify(self, pick: int, tenant: str) -> None:
        rid = self.unverified[pick % len(self.unverified)]
        held = self.held()
        others = len([t for t in held if t != tenant])
        ok = self.book.verified(rid, tenant)
        if held.get(tenant, 0) == 0:
            assert ok  # a tenant with nothing in flight always gets in
        assert ok == (held.get(tenant, 0) < max(1, BOUND // (others + 2)))
        if ok:
            self.unverified.remove(rid)
            self.verified[rid] = tenant

    @precondition(lambda self: self.unverified or self.verified)
    @rule(pick=st.integers(0, 100))
    def answer(self, pick: int) -> None:
        everyone = self.unverified + sorted(self.verified)
        rid = everyone[pick % len(everyone)]
        self.book.done(rid)
        self.book.done(rid)  # answered twice by mistake: counted once
        if rid in self.verified:
            del self.verified[rid]
        else:
            self.unverified.remove(rid)

    @invariant()
    def counts_match(self) -> None:
        assert self.book.total() == len(self.unverified) + len(self.verified) <= BOUND
        for tenant in ("t0", "t1", "t2"):
            assert self.book.held(tenant) == self.held().get(tenant, 0)


def test_the_book_keeps_the_bound_and_every_tenants_room() -> None:
    Book.TestCase.settings = hsettings(max_examples=80, stateful_step_count=40, deadline=None)
    Book.TestCase().runTest()
