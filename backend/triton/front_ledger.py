"""The ledger rows the front model writes itself: requests the engine model never answered.

The engine model writes a row for every request it receives. A request the front could not hand
to it, or whose answer never came back (the engine's stub died, was killed or is restarting),
reached no engine: the front, which survived, writes that request's row, so that it does not
vanish from the record. Such a row names no tenant and no digest: the front never verifies a
ticket (the engine does), so it records only what it knows: the host, the model, the base the
host serves, when, ``failed``, and why (:data:`ENGINE_UNAVAILABLE`).

The rows go through the same idempotent, retrying write as the engine's
(``backend.serving.recorder.write_durably``), opened on the first failure from the host's
environment (``LORAPLANE_DB_URL``, ``LORAPLANE_HOST_ID``, ``LORAPLANE_BASE_DIGEST``), and are
written off the stub's event loop.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from backend.serving.recorder import write_durably
from control.contracts.config import BASE_DIGEST_ENV, HOST_ID_ENV, Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, LedgerEntry, Outcome
from control.contracts.wire import MODEL

log = logging.getLogger("loraplane.backend.front")

ENGINE_UNAVAILABLE = "engine_unavailable"


class FrontLedger:
    """Writes the row of a request the engine never answered (see the module notes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ledger: Ledger | None = None
        self.written = 0

    def _open(self) -> Ledger:
        with self._lock:
            if self._ledger is None:
                self._ledger = Ledger(make_engine(Settings.from_env().db_url))
            return self._ledger

    def record_failure(self, detail: str) -> str:
        """Write a ``failed`` row for one request the engine never answered; returns its
        request id ("" when even that write failed, which is logged)."""
        now = time.time()
        entry = LedgerEntry(
            request_id=str(uuid.uuid4()), ticket_id=None, tenant=None, model=MODEL,
            host=os.environ.get(HOST_ID_ENV) or socket.gethostname(),
            base_digest=os.environ.get(BASE_DIGEST_ENV) or None, adapter_digest=None,
            tokenizer_digest=None, admitted_at=now, finished_at=now, tokens_in=0,
            tokens_out=0, outcome=Outcome.FAILED, reason=ENGINE_UNAVAILABLE)
        log.error("the engine model did not answer (%s): request %s recorded as failed",
                  detail[:200], entry.request_id)
        try:
            ledger = self._open()
            write_durably(lambda: ledger.admit([entry]))
        except Exception:
            log.exception("could not record request %s, which the engine never answered",
                          entry.request_id)
            return ""
        self.written += 1
        return entry.request_id
