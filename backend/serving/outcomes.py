"""How a request ends, on the ledger and to its caller: rows written first, then the answer.

Every request gets a ledger row (``backend.serving.recorder`` writes it, with this host's Merkle
log): a refusal's row is written before the refusal leaves; an admitted request's row is completed
when its sequence ends, durably, before the final answer leaves. The answer's ``adapter_digest``
and the row's ``served_digest`` come from the slot that computed the tokens, never from the
ticket: where they differ, the request fails closed as ``identity_mismatch`` and the client
learns nothing about either digest.

The service (``backend.serving.service``) owns one :class:`Outcomes`; it reads the service's
writer, stats and identity when it runs, so a service that swaps its writer (the open bench peer)
records through the one it swapped in. The service is typed by :class:`OutcomesService`, what this
desk uses of it, not by importing ``backend.serving.service``: the service imports this module, and
tests/test_architecture.py refuses the cycle even under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol

from backend.serving.engine_types import GenerationResult
from backend.serving.engine_types import Sequence as EngineSequence
from backend.serving.messages import (
    BUSY_MESSAGE,
    CANCELLED_MESSAGE,
    INTERNAL_MESSAGE,
    KV_BUDGET_MESSAGE,
    KV_BUDGET_REASON,
)
from backend.serving.recorder import LedgerWriter
from backend.serving.requests import Answer, AnswerSink, ServiceStats
from control.contracts.config import Settings
from control.contracts.ledger import Completion, LedgerEntry, Outcome
from control.contracts.tickets import GENERIC_REFUSAL, TicketClaims

log = logging.getLogger("loraplane.backend")


@dataclass
class Admitted:
    """A request past admission: its row is written and its sequence is with the scheduler."""

    request_id: str
    claims: TicketClaims
    sink: AnswerSink
    stream: bool
    seq: EngineSequence
    admitted_at: float
    delivered: int = 0  # tokens the client has received as streamed pieces


class Finisher(Protocol):
    """The service's completion step (``LoraService._finish``, which a test may replace)."""

    def _finish(self, adm: Admitted, result: GenerationResult, outcome: Outcome,
                reason: str | None) -> None: ...


class InFlight(Protocol):
    """The service's bound on requests in flight (``backend.serving.intake.Intake``)."""

    def done(self, request_id: str) -> None: ...


class OutcomesService(Protocol):
    """What :class:`Outcomes` uses of ``backend.serving.service.LoraService``, read when it runs
    (the open bench peer swaps ``writer`` after construction)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def host(self) -> str: ...
    @property
    def base_digest(self) -> str: ...
    @property
    def tokenizer_digest(self) -> str: ...
    @property
    def writer(self) -> LedgerWriter: ...
    @property
    def stats(self) -> ServiceStats: ...
    @property
    def intake(self) -> InFlight: ...


class SequenceSink:
    """Bridges the scheduler's callbacks to the service's completion path."""

    def __init__(self, service: Finisher, adm: Admitted) -> None:
        self.service, self.adm = service, adm

    def cancelled(self) -> bool:
        return self.adm.sink.cancelled()

    def token(self, piece: str) -> None:
        # The digest the slot's banks held for the passes that computed it (a row whose passes
        # saw another one is failed before any piece is sent), not the ticket's.
        served = self.adm.seq.served_digest()
        self.adm.sink.piece(piece, self.adm.request_id, told(self.adm.claims, served))
        self.adm.delivered = len(self.adm.seq.produced)

    def finish(self, result: GenerationResult, outcome: Outcome, reason: str | None) -> None:
        self.service._finish(self.adm, result, outcome, reason)


def told(claims: TicketClaims, served: str | None) -> str:
    """The ``adapter_digest`` a client is told: the digest the slot held, to the owner of the
    release only (the ticket's sealed ``disclose``); "" for the base alone and for everyone
    else, so a tenant granted another tenant's alias learns neither that tenant's adapter nor
    which arm of its rollout answered (the ledger keeps the digest either way)."""
    return (served or "") if claims.disclose else ""


class Collector:
    """A sink for the synchronous ``handle``: waits for one final answer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.final: Answer | None = None

    def cancelled(self) -> bool:
        return False

    def piece(self, text: str, request_id: str, adapter_digest: str) -> None:
        pass

    def answer(self, a: Answer) -> None:
        self.final = a
        self.done.set()


class Outcomes:
    """Rows and answers of one service's requests (see the module notes)."""

    def __init__(self, service: OutcomesService) -> None:
        self.service = service

    def entry(self, rid: str, claims: TicketClaims | None, now: float, *,
              outcome: Outcome = Outcome.RUNNING, reason: str | None = None) -> LedgerEntry:
        """The request's ledger row: who asked (from verified claims only), on what."""
        svc = self.service
        return LedgerEntry(
            request_id=rid,
            ticket_id=claims.jti if claims else None,
            tenant=claims.tenant if claims else None,
            model=svc.settings.model_name,
            host=svc.host,
            base_digest=svc.base_digest,
            adapter_digest=claims.adapter if claims else None,
            tokenizer_digest=svc.tokenizer_digest,
            admitted_at=now,
            outcome=outcome,
            reason=reason,
            release_digest=claims.release if claims else None,
        )

    def record_refusal(self, sink: AnswerSink, entry: LedgerEntry, error: str, status: str,
                       *, counted: bool = True) -> None:
        """Write the refusal's row, then answer (the row is durable first, or held for retry:
        the answer is an error either way)."""

        def answer(_durable: bool) -> None:
            if counted:
                self.service.intake.done(entry.request_id)
            sink.answer(Answer(ok=False, request_id=entry.request_id, error=error, status=status,
                               outcome=str(entry.outcome)))

        self.service.writer.insert(entry, answer)

    def refuse(self, sink: AnswerSink, rid: str, claims: TicketClaims | None, now: float,
               reason: str, error: str, status: str) -> None:
        self.record_refusal(sink, self.entry(rid, claims, now, outcome=Outcome.REJECTED,
                                             reason=reason), error, status)

    def finish(self, adm: Admitted, result: GenerationResult, outcome: Outcome,
               reason: str | None) -> None:
        """Complete the request's row (from the scheduler thread), then answer."""
        served = result.adapter_digest
        if outcome == Outcome.OK and served != adm.claims.adapter:
            outcome, reason = Outcome.IDENTITY_MISMATCH, "slot_digest"
        if outcome == Outcome.IDENTITY_MISMATCH:
            self.service.stats.identity_mismatches += 1
            # Operators' log: the request id and both digests; the client learns nothing.
            log.error("identity mismatch on request %s: ticket named %s, slot held %s (%s)",
                      adm.request_id, adm.claims.adapter, served, reason)
        # A request ended by the kill switch records what the client received: the pieces
        # already streamed, nothing of a unary answer that was never sent.
        delivered = adm.delivered if adm.stream else 0
        done = Completion(adm.request_id, outcome, result.tokens_in,
                          delivered if outcome == Outcome.REVOKED else result.tokens_out,
                          reason=reason, served_digest=served)
        # If the row cannot be written now, the client gets a failure, and the row held for
        # retry says so, with the tokens the client did receive as streamed pieces.
        unrecorded = Completion(adm.request_id, Outcome.FAILED, result.tokens_in, delivered,
                                reason="ledger_unavailable", served_digest=served)
        self.service.writer.complete(
            done, lambda durable: self.answer(adm, result, outcome if durable
                                              else Outcome.FAILED, reason, served),
            if_unrecorded=unrecorded, output=result.text if outcome == Outcome.OK else None)

    def answer(self, adm: Admitted, result: GenerationResult, outcome: Outcome,
               reason: str | None, served: str | None) -> None:
        """The final answer, once the row is written: only ``OK`` carries text and a digest;
        every other outcome is one of the fixed messages."""
        stats = self.service.stats
        rid = adm.request_id
        self.service.intake.done(rid)
        if outcome == Outcome.OK:
            stats.served += 1
            text = "" if adm.stream else result.text
            a = Answer(ok=True, text=text, request_id=rid,
                       adapter_digest=told(adm.claims, served), outcome=outcome)
        elif outcome == Outcome.CANCELLED:
            stats.cancelled += 1
            a = Answer(ok=False, request_id=rid, error=CANCELLED_MESSAGE, status="cancelled",
                       outcome=outcome)
        elif outcome == Outcome.REVOKED or (outcome == Outcome.REJECTED
                                            and reason == "revoked"):
            # Revoked while queued (refused) or running (the kill switch): the one generic
            # refusal, as for a ticket whose adapter was revoked before it arrived.
            a = Answer(ok=False, request_id=rid, error=GENERIC_REFUSAL, status="invalid_arg",
                       outcome=outcome)
        elif outcome == Outcome.REJECTED and reason == KV_BUDGET_REASON:
            a = Answer(ok=False, request_id=rid, error=KV_BUDGET_MESSAGE, status="invalid_arg",
                       outcome=outcome)
        elif outcome == Outcome.REJECTED:  # busy once admitted: the scheduler queue was full
            # (refused at submit, or displaced from it by a tenant holding less of it)
            stats.refuse("busy")
            a = Answer(ok=False, request_id=rid, error=BUSY_MESSAGE, status="unavailable",
                       outcome=outcome)
        else:
            if outcome == Outcome.FAILED:
                stats.failed += 1
            a = Answer(ok=False, request_id=rid, error=INTERNAL_MESSAGE, status="internal",
                       outcome=outcome)
        adm.sink.answer(a)
