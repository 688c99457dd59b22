"""The ledger writer isolates a row that can never be written, on a real database (SQLite, and
PostgreSQL where ``LORAPLANE_TEST_PG_URL`` names one).

Before, the writer wrote a batch, and retried its backlog, as one transaction: one row that could
never be written (a request id already taken by another request's row, which a retried admit
could produce) failed its whole batch and every retry, and the innocent rows stayed in the
backlog forever. Now writes are idempotent by request id, and a row that fails alone is set
aside, counted and logged, while the others become durable.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from backend.serving.recorder import LedgerWriter
from control.contracts.db import make_engine
from control.contracts.ledger import Completion, Ledger, LedgerConflict, LedgerEntry, Outcome
from tests.fixtures_control import postgres_settings

WAIT_S = 20.0


@pytest.fixture(params=["sqlite", "postgres"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "sqlite":
        yield Ledger(make_engine(f"sqlite:///{tmp_path / 'ledger.db'}"))
        return
    with postgres_settings(tmp_path) as settings:  # skips without PostgreSQL
        yield Ledger(make_engine(settings.db_url))


def _entry(host: str = "h1", outcome: str = Outcome.REJECTED, rid: str | None = None,
           reason: str = "missing") -> LedgerEntry:
    return LedgerEntry(request_id=rid or str(uuid.uuid4()), ticket_id=None, tenant=None,
                       model="lora_llm", host=host, base_digest=None, adapter_digest=None,
                       tokenizer_digest=None, admitted_at=time.time(), outcome=outcome,
                       reason=reason)


class Outcomes:
    """Collects each item's ``then(durable)``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: dict[str, bool] = {}

    def then(self, rid: str):  # type: ignore[no-untyped-def]
        def record(durable: bool) -> None:
            with self.lock:
                self.got[rid] = durable
        return record

    def wait(self, n: int) -> dict[str, bool]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.got) >= n:
                    return dict(self.got)
            time.sleep(0.01)
        raise AssertionError(f"only {len(self.got)} of {n} answered")


def test_writes_are_idempotent_by_request_id(ledger: Ledger) -> None:
    e = _entry()
    ledger.write([e], [])
    ledger.write([e], [])  # a retry after an unacknowledged commit changes nothing
    running = _entry(outcome=Outcome.RUNNING)
    ledger.admit([running])
    done = Completion(running.request_id, Outcome.OK, 3, 4, served_digest=None)
    ledger.complete([done])
    ledger.complete([done])  # likewise
    with pytest.raises(LedgerConflict) as clash:  # another request's row under that id
        ledger.write([_entry(host="h2", rid=e.request_id)], [])
    assert clash.value.request_ids == (e.request_id,)
    with pytest.raises(LedgerConflict):  # a completion of a row that does not exist
        ledger.complete([Completion(str(uuid.uuid4()), Outcome.OK, 1, 1)])
    row = ledger.get(e.request_id)
    assert row is not None and row.host == "h1"


def test_one_row_that_can_never_be_written_holds_no_other(ledger: Ledger,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    taken = _entry(host="other-host")
    ledger.write([taken], [])
    writer = LedgerWriter(ledger, retry_s=0.1, attempts=1)
    outcomes = Outcomes()
    try:
        good = [_entry() for _ in range(5)]
        clash = _entry(rid=taken.request_id)  # same id, another request: never writable
        orphan = Completion(str(uuid.uuid4()), Outcome.OK, 1, 1)  # no row to complete
        for e in [*good[:2], clash, *good[2:]]:
            writer.insert(e, outcomes.then(e.request_id))
        writer.complete(orphan, outcomes.then(orphan.request_id))
        got = outcomes.wait(7)
        assert all(got[e.request_id] for e in good), got  # durable, and answered so
        assert not got[clash.request_id] and not got[orphan.request_id]
        assert writer.backlog() == 0 and writer.poisoned == 2
        for e in good:
            assert ledger.get(e.request_id) is not None
        held = ledger.get(taken.request_id)
        assert held is not None and held.host == "other-host"  # the rightful row is untouched
        assert clash.request_id in caplog.text  # logged in full, to be restored by hand
    finally:
        writer.close()


def test_a_poisoned_row_in_the_backlog_does_not_keep_the_others_there(
        ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _entry(host="other-host")
    ledger.write([taken], [])
    writer = LedgerWriter(ledger, retry_s=0.1, attempts=1)
    outcomes = Outcomes()
    real_write = ledger.write
    away = threading.Event()
    away.set()

    def flaky(*args: object, **kw: object) -> None:
        if away.is_set():  # the database is away: a failure that may pass
            raise sa.exc.OperationalError("INSERT", {}, Exception("connection refused"))
        real_write(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger, "write", flaky)
    try:
        good = [_entry() for _ in range(3)]
        clash = _entry(rid=taken.request_id)
        for e in [good[0], clash, *good[1:]]:
            writer.insert(e, outcomes.then(e.request_id))
        got = outcomes.wait(4)
        assert not any(got.values())  # held: not durable yet
        assert writer.backlog() == 4
        away.clear()  # the database is back
        deadline = time.monotonic() + WAIT_S
        while writer.backlog() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writer.backlog() == 0 and writer.poisoned == 1
        for e in good:
            assert ledger.get(e.request_id) is not None
    finally:
        writer.close()


def test_a_value_the_database_refuses_is_set_aside_alone(ledger: Ledger) -> None:
    if ledger.engine.dialect.name != "postgresql":
        pytest.skip("SQLite does not enforce VARCHAR lengths: the value would be written")
    writer = LedgerWriter(ledger, retry_s=0.1, attempts=1)
    outcomes = Outcomes()
    try:
        good = [_entry() for _ in range(3)]
        too_long = _entry(reason="r" * 100)  # reason is VARCHAR(64): a DataError, for good
        for e in [good[0], too_long, *good[1:]]:
            writer.insert(e, outcomes.then(e.request_id))
        got = outcomes.wait(4)
        assert [got[e.request_id] for e in good] == [True] * 3 and not got[too_long.request_id]
        assert (writer.backlog(), writer.poisoned) == (0, 1)
    finally:
        writer.close()
