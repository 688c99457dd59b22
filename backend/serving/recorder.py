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

One row never holds others. Writes are idempotent by request id (``Ledger.write``), so a retry
after an unacknowledged commit is harmless. When a batch fails for a reason that retrying cannot
cure (a clash on a request id, a value the database refuses: :func:`permanent`), its items are
written one by one: the good ones become durable at once, and each row that fails alone is set
aside as *poisoned*: logged in full at ERROR (so an operator can restore it), counted
(``poisoned``, exported as ``loraplane_backend_ledger_poisoned``), kept in memory (the last
:data:`POISONED_KEPT`), its callback told it is not durable, and never retried with the others.
A failure that may pass (the database is away) still sends the whole batch to the backlog.

Given a :class:`~control.contracts.ledger_log.HostLog`, every final row (a refusal, a
completion) also enters the host's Merkle log in the same transaction, with the SHA-256 of the
output text the completion carried; the writer signs a checkpoint every
:data:`CHECKPOINT_S` seconds and when it closes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from control.contracts.ledger import Completion, Ledger, LedgerConflict, LedgerEntry, Outcome
from control.contracts.ledger_log import HostLog, LogRead, output_sha256

log = logging.getLogger("loraplane.backend.ledger")

RETRY_S = 1.0
ATTEMPTS = 3
MAX_BATCH = 512
POISONED_KEPT = 1000
CHECKPOINT_S = 10.0  # how often a host with a log signs a checkpoint (and on close)

Then = Callable[[bool], None]  # called with True once durable, False when held for retry


def permanent(error: BaseException) -> bool:
    """Whether retrying the same write can never succeed: the rows themselves are refused (a
    clash on a request id, a value out of a column's range), not the database unreachable."""
    return isinstance(error, (LedgerConflict, ValueError, TypeError, sa.exc.IntegrityError,
                              sa.exc.DataError))


def write_durably(write: Callable[[], None], attempts: int = ATTEMPTS) -> None:
    """Run a ledger write, retrying across a short database outage; raise the last error (at
    once when it is :func:`permanent`)."""
    for n in range(attempts):
        try:
            write()
            return
        except Exception as e:
            log.warning("ledger write failed (attempt %d of %d)", n + 1, attempts,
                        exc_info=True)
            if n == attempts - 1 or permanent(e):
                raise
            time.sleep(0.5 * (n + 1))


@dataclass(eq=False)  # items are told apart by identity: one callback each
class _Item:
    entry: LedgerEntry | None
    completion: Completion | None
    if_unrecorded: Completion | None
    then: Then
    output: str | None = None  # SHA-256 of the completion's output text, for the log


class LedgerWriter:
    """Batches ledger writes on one thread; see the module notes."""

    def __init__(self, ledger: Ledger, *, retry_s: float = RETRY_S,
                 attempts: int = ATTEMPTS, host: str | None = None,
                 checkpoint_s: float = CHECKPOINT_S) -> None:
        """``host``: keep that host's Merkle log of final rows (none without)."""
        self.ledger = ledger
        self.host_log = HostLog(ledger.engine, host) if host is not None else None
        self.checkpoint_s = checkpoint_s
        self._checkpointed_at = time.monotonic()
        self.retry_s = retry_s
        self.attempts = attempts
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._backlog: list[_Item] = []
        self._backlog_lock = threading.Lock()
        self.written = 0
        self.poisoned = 0  # rows set aside because they can never be written (see the notes)
        self.set_aside: deque[_Item] = deque(maxlen=POISONED_KEPT)
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def insert(self, entry: LedgerEntry, then: Then) -> None:
        """Write a finished row (a refusal); ``then(durable)`` runs after the attempt."""
        self._queue.put(_Item(entry, None, None, then))

    def complete(self, completion: Completion, then: Then,
                 if_unrecorded: Completion | None = None, output: str | None = None) -> None:
        """Finish a running row; ``if_unrecorded`` is kept for retry if it cannot be written.
        ``output``: the text the client gets, whose SHA-256 the host's log binds to the row
        (not to ``if_unrecorded``, which the client did not get as an answer)."""
        digest = output_sha256(output) if output is not None else None
        self._queue.put(_Item(None, completion, if_unrecorded, then, digest))

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
                self._checkpoint_if_due()
                continue
            if item is None:
                self._retry_backlog()
                self._checkpoint(final=True)
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
                self._checkpoint(final=True)
                return
            self._checkpoint_if_due()

    def _write(self, batch: list[_Item]) -> None:
        durable, held = self._write_isolating(batch, self.attempts)
        if held:
            log.error("ledger unavailable: %d rows held for retry", len(held))
            with self._backlog_lock:
                self._backlog += [_Item(i.entry, i.if_unrecorded or i.completion, None, i.then,
                                        None if i.if_unrecorded else i.output)
                                  for i in held]
        self.written += len(durable)
        for i in batch:
            try:
                i.then(i in durable)
            except Exception:
                log.exception("answering after a ledger write failed")

    def _retry_backlog(self) -> None:
        # Only this thread changes the backlog; rows stay counted in it until they are written
        # or set aside.
        with self._backlog_lock:
            held = list(self._backlog)
        if not held:
            return
        durable, still = self._write_isolating(held, attempts=1)
        if len(still) == len(held):
            return
        with self._backlog_lock:
            self._backlog = still + self._backlog[len(held):]
        self.written += len(durable)
        log.warning("ledger back: %d held rows written", len(durable))

    def _write_isolating(self, items: list[_Item], attempts: int) -> tuple[list[_Item],
                                                                             list[_Item]]:
        """Write ``items`` in one transaction; when that fails for good, one by one, setting
        aside each that fails alone. Returns (durable, held for retry)."""
        try:
            self._durably(items, attempts)
            return items, []
        except Exception as e:
            if not permanent(e):
                return [], items
        durable: list[_Item] = []
        held: list[_Item] = []
        for i in items:
            try:
                self._durably([i], attempts=1)
                durable.append(i)
            except Exception as e:
                if permanent(e):
                    self._set_aside(i, e)
                else:
                    held.append(i)
        return durable, held

    def _set_aside(self, item: _Item, error: BaseException) -> None:
        """A row that can never be written: logged in full, counted, kept, never retried."""
        self.poisoned += 1
        self.set_aside.append(item)
        row = item.entry if item.entry is not None else item.completion
        log.error("ledger row set aside, it can never be written (%s): %s",
                  type(error).__name__,
                  json.dumps(dataclasses.asdict(row) if row is not None else None,
                             default=str))

    def _durably(self, items: list[_Item], attempts: int) -> None:
        """Write the rows of ``items`` in one transaction (retried ``attempts`` times), their
        log entries with them; raise the last error."""
        entries = [i.entry for i in items if i.entry is not None]
        completions = [i.completion for i in items if i.completion is not None]
        host_log = self.host_log
        if host_log is None:
            write_durably(lambda: self.ledger.write(entries, completions), attempts)
            return
        final = [e.request_id for e in entries if e.outcome != Outcome.RUNNING]
        final += [c.request_id for c in completions]
        outputs = {i.completion.request_id: i.output for i in items if i.completion is not None}

        def write() -> None:
            appended: list[tuple[int, bytes]] = []
            seen: list[LogRead] = []

            def read(conn: Connection, ids: list[str]) -> dict[str, tuple[object, ...]]:
                seen.append(host_log.read(conn, ids))  # one read: the check's and the leaves'
                return seen[-1].rows

            self.ledger.write(entries, completions, None, lambda conn: appended.extend(
                host_log.append(conn, final, outputs, seen[-1] if seen else None)), read=read)
            host_log.committed(appended)

        write_durably(write, attempts)

    def _checkpoint_if_due(self) -> None:
        if self.host_log is not None and (
                time.monotonic() - self._checkpointed_at >= self.checkpoint_s):
            self._checkpoint()

    def _checkpoint(self, final: bool = False) -> None:
        """Sign the host log's checkpoint; a failure waits for the next one (the entries are
        durable already; only the signature over them is late)."""
        if self.host_log is None:
            return
        self._checkpointed_at = time.monotonic()
        try:
            self.host_log.checkpoint()
        except Exception:
            log.warning("ledger checkpoint failed%s", " at close" if final else "",
                        exc_info=True)
