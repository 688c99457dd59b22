"""The benchmark's open engine: the serving pipeline with governance taken out, for
``governed_vs_open`` (``control.tools.bench.engine``) and nothing else.

Governance costs three things on every request, and :class:`OpenService` overrides exactly the
hooks of :class:`backend.serving.service.LoraService` that pay for them, so the difference between
the
two engines is governance and nothing more:

- ``_authorize``: the ticket is still needed (it names the adapter), but each distinct ticket is
  verified once and remembered for good; no expiry re-check, no governance snapshot, no
  revocation, retired-key or release check;
- ``_write_running`` and the ledger writer: no ledger row is written, and an answer leaves as
  soon as it is ready instead of after its row is durable;
- ``_watch``: no governance watcher thread polls for revocations.

Scheduling, the adapter cache, the engine, the front model, BLS and the response path are the
production ones.

Why this is safe to ship: nothing a production process reads can select it. ``loraplane serve``
and ``triton-host`` always launch the committed ``model_repository/``, whose engine model builds
a :class:`backend.triton.glue.TritonGlue`; the open engine exists only in a repository that
:func:`open_repository` writes into a benchmark's own temporary folder, handed to a
``Deployment`` by the benchmark's code (``tests/control/tools/bench/test_bench_open.py`` checks
both).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from backend.serving.admission import ticket_from_parameters
from backend.serving.cache import CacheClaim
from backend.serving.recorder import LedgerWriter, Then
from backend.serving.service import IncomingRequest, LoraService
from backend.triton.glue import TritonGlue
from control.contracts.config import Settings
from control.contracts.ledger import Completion, LedgerEntry
from control.contracts.tickets import TicketClaims
from control.contracts.wire import ENGINE_MODEL
from control.ops.model_repositories import derived_repository
from control.ops.triton_server import MODEL_REPOSITORY

# The production engine model's import of its glue, and what the open repository puts instead.
PRODUCTION_GLUE_IMPORT = "from backend.triton.glue import TritonGlue"
OPEN_GLUE_IMPORT = "from control.tools.bench.open_peer import OpenGlue as TritonGlue"


class UnrecordedWriter(LedgerWriter):
    """A ledger writer that writes nothing: every callback runs at once, as if durable."""

    def __init__(self) -> None:  # no thread and no database: there is nothing to write
        self.written = 0

    def insert(self, entry: LedgerEntry, then: Then) -> None:
        then(True)

    def complete(self, completion: Completion, then: Then,
                 if_unrecorded: Completion | None = None, output: str | None = None) -> None:
        then(True)

    def backlog(self) -> int:
        return 0

    def close(self, timeout_s: float = 30.0) -> None:
        pass


class OpenService(LoraService):
    """:class:`LoraService` without ticket re-checks, governance, ledger or watcher (see the
    module notes). Benchmarks only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The governed writer's thread has nothing queued yet; stop it rather than leave it idle.
        self.writer.close()
        self.writer = UnrecordedWriter()
        self._claims: dict[str, TicketClaims] = {}

    def _authorize(self, req: IncomingRequest
                   ) -> tuple[TicketClaims, Mapping[str, object], CacheClaim]:
        token = ticket_from_parameters(req.parameters)
        claims = self._claims.get(token)
        if claims is None:
            claims = self.tickets.verify(token)
            self._claims[token] = claims
        # the bench's releases set no inference defaults; its one tenant owns what it asks for
        return claims, {}, CacheClaim(claims.tenant, claims.tenant)

    def _write_running(self, entry: LedgerEntry) -> None:
        pass

    def _watch(self) -> None:
        return


class OpenGlue(TritonGlue):
    """The Triton glue of the open repository's engine model: serves an :class:`OpenService`."""

    def make_service(self, settings: Settings, base: str, **kw: Any) -> LoraService:
        return OpenService(settings, base, **kw)


def open_engine_model_source() -> str:
    """The committed engine ``model.py`` with its glue swapped for :class:`OpenGlue`, so the
    open engine model differs from the production one in that line only."""
    source = (MODEL_REPOSITORY / ENGINE_MODEL / "1" / "model.py").read_text()
    if source.count(PRODUCTION_GLUE_IMPORT) != 1:
        raise RuntimeError(f"{ENGINE_MODEL}/1/model.py no longer imports its glue as "
                           f"{PRODUCTION_GLUE_IMPORT!r}; update control/tools/bench/open_peer.py")
    return source.replace(PRODUCTION_GLUE_IMPORT, OPEN_GLUE_IMPORT)


def open_repository(dest: Path) -> Path:
    """A model repository at ``dest`` whose engine model serves an :class:`OpenService`."""
    return derived_repository(dest, open_engine_model_source())
