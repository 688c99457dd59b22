"""An in-process serving home: the kit registered, tickets signable, a LoraService to drive.

Shared by the serving tests that need the real service (engine, cache, scheduler, ledger,
governance) without tritonserver: the regression, governance and fault-isolation tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backend.serving.cache import CacheQuota
from backend.serving.engine import Engine
from backend.serving.scheduler import SchedulerLimits
from backend.serving.service import Answer, LoraService
from control.app.registry import Registry
from control.app.serving_steps import RegistrySteps
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ticket_seals import publish_seal
from control.contracts.tickets import TicketSigner
from control.contracts.wire import TICKET_PARAM
from control.gateway.ticket_office import TicketOffice
from projections.routing import RoutingView
from tests.integration.conftest import ACTOR, provision

WAIT_S = 60.0


@dataclass
class Home:
    settings: Settings
    registry: Registry
    base_digest: str
    digests: dict[str, str]  # kit adapter name -> digest
    signer: TicketSigner
    office: TicketOffice
    kit_dir: Path

    def ticket(self, tenant: str, alias: str) -> dict[str, object]:
        """Request parameters carrying a fresh ticket for ``alias``."""
        return {TICKET_PARAM: self.office.issue(tenant, alias).token}

    def service(self, *, engine: Engine | None = None, max_adapters: int = 4,
                limits: SchedulerLimits | None = None, host: str = "test-host",
                prefix_cache_bytes: int = 0, quota: CacheQuota | None = None) -> LoraService:
        engine = engine or Engine(self.kit_dir / "base", self.kit_dir / "tokenizer",
                                  device="cpu", max_rank=self.settings.max_rank,
                                  max_adapters=max_adapters)
        return LoraService(self.settings, self.base_digest, host=host, engine=engine,
                           limits=limits or SchedulerLimits(max_running=8, max_queued=64),
                           prefix_cache_bytes=prefix_cache_bytes, quota=quota,
                           steps=RegistrySteps)


def provision_home(settings: Settings, kit_dir: Path) -> Home:
    """Register the kit (tenants acme and globex, see ``provision``) and a signing key."""
    settings.ensure_dirs()
    reg, _kit, _keys, digests = provision(settings, kit_dir)
    signer, _ = TicketSigner.load_or_create(settings.keys_dir)
    reg.record_signing_key(signer.kid, signer.public_b64, actor=ACTOR)
    publish_seal(make_engine(settings.db_url), signer)  # tests sign with it directly too
    routing = RoutingView(make_engine(settings.db_url))
    return Home(settings, reg, routing.bases()[0].digest, digests,
                signer, TicketOffice(settings, routing, signer), kit_dir)


class Sink:
    """An answer sink that records pieces and the final answer; its ``cancelled()`` can hold
    the scheduler thread at a gate, and its ``piece()`` can fail like a vanished client."""

    def __init__(self, *, cancelled: bool = False,
                 hold_until: Callable[[], bool] | None = None,
                 fail_pieces_after: int | None = None) -> None:
        self.is_cancelled = cancelled
        self.hold_until = hold_until
        self.fail_pieces_after = fail_pieces_after
        self.held = threading.Event()
        self.done = threading.Event()
        self.pieces: list[str] = []
        self.piece_digests: set[str] = set()
        self.final: Answer | None = None

    def cancelled(self) -> bool:
        if self.hold_until is not None:
            self.held.set()
            deadline = time.monotonic() + WAIT_S
            while not self.hold_until() and time.monotonic() < deadline:
                time.sleep(0.005)
            self.hold_until = None
        return self.is_cancelled

    def piece(self, text: str, request_id: str, adapter_digest: str) -> None:
        if self.fail_pieces_after is not None and len(self.pieces) >= self.fail_pieces_after:
            raise BrokenPipeError("client gone")
        self.pieces.append(text)
        self.piece_digests.add(adapter_digest)

    def answer(self, a: Answer) -> None:
        self.final = a
        self.done.set()

    def wait(self) -> Answer:
        assert self.done.wait(WAIT_S), "no answer in time"
        assert self.final is not None
        return self.final


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
    """Poll ``cond`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.005)
    return time.monotonic() - t0
