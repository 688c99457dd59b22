"""One tenant's flood through the real tritonserver does not decide another tenant's service.

The host runs two rows and queues six (``LORAPLANE_MAX_RUNNING=2``, ``LORAPLANE_MAX_QUEUED=6``).
acme floods it from twelve clients that send again as soon as they are answered, so its queue
stays full and many of its requests are refused as busy, each with its ledger row. Then globex
sends two. With one FIFO queue globex was refused as busy too, and would have waited behind
acme's six had it got in; with the waiting room shared between tenants
(``backend.serving.tenant_queues``) each of globex's requests takes the place of acme's newest
waiting one (refused as busy, on the record), goes to the next free row, ahead of acme's
requests that were waiting before it, and answers its own adapter's PEFT reference.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.ops.clients import Generation, TritonRefused, generate
from tests.integration.conftest import Stack, started_stack
from tests.integration.reference import Reference

pytestmark = pytest.mark.triton

LIMITS = {"LORAPLANE_MAX_RUNNING": "2", "LORAPLANE_MAX_QUEUED": "6"}
CLIENTS, FLOOD_TOKENS, TOKENS = 12, 64, 8
PROMPT = "Tell me a story about a quiet river"


@pytest.fixture(scope="module")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    before = {k: os.environ.get(k) for k in LIMITS}
    os.environ.update(LIMITS)  # the host's scheduler reads them
    try:
        with started_stack(kit_dir, tmp_path_factory, "fairness") as s:
            yield s
    finally:
        for k, v in before.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def test_a_flood_from_one_tenant_leaves_another_served_first(stack: Stack) -> None:
    flood_ticket = stack.ticket("acme", "acme-alpha")
    ticket = stack.ticket("globex", "globex-gamma")
    stop = threading.Event()
    refusals: list[TritonRefused] = []
    served: list[Generation] = []
    lock = threading.Lock()

    def flood() -> None:  # one acme client: sends again as soon as it is answered
        while not stop.is_set():
            try:
                g = generate(stack.grpc, PROMPT, flood_ticket, protocol="grpc",
                             max_tokens=FLOOD_TOKENS)
                with lock:
                    served.append(g)
            except TritonRefused as e:
                with lock:
                    refusals.append(e)

    def theirs() -> Generation:
        return generate(stack.grpc, PROMPT, ticket, protocol="grpc", max_tokens=TOKENS)

    with ThreadPoolExecutor(CLIENTS + 2) as pool:
        clients = [pool.submit(flood) for _ in range(CLIENTS)]
        try:
            deadline = time.monotonic() + 60
            while len(refusals) < 6:  # the queue is full, and acme keeps it full
                assert time.monotonic() < deadline, "acme's flood never filled the queue"
                time.sleep(0.02)
            mine = [pool.submit(theirs) for _ in range(2)]
            # with one FIFO queue these were refused: TritonRefused UNAVAILABLE "server busy"
            answers = [f.result(timeout=120) for f in mine]
        finally:
            stop.set()
            for c in clients:
                c.result(timeout=120)  # no acme client hangs either

    reference = Reference(stack.kit_dir / stack.kit.base_path,
                          stack.kit_dir / stack.kit.tokenizer_path)
    want = reference.generate(PROMPT, stack.kit_dir / stack.kit.adapters["gamma"].path, TOKENS)
    ledger = Ledger(make_engine(stack.settings.db_url))
    acme_rows = ledger.query(adapter=stack.digests["alpha"])
    for g in answers:
        assert g.text == want
        row = ledger.get(g.request_id)
        assert row is not None and (row.outcome, row.tenant) == ("ok", "globex")
        assert row.adapter_digest == stack.digests["gamma"]
        # acme's requests that the host took before this one and that ended after it: at least
        # the two it overtook in the queue (FIFO: none)
        overtaken = [r for r in acme_rows if r.outcome == "ok"
                     and r.admitted_at < row.admitted_at and r.finished_at > row.finished_at]
        assert len(overtaken) >= 2, (row, [(r.admitted_at, r.finished_at) for r in acme_rows])
    # every acme refusal is a clear UNAVAILABLE "busy" with its own row, and acme's alone
    assert refusals and all(e.status.endswith("UNAVAILABLE") and "busy" in e.message
                            for e in refusals), refusals[:3]
    # busy: the full queue; tenant_busy: over acme's part of the in-flight bound once globex
    # had requests in flight too (backend.serving.in_flight)
    busy = [r for r in ledger.query(since=0.0) if r.reason in ("busy", "tenant_busy")]
    assert {r.tenant for r in busy} == {"acme"} and len(busy) >= len(refusals)
    assert served and all(r.outcome in ("ok", "rejected") for r in acme_rows)
