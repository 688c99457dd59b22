"""The host's ledger writer: every request's row, batched, durable before its answer leaves.

One thread takes what the serving path hands it (rows to insert for refusals, completions for
requests that ran) and writes everything that is waiting in one transaction, retrying a short
outage a few times. Only then does each item's callback run, which sends the answer; so no
answer leaves before its row is durable, and a burst of refusals or completions costs one
transaction, not one each.

When the database stays away, nothing is dropped: the items go to a backlog, retried every
:data:`RETRY_S` until written, and each callback learns that its row is not yet durable. For a
completion, the caller gives the completion to keep instead (``if_unrecorded``): what the client
actually got, a failure once tokens may have been streamed, since a request that ran cannot be
answered ``ok`` without its row. A host that dies with a backlog leaves ``running`` rows, which
the next start marks failed (``host_restart``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from control.contracts.ledger import Completion, Ledger, LedgerEntry

log = logging.getLogger("loraplane.backend.ledger")

RETRY_S = 1.0
ATTEMPTS = 3
MAX_BATCH = 512

Then = Callable[[bool], None]  # called with True once durable, False when held for retry


def write_durably(write: Callable[[], None], attempts: int = ATTEMPTS) -> None:
    """Run a ledger write, retrying across a short database outage; raise the last error."""
    for n in range(attempts):
        try:
            write()
            return
        except Exception:
            log.warning("ledger write failed (attempt %d of %d)", n + 1, attempts,
                        exc_info=True)
            if n == attempts - 1:
                raise
            time.sleep(0.5 * (n + 1))


@dataclass
class _Item:
    entry: LedgerEntry | None
    completion: Completion | None
    if_unrecorded: Completion | None
    then: Then


class LedgerWriter:
    """Batches ledger writes on one thread; see the module notes."""

    def __init__(self, ledger: Ledger, *, retry_s: float = RETRY_S,
                 attempts: int = ATTEMPTS) -> None:
        self.ledger = ledger
        self.retry_s = retry_s
        self.attempts = attempts
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._backlog: list[_Item] = []
        self._backlog_lock = threading.Lock()
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def insert(self, entry: LedgerEntry, then: Then) -> None:
        """Write a finished row (a refusal); ``then(durable)`` runs after the attempt."""
        self._queue.put(_Item(entry, None, None, then))

    def complete(self, completion: Completion, then: Then,
                 if_unrecorded: Completion | None = None) -> None:
        """Finish a running row; ``if_unrecorded`` is kept for retry if it cannot be written."""
        self._queue.put(_Item(None, completion, if_unrecorded, then))

    def backlog(self) -> int:
        """Rows held for retry because the database was away."""
        with self._backlog_lock:
            return len(self._backlog)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (one last try for the backlog), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.retry_s)
            except queue.Empty:
                self._retry_backlog()
                continue
            if item is None:
                self._retry_backlog()
                return
            batch = [item]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            self._write(batch)
            self._retry_backlog()
            if stop:
                return

    def _write(self, batch: list[_Item]) -> None:
        entries = [i.entry for i in batch if i.entry is not None]
        completions = [i.completion for i in batch if i.completion is not None]
        durable = self._durably(entries, completions)
        if not durable:
            log.error("ledger unavailable: %d rows held for retry", len(batch))
            with self._backlog_lock:
                self._backlog += [_Item(i.entry, i.if_unrecorded or i.completion, None, i.then)
                                  for i in batch]
        else:
            self.written += len(batch)
        for i in batch:
            try:
                i.then(durable)
            except Exception:
                log.exception("answering after a ledger write failed")

    def _retry_backlog(self) -> None:
        # Only this thread changes the backlog; rows stay counted in it until they are written.
        with self._backlog_lock:
            held = list(self._backlog)
        if not held:
            return
        if self._durably([i.entry for i in held if i.entry is not None],
                         [i.completion for i in held if i.completion is not None], attempts=1):
            with self._backlog_lock:
                self._backlog = self._backlog[len(held):]
            self.written += len(held)
            log.warning("ledger back: %d held rows written", len(held))

    def _durably(self, entries: list[LedgerEntry], completions: list[Completion],
                 attempts: int | None = None) -> bool:
        try:
            write_durably(lambda: self.ledger.write(entries, completions),
                          self.attempts if attempts is None else attempts)
            return True
        except Exception:
            return False
