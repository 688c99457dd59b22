"""The adapter cache's load records, written to the ledger off the serving threads.

Every cold load, failure and eviction leaves an ``adapter_loads`` row (the warm-up list, the
metrics' hit and miss counts and the operators' views read them). Written where the cache made
them, each was a database commit on a load worker or, for an eviction, under the cache's lock,
where it stalled every request's ``acquire`` and the scheduler's lease releases: with Zipf
traffic over 1,000 adapters, 20-odd loads and evictions a second (issue 24). Here one thread of
their own writes them, in the order the cache made them, as many as have queued in one
transaction. ``close`` writes what is queued before it returns; a record that cannot be written
is logged in full and dropped, as before (a database outage must not wedge the cache).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from control.contracts.ledger import AdapterLoad, Ledger

log = logging.getLogger("loraplane.backend")

MAX_BATCH = 256  # records in one transaction at most


class LoadRecords:
    """One writer thread for one host's load records; ``after`` runs for each, once written
    (or given up on), on that thread."""

    def __init__(self, ledger: Ledger, after: Callable[[AdapterLoad], None]) -> None:
        self.ledger, self.after = ledger, after
        self._queue: queue.SimpleQueue[AdapterLoad | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="load-records", daemon=True)
        self._thread.start()

    def put(self, load: AdapterLoad) -> None:
        if self._closed:  # after close: written here, so that nothing is lost
            self._write([load])
            return
        self._queue.put(load)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch = [] if first is None else [first]
            stop = first is None
            while not stop and len(batch) < MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    batch.append(more)
            if batch:
                self._write(batch)
            if stop:
                return

    def _write(self, batch: list[AdapterLoad]) -> None:
        try:
            self.ledger.record_loads(batch)
        except Exception:
            log.exception("could not record %d adapter load records: %s", len(batch), batch)
        for load in batch:
            try:
                self.after(load)
            except Exception:
                log.exception("after recording %s", load)
