"""The serving pipeline behind the Triton models, importable and testable without Triton.

For each request Triton hands over: read the ticket from the request parameters, verify it, check
it against governance (revocations, retired keys, its release; ``backend.serving.admission``),
check the request's own parameters, and only then lease the adapter the verified ticket names
from the governed cache (``backend.serving.cache``: loaded from the content-addressed store by
digest, bytes checked against the digest). The ledger row is written (durable) before the
sequence joins the continuous batch (``backend.serving.scheduler``); tokens stream to the
caller's sink; when the sequence ends its ledger row is completed, durably, before the final
answer leaves (``backend.serving.recorder``). A greedy prompt's prefix-cache key carries the
salt of the verified ticket's tenant (``backend.serving.prefix_cache``): no tenant shares one.

Nothing a client sends other than a verified ticket can choose an adapter: no name, path or digest
in any parameter is read.

Provenance: the answer's ``adapter_digest`` and the ledger's ``served_digest`` are read from the
slot that computed the tokens (``GenerationResult.adapter_digest``), never copied from the ticket.
Where they differ from the ticket's adapter, the request fails closed as ``identity_mismatch``.

Every request gets a ledger row: served, refused (ticket, governance, parameters, limits, loads),
busy, failed at admission, failed in the engine, cancelled.

Revocation is pushed to the host, not only checked per request: a watcher thread reads the
governance snapshot every :data:`WATCH_INTERVAL_S` (and on PostgreSQL wakes on the projection
follower's NOTIFY), so an idle host purges, drains and unloads a revoked adapter and records the
three steps within a second of the revocation. Admitted work is covered too: requests queued on
the digest are refused (``rejected``, reason ``revoked``); running ones drain, or, when the
revocation is the kill switch (``adapter revoke --immediate``), end before their next token
(``revoked``, with the tokens the client received), each with the generic refusal.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from backend.serving.admission import (
    RequestRefused,
    VerifiedTickets,
    check_governance,
    ticket_from_parameters,
)
from backend.serving.cache import AdapterCache, CacheBudgets, CacheQuota, CacheRefused
from backend.serving.engine import (
    DecodeBatch,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
)
from backend.serving.engine import Sequence as EngineSequence
from backend.serving.lease import Lease
from backend.serving.memory import AdapterBudget
from backend.serving.memory_report import resident_memory
from backend.serving.messages import (
    BUSY_MESSAGE,
    CANCELLED_MESSAGE,
    FAILURE_MESSAGE,
    INTERNAL_MESSAGE,
    LIMITS_MESSAGE,
    PARAMETER_PREFIX,
    InvalidInput,
)
from backend.serving.prefix_cache import PrefixCache, PrefixKey, TenantSalts
from backend.serving.recorder import LedgerWriter, write_durably
from backend.serving.requests import (
    Answer,
    AnswerSink,
    IncomingRequest,
    RevocationSteps,
    ServiceStats,
)
from backend.serving.sampling import InvalidParameter, check_sampling
from backend.serving.scheduler import AdapterRevoked, QueueFull, Scheduler, SchedulerLimits
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import AdapterLoad, Completion, Ledger, LedgerEntry, Outcome
from control.contracts.sampling import with_defaults
from control.contracts.store import ArtifactStore
from control.contracts.tickets import (
    GENERIC_REFUSAL,
    TicketClaims,
    TicketRejected,
    TicketVerifier,
    load_public_keys,
)
from control.contracts.wire import TEXT_INPUT
from projections.host_view import ChangeListener, GovernanceState, HostGovernance, tokenizer_of

log = logging.getLogger("loraplane.backend")

MAX_PROMPT_CHARS = 8192
PREFIX_CACHE_BYTES = 64 * 2**20
WATCH_INTERVAL_S = 0.1
__all__ = ["BUSY_MESSAGE", "FAILURE_MESSAGE", "LIMITS_MESSAGE", "Answer", "AnswerSink",
           "IncomingRequest", "LoraService", "RequestRefused", "RevocationSteps", "ServiceStats",
           "ticket_from_parameters"]



@dataclass
class _Admitted:
    request_id: str
    claims: TicketClaims
    sink: AnswerSink
    stream: bool
    seq: EngineSequence
    admitted_at: float
    delivered: int = 0  # tokens the client has received as streamed pieces


class _SequenceSink:
    """Bridges the scheduler's callbacks to the service's completion path."""

    def __init__(self, service: LoraService, adm: _Admitted) -> None:
        self.service, self.adm = service, adm

    def cancelled(self) -> bool:
        return self.adm.sink.cancelled()

    def token(self, piece: str) -> None:
        # The digest the slot's banks held for the passes that computed it (a row whose passes
        # saw another one is failed before any piece is sent), not the ticket's.
        served = self.adm.seq.served_digest()
        self.adm.sink.piece(piece, self.adm.request_id, served or "")
        self.adm.delivered = len(self.adm.seq.produced)

    def finish(self, result: GenerationResult, outcome: Outcome, reason: str | None) -> None:
        self.service._finish(self.adm, result, outcome, reason)


class _Collector:
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


class LoraService:
    """Verifies, admits, schedules and records; one per Triton engine model instance."""

    def __init__(
        self,
        settings: Settings,
        base_digest: str,
        *,
        host: str | None = None,
        engine: Engine | None = None,
        limits: SchedulerLimits | None = None,
        budgets: CacheBudgets | None = None,
        quota: CacheQuota | None = None,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        watch_interval_s: float = WATCH_INTERVAL_S,
        steps: Callable[[Settings], RevocationSteps],
    ) -> None:
        """``steps`` opens where this host records its revocation steps; called on the first
        revocation, off the request path (the Triton model's entry point passes
        ``control.app.serving_steps.RegistrySteps``)."""
        self.settings = settings
        self.host = host or socket.gethostname()
        db = make_engine(settings.db_url)
        # trusts only signing keys its configured root vouches for (never the database's say)
        self.governance = HostGovernance(db, keys_dir=settings.keys_dir)
        self.ledger = Ledger(db)
        self.writer = LedgerWriter(self.ledger, host=self.host)  # with this host's Merkle log
        self.store = ArtifactStore(settings.store_dir)
        tokenizer = tokenizer_of(db, base_digest)
        if tokenizer is None:
            raise RuntimeError("the base model digest to serve is not registered")
        self.base_digest = base_digest
        self.tokenizer_digest = tokenizer
        if engine is None:
            engine = Engine(
                self.store.verify(base_digest),
                self.store.verify(self.tokenizer_digest),
                max_rank=settings.max_rank,
                budget=AdapterBudget.from_settings(settings),
            )
        self.engine = engine
        self.limits = limits or SchedulerLimits.from_env()
        self.prefix_cache: PrefixCache[DecodeBatch] = PrefixCache(prefix_cache_bytes)
        self.salts = TenantSalts()  # prefix-cache keys are per tenant, from verified tickets
        quota = quota or CacheQuota(resident_share=settings.resident_share)
        self.cache = AdapterCache(engine, self.store.read_verified, budgets=budgets, quota=quota,
                                  on_event=self._record_load,
                                  on_purge=self.prefix_cache.purge_adapter,
                                  violations=engine.violations)
        self.scheduler = Scheduler(engine, self.limits, self.prefix_cache)
        self.tickets = VerifiedTickets(self._load_verifier)
        self.stats = ServiceStats()
        # Revoked before this process started: never resident here, nothing to drain or report.
        start = self.governance.current()
        self._known_revoked: frozenset[str] = start.revoked
        self._known_killed: frozenset[str] = start.killed
        self._governance_lock = threading.Lock()
        self._reported_revocations: set[str] = set()
        self._open_step_log = steps
        self._step_log: RevocationSteps | None = None
        self._steps = ThreadPoolExecutor(max_workers=1, thread_name_prefix="revocation-steps")
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._admission = ThreadPoolExecutor(max_workers=8, thread_name_prefix="admission")
        failed = self.ledger.fail_running(self.host)
        if failed:
            log.warning("marked %d requests left running by a previous process as failed", failed)
        self._closing = threading.Event()
        self._listener = ChangeListener.for_engine(db)
        self._watch_interval_s = watch_interval_s
        self._watcher = threading.Thread(target=self._watch, name="governance-watch",
                                         daemon=True)
        self._watcher.start()

    def _load_verifier(self) -> TicketVerifier:
        return TicketVerifier(
            load_public_keys(self.settings.keys_dir / "public"),
            model=self.settings.model_name,
            base=self.base_digest,
            tokenizer=self.tokenizer_digest,
            max_ttl_s=self.settings.ticket_max_ttl_s,
        )

    # -- entry points -----------------------------------------------------------------------

    def submit(self, req: IncomingRequest, sink: AnswerSink) -> None:
        """Take one request; its answer (and streamed pieces) go to ``sink`` later.

        Returns at once. Past the bound on requests in flight the sink gets a busy answer,
        after the refusal's ledger row is written.
        """
        with self._inflight_lock:
            busy = self._inflight >= self.limits.max_queued + self.limits.max_running
            if not busy:
                self._inflight += 1
        if busy:
            # No ticket is verified for a busy refusal: under overload the host spends nothing
            # it can avoid. The row records the refusal, without a tenant.
            self.stats.refuse("busy")
            rid = str(uuid.uuid4())
            self._record_refusal(sink, self._entry(rid, None, time.time(),
                                                   outcome=Outcome.REJECTED, reason="busy"),
                                 BUSY_MESSAGE, "unavailable", counted=False)
            return
        self._admission.submit(self._admit, req, sink)

    def handle(self, batch: Sequence[IncomingRequest]) -> list[Answer]:
        """Answer every request of a batch, in order (blocking; tests and simple callers)."""
        sinks = [_Collector() for _ in batch]
        for req, sink in zip(batch, sinks, strict=True):
            self.submit(req, sink)
        for sink in sinks:
            sink.done.wait()
        return [s.final for s in sinks if s.final is not None]

    def health(self) -> dict[str, int]:
        """Leases, pins, broken invariants, mismatches, ledger rows held for retry or set aside
        as unwritable, right now; prefix-cache lookups that hit and missed, so far."""
        return {
            "leases": self.cache.references(),
            "pins": sum(self.engine.pins().values()),
            "violations": self.engine.violations.total,
            "identity_mismatches": self.stats.identity_mismatches,
            "ledger_backlog": self.writer.backlog(),
            "ledger_poisoned": self.writer.poisoned,
            "prefix_hits": self.prefix_cache.stats.hits,
            "prefix_misses": self.prefix_cache.stats.misses,
        }

    def memory_report(self) -> dict[str, int]:
        """Bytes by category (``backend.serving.memory_report``): the engine, the running batch, the
        prefix cache."""
        return resident_memory(self.engine, self.scheduler, self.prefix_cache)

    def close(self) -> None:
        """Stop the watcher, the scheduler, and the worker threads; write what is queued."""
        self._closing.set()
        self._watcher.join(timeout=5)
        self.scheduler.stop()
        self._admission.shutdown(wait=True)
        self._steps.shutdown(wait=True)
        self.writer.close()
        self._listener.close()

    # -- admission --------------------------------------------------------------------------

    def _done(self) -> None:
        with self._inflight_lock:
            self._inflight -= 1

    def _record_refusal(self, sink: AnswerSink, entry: LedgerEntry, error: str, status: str,
                        *, counted: bool = True) -> None:
        """Write the refusal's row, then answer (the row is durable first, or held for retry:
        the answer is an error either way)."""

        def answer(_durable: bool) -> None:
            if counted:
                self._done()
            sink.answer(Answer(ok=False, request_id=entry.request_id, error=error, status=status,
                               outcome=str(entry.outcome)))

        self.writer.insert(entry, answer)

    def _admit(self, req: IncomingRequest, sink: AnswerSink) -> None:
        rid, now = str(uuid.uuid4()), time.time()
        try:
            self._admit_checked(rid, now, req, sink)
        except Exception:
            # Nothing was answered or handed to the scheduler, and nothing stays leased (see
            # _admit_checked): the row records the failure before the answer leaves.
            log.exception("admission failed")
            self.stats.failed += 1
            self._record_refusal(sink, self._entry(rid, None, now, outcome=Outcome.FAILED,
                                                   reason="admission"),
                                 INTERNAL_MESSAGE, "internal")

    def _admit_checked(self, rid: str, now: float, req: IncomingRequest,
                       sink: AnswerSink) -> None:
        claims: TicketClaims | None = None
        # 1. the ticket, 2. governance, 3. the request's own parameters; only then may any
        # adapter bytes be read
        try:
            claims, defaults = self._authorize(req)
            gen = self._generation_request(req, claims, defaults)
        except (TicketRejected, RequestRefused) as e:
            self.stats.refuse(e.reason)
            # Claims of a ticket that failed verification are never recorded: unproven.
            if isinstance(e, RequestRefused) and e.claims is not None:
                claims = e.claims  # verified, then refused by governance: on the row
            self._refuse(sink, rid, claims, now, e.reason, GENERIC_REFUSAL, "invalid_arg")
            return
        except InvalidParameter as e:
            self.stats.refuse(f"invalid_{e.name}")
            self._refuse(sink, rid, claims, now, f"invalid_{e.name}", str(e), "invalid_arg")
            return
        except InvalidInput as e:
            self.stats.refuse(e.reason)
            self._refuse(sink, rid, claims, now, e.reason, str(e), "invalid_arg")
            return

        if claims.adapter is None:
            lease = Lease(None, self.engine.violations)
        else:
            try:
                lease = self.cache.acquire(claims.adapter, claims.tenant)
            except CacheRefused as e:
                # Not served, so "rejected": the incident view lists only what a digest served.
                self.stats.load_failures += 1
                revoked = e.reason == "revoked"
                self._refuse(sink, rid, claims, now,
                             "revoked" if revoked else f"adapter_{e.reason}"[:64],
                             GENERIC_REFUSAL if revoked else FAILURE_MESSAGE,
                             "invalid_arg" if revoked else "unavailable")
                return
        # From here the lease is this function's until the scheduler takes it: every way out
        # below releases it or hands it over, exactly once.
        try:
            seq = self.engine.open_sequence(gen, lease)
        except (InvalidRequestError, EngineError) as e:
            lease.release()
            parameter = str(e).startswith(PARAMETER_PREFIX)
            limits = isinstance(e, InvalidRequestError)
            self._refuse(sink, rid, claims, now,
                         "request_limits" if limits else "adapter_load",
                         str(e) if parameter else LIMITS_MESSAGE if limits else FAILURE_MESSAGE,
                         "invalid_arg" if limits else "unavailable")
            return
        except BaseException:
            lease.release()
            raise
        try:
            self._write_running(replace(self._entry(rid, claims, now),
                                        max_tokens=gen.max_tokens, temperature=gen.temperature,
                                        top_p=gen.top_p, seed=gen.seed))
        except BaseException:
            lease.release()  # nothing may stay referenced by a row that was never written
            raise
        adm = _Admitted(rid, claims, sink, req.stream, seq, now)
        key = PrefixKey(self.base_digest, claims.adapter, self.tokenizer_digest,
                        tuple(seq.prompt_ids), salt=self.salts.of(claims.tenant)
                        ) if gen.temperature == 0.0 else None
        try:
            self.scheduler.submit(seq, _SequenceSink(self, adm), stream=req.stream, key=key)
        except QueueFull:
            lease.release()
            self.stats.refuse("busy")
            self._finish(adm, seq.result(""), Outcome.REJECTED, "busy")
        except AdapterRevoked:  # revoked since this request passed governance
            lease.release()
            self.stats.refuse("revoked")
            self._finish(adm, seq.result(""), Outcome.REJECTED, "revoked")

    def _authorize(self, req: IncomingRequest) -> tuple[TicketClaims, Mapping[str, object]]:
        """The verified claims of the request's ticket, if governance allows them now, and the
        inference defaults of the release the ticket names (its ``release`` claim: no lookup
        beyond the governance snapshot already read)."""
        claims = self.tickets.verify(ticket_from_parameters(req.parameters))
        state = self.governance.current()
        self._apply_governance(state)
        try:
            check_governance(claims, state)
        except RequestRefused as e:
            raise RequestRefused(e.reason, claims) from None
        bound = state.releases.get(claims.release) if claims.release is not None else None
        return claims, bound.defaults if bound is not None else {}

    def _write_running(self, entry: LedgerEntry) -> None:
        """The admitted request's row, durable before any token is computed."""
        write_durably(lambda: self.ledger.admit([entry]))

    def _refuse(self, sink: AnswerSink, rid: str, claims: TicketClaims | None, now: float,
                reason: str, error: str, status: str) -> None:
        self._record_refusal(sink, self._entry(rid, claims, now, outcome=Outcome.REJECTED,
                                               reason=reason), error, status)

    # -- completion -------------------------------------------------------------------------

    def _finish(self, adm: _Admitted, result: GenerationResult, outcome: Outcome,
                reason: str | None) -> None:
        """Complete the request's row (from the scheduler thread), then answer."""
        served = result.adapter_digest
        if outcome == Outcome.OK and served != adm.claims.adapter:
            outcome, reason = Outcome.IDENTITY_MISMATCH, "slot_digest"
        if outcome == Outcome.IDENTITY_MISMATCH:
            self.stats.identity_mismatches += 1
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
        self.writer.complete(
            done, lambda durable: self._answer(adm, result, outcome if durable
                                               else Outcome.FAILED, reason, served),
            if_unrecorded=unrecorded, output=result.text if outcome == Outcome.OK else None)

    def _answer(self, adm: _Admitted, result: GenerationResult, outcome: Outcome,
                reason: str | None, served: str | None) -> None:
        self._done()
        rid = adm.request_id
        if outcome == Outcome.OK:
            self.stats.served += 1
            text = "" if adm.stream else result.text
            a = Answer(ok=True, text=text, request_id=rid, adapter_digest=served or "",
                       outcome=outcome)
        elif outcome == Outcome.CANCELLED:
            self.stats.cancelled += 1
            a = Answer(ok=False, request_id=rid, error=CANCELLED_MESSAGE, status="cancelled",
                       outcome=outcome)
        elif outcome == Outcome.REVOKED or (outcome == Outcome.REJECTED
                                            and reason == "revoked"):
            # Revoked while queued (refused) or running (the kill switch): the one generic
            # refusal, as for a ticket whose adapter was revoked before it arrived.
            a = Answer(ok=False, request_id=rid, error=GENERIC_REFUSAL, status="invalid_arg",
                       outcome=outcome)
        elif outcome == Outcome.REJECTED:  # busy once admitted: the scheduler queue was full
            a = Answer(ok=False, request_id=rid, error=BUSY_MESSAGE, status="unavailable",
                       outcome=outcome)
        else:
            if outcome == Outcome.FAILED:
                self.stats.failed += 1
            a = Answer(ok=False, request_id=rid, error=INTERNAL_MESSAGE, status="internal",
                       outcome=outcome)
        adm.sink.answer(a)

    # -- helpers ----------------------------------------------------------------------------

    def _generation_request(self, req: IncomingRequest, claims: TicketClaims,
                            defaults: Mapping[str, object]) -> GenerationRequest:
        """The request's prompt and sampling parameters, checked, each omitted one taken from
        its release's inference ``defaults``; InvalidInput or InvalidParameter, each naming the
        caller's own input, when one is malformed."""
        if req.problem is not None:
            raise req.problem
        text = req.text
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput(TEXT_INPUT, "is not valid UTF-8", "prompt_encoding") from None
        if not isinstance(text, str):
            raise InvalidInput(TEXT_INPUT, "must be one string", "prompt")
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidInput(TEXT_INPUT, f"is longer than {MAX_PROMPT_CHARS} characters "
                                           f"({len(text)})", "prompt")
        params = check_sampling(*with_defaults(req.max_tokens, req.temperature, req.top_p,
                                               defaults), req.seed)
        return GenerationRequest(
            prompt=text,
            adapter=claims.adapter,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
        )

    def _record_load(self, digest: str, outcome: str, started: float, seconds: float,
                     nbytes: int | None, reason: str | None) -> None:
        self.ledger.record_load(AdapterLoad(self.host, digest, started, seconds, outcome,
                                            nbytes, reason=reason))
        if outcome == "unloaded" and reason == "revoked":
            self._report_revocation(digest)

    # -- revocation, pushed -----------------------------------------------------------------

    def _watch(self) -> None:
        """Apply governance changes without waiting for a request (see the module notes)."""
        failing = False
        while not self._closing.is_set():
            self._listener.wait(self._watch_interval_s, self._closing)
            if self._closing.is_set():
                return
            try:
                self._apply_governance(self.governance.current())
                failing = False
            except Exception:
                if not failing:  # once per outage, not ten times a second
                    log.warning("cannot read governance state; retrying", exc_info=True)
                failing = True

    def _apply_governance(self, state: GovernanceState) -> None:
        """Apply revocations that are new to this host: purge now; refuse queued requests;
        unload once drained, or, for the kill switch, end running requests first."""
        with self._governance_lock:
            fresh = (state.revoked - self._known_revoked) | (state.killed - self._known_killed)
            if not fresh:
                return
            self._known_revoked = self._known_revoked | state.revoked
            self._known_killed = self._known_killed | state.killed
        for digest in sorted(fresh):
            self.cache.revoke(digest)
            self.scheduler.revoke(digest, immediate=digest in state.killed)
            if digest not in self.engine.resident_adapters():
                # Never resident here, or unloaded at once: nothing left to drain on this host.
                self._report_revocation(digest)

    def _report_revocation(self, digest: str) -> None:
        """Record drained, purged, unloaded for ``digest`` on this host, once, off the hot path."""
        with self._inflight_lock:
            if digest in self._reported_revocations:
                return
            self._reported_revocations.add(digest)
        self._steps.submit(self._record_serving_steps, digest)

    def _record_serving_steps(self, digest: str) -> None:
        try:
            if self._step_log is None:
                self._step_log = self._open_step_log(self.settings)
            done = self._step_log.done(digest, self.host)
            for step in ("drained", "purged", "unloaded")[len(done):]:
                self._step_log.record(digest, self.host, step)
        except Exception:
            log.exception("could not record the revocation steps of this host")

    def _entry(
        self,
        rid: str,
        claims: TicketClaims | None,
        now: float,
        *,
        outcome: Outcome = Outcome.RUNNING,
        reason: str | None = None,
    ) -> LedgerEntry:
        return LedgerEntry(
            request_id=rid,
            ticket_id=claims.jti if claims else None,
            tenant=claims.tenant if claims else None,
            model=self.settings.model_name,
            host=self.host,
            base_digest=self.base_digest,
            adapter_digest=claims.adapter if claims else None,
            tokenizer_digest=self.tokenizer_digest,
            admitted_at=now,
            outcome=outcome,
            reason=reason,
            release_digest=claims.release if claims else None,
        )
