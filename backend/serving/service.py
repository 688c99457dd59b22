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
from collections.abc import Callable, Mapping, Sequence

from backend.serving.admission import (
    RequestRefused,
    VerifiedTickets,
    cache_claim,
    check_governance,
    ticket_from_parameters,
)
from backend.serving.affinity_names import AffinityNames
from backend.serving.cache import AdapterCache, CacheBudgets, CacheClaim, CacheQuota
from backend.serving.engine import DecodeBatch, Engine, GenerationRequest, GenerationResult
from backend.serving.intake import Intake
from backend.serving.memory import AdapterBudget
from backend.serving.memory_report import entry_footprint, resident_memory
from backend.serving.messages import BUSY_MESSAGE, FAILURE_MESSAGE, LIMITS_MESSAGE, InvalidInput
from backend.serving.outcomes import Admitted, Collector, Outcomes
from backend.serving.prefix_cache import PrefixCache, TenantSalts
from backend.serving.recorder import LedgerWriter, write_durably
from backend.serving.replicas import ReplicaGuard
from backend.serving.requests import (
    Answer,
    AnswerSink,
    IncomingRequest,
    RevocationSteps,
    ServiceStats,
)
from backend.serving.revocation_watch import RevocationWatch
from backend.serving.sampling import check_sampling
from backend.serving.scheduler import Scheduler, SchedulerLimits
from backend.serving.warmup import WarmupReport, warm_up
from control.contracts import ticket_seals
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, LedgerEntry, Outcome
from control.contracts.replica_claims import ReplicaTable, idle_from_env, lease_from_env
from control.contracts.sampling import with_defaults
from control.contracts.store import ArtifactStore
from control.contracts.tickets import TicketClaims, TicketVerifier, load_public_keys
from control.contracts.wire import TEXT_INPUT
from projections.host_view import ChangeListener, GovernanceState, HostGovernance, tokenizer_of

log = logging.getLogger("loraplane.backend")

MAX_PROMPT_CHARS = 8192
PREFIX_CACHE_BYTES = 64 * 2**20
WATCH_INTERVAL_S = 0.1
__all__ = ["BUSY_MESSAGE", "FAILURE_MESSAGE", "LIMITS_MESSAGE", "Answer", "AnswerSink",
           "IncomingRequest", "LoraService", "RequestRefused", "RevocationSteps", "ServiceStats",
           "ticket_from_parameters"]


class LoraService:
    """Verifies, admits, schedules and records; one per Triton engine model instance.

    Its desks: ``intake`` (``backend.serving.intake``: the in-flight bound and the admission
    steps), ``outcomes`` (``backend.serving.outcomes``: ledger rows and answers) and
    ``revocations`` (``backend.serving.revocation_watch``). The steps a subclass or a test may
    replace stay methods of the service, and the desks call them here."""

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
        self.limits = limits or SchedulerLimits.from_env(kv_tokens=engine.plan.kv_tokens)
        # the footprint: its bytes by storage for the memory report, kept as entries come and go
        self.prefix_cache: PrefixCache[DecodeBatch] = PrefixCache(prefix_cache_bytes,
                                                                  footprint=entry_footprint)
        self.salts = TenantSalts()  # prefix-cache keys are per tenant, from verified tickets
        quota = quota or CacheQuota(resident_share=settings.resident_share)
        self.cache = AdapterCache(engine, self.store.read_verified, budgets=budgets, quota=quota,
                                  on_event=self._record_load,
                                  on_purge=self.prefix_cache.purge_adapter,
                                  violations=engine.violations)
        # claims on bounded adapters' replicas, counted with the other hosts' (issue 25)
        lease_s = lease_from_env()
        self.replicas = ReplicaGuard(lambda: ReplicaTable(db, self.host, lease_s=lease_s),
                                     lease_s, idle_from_env(lease_s))
        self.cache.replicas = self.replicas.start(self.cache)
        self.scheduler = Scheduler(engine, self.limits, self.prefix_cache)
        self.tickets = VerifiedTickets(self._load_verifier)
        self.affinities = AffinityNames()  # backend.triton.placement_metrics reads it
        self.stats = ServiceStats()
        self.outcomes = Outcomes(self)
        self.intake = Intake(self)
        start = self.governance.current()  # what was revoked before this process started
        failed = self.ledger.fail_running(self.host)
        if failed:
            log.warning("marked %d requests left running by a previous process as failed", failed)
        self.revocations = RevocationWatch(self, start, steps, ChangeListener.for_engine(db),
                                           watch_interval_s)
        self._watcher = threading.Thread(target=self._watch, name="governance-watch",
                                         daemon=True)
        self._watcher.start()
        self.warmup = WarmupReport()  # done at once when the warm-up is off
        if settings.warmup_adapters > 0:
            threading.Thread(target=self._warm_up, name="warm-up", daemon=True).start()
        else:
            self.warmup.done.set()

    def _warm_up(self) -> None:
        """Preload what this host held when it last ran (``backend.serving.warmup``)."""
        try:
            digests = self.ledger.last_resident(self.host, self.settings.warmup_adapters)
            warm_up(self, digests, self.governance.current(), pool=self.settings.host_pool,
                    region=self.settings.host_region, report=self.warmup)
        except Exception:  # a failed warm-up only leaves the first requests to load
            log.exception("warm-up failed")
            self.warmup.done.set()

    def _load_verifier(self) -> TicketVerifier:
        public = load_public_keys(self.settings.keys_dir / "public")
        return TicketVerifier(
            public,
            seal_keys=ticket_seals.load(self.governance.engine, public),
            model=self.settings.model_name,
            base=self.base_digest,
            tokenizer=self.tokenizer_digest,
            max_ttl_s=self.settings.ticket_max_ttl_s,
            pool=self.settings.host_pool,
            region=self.settings.host_region,
        )

    # -- entry points -----------------------------------------------------------------------

    def submit(self, req: IncomingRequest, sink: AnswerSink) -> None:
        """Take one request; its answer (and streamed pieces) go to ``sink`` later.

        Returns at once. Past the bound on requests in flight the sink gets a busy answer,
        after the refusal's ledger row is written.
        """
        self.intake.submit(req, sink)

    def handle(self, batch: Sequence[IncomingRequest]) -> list[Answer]:
        """Answer every request of a batch, in order (blocking; tests and simple callers)."""
        sinks = [Collector() for _ in batch]
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
        self.revocations.closing.set()
        self._watcher.join(timeout=5)
        self.scheduler.stop()
        self.intake.close()
        self.revocations.close_steps()
        self.writer.close()
        self.replicas.close()  # gives this host's claims up: another may take them at once
        self.revocations.listener.close()

    # -- the steps a subclass (the open bench peer) or a test may replace -------------------

    def _authorize(self, req: IncomingRequest
                   ) -> tuple[TicketClaims, Mapping[str, object], CacheClaim]:
        """The verified claims of the request's ticket, if governance allows them now, the
        inference defaults of the release the ticket names (its ``release`` claim: no lookup
        beyond the governance snapshot already read), and whom its adapter counts against in
        the cache (the release's owner, with the owner's and the requester's policy limits)."""
        claims = self.tickets.verify(ticket_from_parameters(req.parameters))
        state = self.governance.current()
        self._apply_governance(state)
        try:
            check_governance(claims, state)
        except RequestRefused as e:
            raise RequestRefused(e.reason, claims) from None
        if claims.adapter is not None:  # what the placement metrics name the adapter by
            self.affinities.record(claims.adapter, claims.affinity)
        bound = state.releases.get(claims.release) if claims.release is not None else None
        return (claims, bound.defaults if bound is not None else {},
                cache_claim(claims, bound, state))

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

    def _write_running(self, entry: LedgerEntry) -> None:
        """The admitted request's row, durable before any token is computed."""
        write_durably(lambda: self.ledger.admit([entry]))

    def _finish(self, adm: Admitted, result: GenerationResult, outcome: Outcome,
                reason: str | None) -> None:
        """Complete the request's row (from the scheduler thread), then answer."""
        self.outcomes.finish(adm, result, outcome, reason)

    def _watch(self) -> None:
        """Apply governance changes without waiting for a request (see the module notes)."""
        self.revocations.watch()

    def _apply_governance(self, state: GovernanceState) -> None:
        """Apply revocations that are new to this host (``RevocationWatch.apply``)."""
        self.revocations.apply(state)

    def _record_load(self, digest: str, outcome: str, started: float, seconds: float,
                     nbytes: int | None, reason: str | None) -> None:
        self.revocations.record_load(digest, outcome, started, seconds, nbytes, reason)
