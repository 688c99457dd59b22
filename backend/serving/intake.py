"""A request's way in: the bound on requests in flight, then the admission steps in order.

The bound (``backend.serving.in_flight``) counts a request from its arrival; once its ticket is
verified (step 1), a tenant over its part of the bound is refused as busy.

1. the ticket is verified, 2. governance is checked (``backend.serving.admission``), 3. the
request's own parameters are checked, release defaults filled in; only then may any adapter bytes
be read: 4. the adapter is leased from the governed cache, 5. the engine opens the sequence (its
slot pinned), 6. the running row is written, durably, 7. the sequence joins the scheduler. Every
way out of a step records a refusal (``backend.serving.outcomes``) and gives back what it holds.

No admission thread waits for an adapter to load: a request whose adapter is not resident leaves
its thread at step 4 and comes back to these threads, for steps 5-7, when the load ends
(``AdapterCache.acquire_async``). Before, the eight threads blocked on loads, and with Zipf
traffic over 1,000 adapters requests whose adapters were resident queued behind them.

The steps the service lets a subclass or a test replace (``_authorize``,
``_generation_request``, ``_write_running``, ``_finish``) are called on the service itself. The
service is typed by :class:`IntakeService`, what this desk uses of it, not by importing
``backend.serving.service``: the service imports this module, and tests/test_architecture.py
refuses the cycle even under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

from backend.serving.admission import RequestRefused
from backend.serving.cache import AdapterCache, CacheClaim, CacheRefused
from backend.serving.engine_types import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    Sequence,
)
from backend.serving.in_flight import TENANT_BUSY, InFlightBook
from backend.serving.lease import Lease, Violations
from backend.serving.messages import (
    BUSY_MESSAGE,
    FAILURE_MESSAGE,
    INTERNAL_MESSAGE,
    KV_BUDGET_REASON,
    LIMITS_MESSAGE,
    PARAMETER_PREFIX,
    InvalidInput,
)
from backend.serving.outcomes import Admitted, Outcomes, SequenceSink
from backend.serving.prefix_cache import PrefixKey, TenantSalts
from backend.serving.requests import AnswerSink, IncomingRequest, ServiceStats
from backend.serving.sampling import InvalidParameter
from backend.serving.scheduler import (
    AdapterRevoked,
    OverKVBudget,
    QueueFull,
    Scheduler,
    SchedulerLimits,
)
from control.contracts.ledger import LedgerEntry, Outcome
from control.contracts.tickets import GENERIC_REFUSAL, TicketClaims, TicketRejected

log = logging.getLogger("loraplane.backend")


class SequenceOpener(Protocol):
    """What admission uses of the engine: a lease's violation counter, and the opening of a
    validated sequence with its slot pinned."""

    @property
    def violations(self) -> Violations: ...

    def open_sequence(self, request: GenerationRequest, lease: Lease | None = None
                      ) -> Sequence: ...


class IntakeService(Protocol):
    """What :class:`Intake` uses of ``backend.serving.service.LoraService``."""

    @property
    def limits(self) -> SchedulerLimits: ...
    @property
    def stats(self) -> ServiceStats: ...
    @property
    def outcomes(self) -> Outcomes: ...
    @property
    def engine(self) -> SequenceOpener: ...
    @property
    def cache(self) -> AdapterCache: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def salts(self) -> TenantSalts: ...
    @property
    def base_digest(self) -> str: ...
    @property
    def tokenizer_digest(self) -> str: ...

    def _authorize(self, req: IncomingRequest
                   ) -> tuple[TicketClaims, Mapping[str, object], CacheClaim]: ...

    def _generation_request(self, req: IncomingRequest, claims: TicketClaims,
                            defaults: Mapping[str, object]) -> GenerationRequest: ...

    def _write_running(self, entry: LedgerEntry) -> None: ...

    def _finish(self, adm: Admitted, result: GenerationResult, outcome: Outcome,
                reason: str | None) -> None: ...


@dataclass(frozen=True)
class _Leased:
    """A request that passed steps 1-3, waiting for its lease."""

    rid: str
    now: float
    req: IncomingRequest
    sink: AnswerSink
    claims: TicketClaims
    gen: GenerationRequest


class Intake:
    """Admits one service's requests on its admission threads (see the module notes)."""

    def __init__(self, service: IntakeService) -> None:
        self.service = service
        # the host's bound, and each verified tenant's part of it (backend.serving.in_flight)
        self.book = InFlightBook(lambda: service.limits.in_flight_bound())
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="admission")

    def submit(self, req: IncomingRequest, sink: AnswerSink) -> None:
        """See ``LoraService.submit``."""
        svc = self.service
        rid = str(uuid.uuid4())
        if not self.book.enter(rid):
            # No ticket is verified for a busy refusal: under overload the host spends nothing
            # it can avoid. The row records the refusal, without a tenant.
            svc.stats.refuse("busy")
            svc.outcomes.record_refusal(
                sink, svc.outcomes.entry(rid, None, time.time(), outcome=Outcome.REJECTED,
                                         reason="busy"),
                BUSY_MESSAGE, "unavailable", counted=False)
            return
        self._pool.submit(self.admit, rid, req, sink)

    def done(self, request_id: str) -> None:
        """A request counted in flight was answered."""
        self.book.done(request_id)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def admit(self, rid: str, req: IncomingRequest, sink: AnswerSink) -> None:
        now = time.time()
        with self._failing(rid, now, sink):
            self._admit_checked(rid, now, req, sink)

    @contextmanager
    def _failing(self, rid: str, now: float, sink: AnswerSink) -> Iterator[None]:
        """Around each admission step: an unexpected error is the request's failure."""
        try:
            yield
        except Exception:
            # Nothing was answered or handed to the scheduler, and nothing stays leased (see
            # _admit_checked): the row records the failure before the answer leaves.
            log.exception("admission failed")
            self.service.stats.failed += 1
            outcomes = self.service.outcomes
            outcomes.record_refusal(sink, outcomes.entry(rid, None, now, outcome=Outcome.FAILED,
                                                         reason="admission"),
                                    INTERNAL_MESSAGE, "internal")

    def _admit_checked(self, rid: str, now: float, req: IncomingRequest,
                       sink: AnswerSink) -> None:
        svc = self.service
        refuse = svc.outcomes.refuse
        claims: TicketClaims | None = None
        # 1. the ticket, 2. governance, 3. the request's own parameters; only then may any
        # adapter bytes be read
        try:
            claims, defaults, owner = svc._authorize(req)
            gen = svc._generation_request(req, claims, defaults)
        except (TicketRejected, RequestRefused) as e:
            svc.stats.refuse(e.reason)
            # Claims of a ticket that failed verification are never recorded: unproven.
            if isinstance(e, RequestRefused) and e.claims is not None:
                claims = e.claims  # verified, then refused by governance: on the row
            refuse(sink, rid, claims, now, e.reason, GENERIC_REFUSAL, "invalid_arg")
            return
        except InvalidParameter as e:
            svc.stats.refuse(f"invalid_{e.name}")
            refuse(sink, rid, claims, now, f"invalid_{e.name}", str(e), "invalid_arg")
            return
        except InvalidInput as e:
            svc.stats.refuse(e.reason)
            refuse(sink, rid, claims, now, e.reason, str(e), "invalid_arg")
            return
        if not self.book.verified(rid, claims.tenant):  # over its part of the bound
            svc.stats.refuse(TENANT_BUSY)
            refuse(sink, rid, claims, now, TENANT_BUSY, BUSY_MESSAGE, "unavailable")
            return

        step = _Leased(rid, now, req, sink, claims, gen)
        if claims.adapter is None:
            self._open(step, Lease(None, svc.engine.violations))
            return
        # 4. the lease. A resident adapter's is ready now; otherwise this thread does not wait
        # for the load (a request whose adapter is resident would queue behind it): the load's
        # end brings the request back onto these threads.
        pending = svc.cache.acquire_async(claims.adapter, claims.tenant, claim=owner)
        if pending.done():
            self._leased(step, pending)
        else:
            pending.add_done_callback(partial(self._resume, step))

    def _resume(self, step: _Leased, pending: Future[Lease]) -> None:
        """On the thread that ended the load: the rest of the admission, on these threads."""
        try:
            self._pool.submit(self._resumed, step, pending)
        except RuntimeError:  # shut down (the service is closing): here, then
            self._resumed(step, pending)

    def _resumed(self, step: _Leased, pending: Future[Lease]) -> None:
        with self._failing(step.rid, step.now, step.sink):
            self._leased(step, pending)

    def _leased(self, step: _Leased, pending: Future[Lease]) -> None:
        svc = self.service
        try:
            lease = pending.result()
        except CacheRefused as e:
            # Not served, so "rejected": the incident view lists only what a digest served.
            svc.stats.load_failures += 1
            revoked = e.reason == "revoked"
            svc.outcomes.refuse(step.sink, step.rid, step.claims, step.now,
                                "revoked" if revoked else f"adapter_{e.reason}"[:64],
                                GENERIC_REFUSAL if revoked else FAILURE_MESSAGE,
                                "invalid_arg" if revoked else "unavailable")
            return
        self._open(step, lease)

    def _open(self, step: _Leased, lease: Lease) -> None:
        """5. open the sequence, 6. write the running row, 7. hand it to the scheduler."""
        svc = self.service
        refuse = svc.outcomes.refuse
        rid, now, req, sink, claims, gen = (step.rid, step.now, step.req, step.sink,
                                            step.claims, step.gen)
        # From here the lease is this function's until the scheduler takes it: every way out
        # below releases it or hands it over, exactly once.
        try:
            seq = svc.engine.open_sequence(gen, lease)
        except (InvalidRequestError, EngineError) as e:
            lease.release()
            parameter = str(e).startswith(PARAMETER_PREFIX)
            limits = isinstance(e, InvalidRequestError)
            refuse(sink, rid, claims, now,
                   "request_limits" if limits else "adapter_load",
                   str(e) if parameter else LIMITS_MESSAGE if limits else FAILURE_MESSAGE,
                   "invalid_arg" if limits else "unavailable")
            return
        except BaseException:
            lease.release()
            raise
        try:
            svc._write_running(replace(svc.outcomes.entry(rid, claims, now),
                                       max_tokens=gen.max_tokens, temperature=gen.temperature,
                                       top_p=gen.top_p, seed=gen.seed))
        except BaseException:
            lease.release()  # nothing may stay referenced by a row that was never written
            raise
        adm = Admitted(rid, claims, sink, req.stream, seq, now)
        key = PrefixKey(svc.base_digest, claims.adapter, svc.tokenizer_digest,
                        tuple(seq.prompt_ids), salt=svc.salts.of(claims.tenant)
                        ) if gen.temperature == 0.0 else None
        try:
            svc.scheduler.submit(seq, SequenceSink(svc, adm), stream=req.stream, key=key,
                                 tenant=claims.tenant)
        except OverKVBudget:
            lease.release()
            svc.stats.refuse(KV_BUDGET_REASON)
            svc._finish(adm, seq.result(""), Outcome.REJECTED, KV_BUDGET_REASON)
        except QueueFull:
            lease.release()
            svc._finish(adm, seq.result(""), Outcome.REJECTED, "busy")
        except AdapterRevoked:  # revoked since this request passed governance
            lease.release()
            svc.stats.refuse("revoked")
            svc._finish(adm, seq.result(""), Outcome.REJECTED, "revoked")
