"""Faults the self-test may not inject into someone else's deployment: tritonserver killed or
restarted mid-burst, the database locked for a while. Clients get errors, not hangs; the ledger
keeps no request 'running'; the service resumes."""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.ops.clients import Generation, TritonRefused, generate
from tests.hostile.conftest import HostileStack

pytestmark = pytest.mark.triton

ANSWER_WITHIN_S = 120  # "no hang": every client has its answer or its error by then


def _burst(hostile: HostileStack, n: int, fault: threading.Event) -> list[Generation | str]:
    tickets = [hostile.ticket("acme", "acme-alpha"), hostile.ticket("globex", "globex-gamma")]

    def call(i: int) -> Generation | str:
        if i == n // 4:
            fault.set()  # the fault lands while the rest of the burst is in flight
        try:
            return generate(hostile.http if i % 2 else hostile.grpc, f"[{i}] Hello",
                            tickets[i % 2], protocol="http" if i % 2 else "grpc", max_tokens=24)
        except TritonRefused as e:
            return f"refused {e.status}"
        except Exception as e:  # connection reset/refused while the server is down
            return f"error {type(e).__name__}"

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(call, i) for i in range(n)]
        return [f.result(timeout=ANSWER_WITHIN_S) for f in futures]


def _check_ledger_after(hostile: HostileStack, since: float,
                        results: list[Generation | str]) -> None:
    ledger = Ledger(make_engine(hostile.settings.db_url))
    rows = ledger.query(since=since)
    assert not [r for r in rows if r.outcome == "running"], "rows left running after restart"
    want = {0: hostile.digests["alpha"], 1: hostile.digests["gamma"]}
    for i, g in enumerate(results):
        if isinstance(g, Generation):  # what a client got is exactly what the ledger says
            row = ledger.get(g.request_id)
            assert row is not None and row.outcome == "ok"
            assert g.adapter_digest == row.adapter_digest == want[i % 2]


@pytest.mark.parametrize("kill", [True, False], ids=["kill-9", "restart"])
def test_triton_dies_mid_burst(hostile: HostileStack, kill: bool) -> None:
    fault = threading.Event()
    since = time.time()
    restarter = threading.Thread(target=lambda: (fault.wait(60),
                                                 hostile.restart_triton(kill=kill)))
    restarter.start()
    results = _burst(hostile, 64, fault)  # returns: nobody hung
    restarter.join(300)
    errors = [r for r in results if not isinstance(r, Generation)]
    print(f"{'kill -9' if kill else 'restart'}: {len(results) - len(errors)} answered, "
          f"{len(errors)} errors")
    if kill:
        assert errors, "a SIGKILL mid-burst must cost some requests an error"
        ledger = Ledger(make_engine(hostile.settings.db_url))
        failed = [r for r in ledger.query(since=since) if r.outcome == "failed"]
        print(f"ledger rows marked failed at restart: {len(failed)}")
    _check_ledger_after(hostile, since, results)
    # The service resumes.
    g = generate(hostile.http, "Hello", hostile.ticket("acme", "acme-beta"), max_tokens=16)
    assert g.text.startswith(hostile.kit.adapters["beta"].marker)


LOCK_S = 15.0  # longer than SQLite's busy timeout (10 s): writers must give up, not wait


def test_database_locked_for_a_while(hostile: HostileStack) -> None:
    """An exclusive lock held past every busy timeout: a command fails cleanly and records
    nothing, a request gets an answer or an error (no hang), and all works once it goes."""
    db_file = hostile.settings.db_url.removeprefix("sqlite:///")
    ticket = hostile.ticket("acme", "acme-alpha")
    ledger = Ledger(make_engine(hostile.settings.db_url))
    lock = sqlite3.connect(db_file, timeout=1, isolation_level=None, check_same_thread=False)
    lock.execute("BEGIN EXCLUSIVE")
    released = threading.Timer(LOCK_S, lambda: (lock.execute("ROLLBACK"), lock.close()))
    released.start()
    with ThreadPoolExecutor(1) as pool:
        during = pool.submit(lambda: generate(hostile.http, "Hello", ticket, max_tokens=2))
        with pytest.raises(Exception) as e:
            hostile.registry.create_tenant("initech", actor="test")
        assert "locked" in str(e.value).lower(), e.value
        released.join()
        try:
            outcome = during.result(timeout=ANSWER_WITHIN_S).adapter_digest
        except TritonRefused as refused:
            outcome = f"refused: {refused.message}"
    print(f"request during a {LOCK_S:.0f}s database lock: {outcome}")
    key = hostile.registry.create_tenant("initech", actor="test")  # nothing half-written
    assert key.startswith("lp_")
    g = generate(hostile.http, "Hello", ticket, max_tokens=16)
    assert g.adapter_digest == hostile.digests["alpha"]
    assert not [r for r in ledger.query() if r.outcome == "running"]
