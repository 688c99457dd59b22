"""The serving pipeline behind the Triton models, importable and testable without Triton.

For each request Triton hands over: read the ticket from the request parameters, verify it, check
the revocation set, and only then reference the adapter the verified ticket names in the governed
cache (``backend.cache``: loaded from the content-addressed store by digest, bytes checked against
the digest). The ledger row is written (durable) before the sequence joins the continuous batch
(``backend.scheduler``); tokens stream to the caller's sink; when the sequence ends its ledger row
is completed, durably, before the final answer leaves.

Nothing a client sends other than a verified ticket can choose an adapter: no name, path or digest
in any parameter is read.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from backend.cache import AdapterCache, CacheBudgets, CacheRefused, Lease, TenantPolicy
from backend.engine import (
    DecodeBatch,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
)
from backend.ledger import AdapterLoad, Completion, Ledger, LedgerEntry
from backend.messages import BUSY_MESSAGE, FAILURE_MESSAGE, INTERNAL_MESSAGE, LIMITS_MESSAGE
from backend.prefix_cache import PrefixCache, PrefixKey
from backend.scheduler import QueueFull, Scheduler, SchedulerLimits
from control.config import Settings
from control.db import make_engine
from control.store import ArtifactStore
from control.tickets import (
    GENERIC_REFUSAL,
    TicketClaims,
    TicketRejected,
    TicketVerifier,
    load_public_keys,
)
from projections.routing import RoutingView

log = logging.getLogger("loraplane.backend")

TICKET_PARAM = "lora_ticket"
TICKET_HEADER = "x-lora-ticket"
MAX_PROMPT_CHARS = 8192
MAX_NEW_TOKENS = 512
DEFAULT_MAX_TOKENS = 16
PREFIX_CACHE_BYTES = 64 * 2**20
__all__ = ["BUSY_MESSAGE", "FAILURE_MESSAGE", "LIMITS_MESSAGE", "LoraService"]


@dataclass(frozen=True)
class IncomingRequest:
    """One request as Triton delivered it, before anything is trusted."""

    text: bytes | str | None
    parameters: str | dict[str, object] | None  # request.parameters(): a JSON string
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False


@dataclass(frozen=True)
class Answer:
    """What goes back to the client: text, or an error with a generic message."""

    ok: bool
    text: str = ""
    request_id: str = ""
    adapter_digest: str = ""  # "" for the bare base model
    error: str = ""
    status: str = ""  # "invalid_arg" | "unavailable" | "internal"
    outcome: str = ""  # ok | cancelled | rejected | failed


class AnswerSink(Protocol):
    """Where one request's answer goes (a Triton response sender, a test's collector)."""

    def cancelled(self) -> bool: ...
    def piece(self, text: str, request_id: str, adapter_digest: str) -> None: ...
    def answer(self, a: Answer) -> None: ...


@dataclass
class ServiceStats:
    refused: dict[str, int] = field(default_factory=dict)
    served: int = 0
    cancelled: int = 0
    load_failures: int = 0


class RequestRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def ticket_from_parameters(raw: str | dict[str, object] | None) -> str:
    """The ticket string from request parameters (or the forwarded header), else RequestRefused.

    Both present with different values is refused: a client must not be able to smuggle a second
    ticket past a proxy that inspected the first.
    """
    if raw is None or raw == "":
        raise RequestRefused("missing")
    if isinstance(raw, str):
        try:
            # Duplicate keys or deep nesting: refused, never guessed at or crashed on.
            params = json.loads(raw, object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError):
            raise RequestRefused("parameters") from None
    else:
        params = raw
    if not isinstance(params, dict):
        raise RequestRefused("parameters")
    # Header names are case-insensitive: X-Lora-Ticket is the same header as x-lora-ticket.
    names = (TICKET_PARAM, TICKET_HEADER)
    found = [v for k, v in params.items() if isinstance(k, str) and k.lower() in names]
    if not found:
        raise RequestRefused("missing")
    if any(not isinstance(v, str) for v in found):
        raise RequestRefused("encoding")
    if len(set(found)) > 1:
        raise RequestRefused("ambiguous")
    return str(found[0])


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out


@dataclass
class _Admitted:
    request_id: str
    claims: TicketClaims
    sink: AnswerSink
    stream: bool
    lease: Lease | None
    admitted_at: float


class _SequenceSink:
    """Bridges the scheduler's callbacks to the service's completion path."""

    def __init__(self, service: LoraService, adm: _Admitted) -> None:
        self.service, self.adm = service, adm

    def cancelled(self) -> bool:
        return self.adm.sink.cancelled()

    def token(self, piece: str) -> None:
        self.adm.sink.piece(piece, self.adm.request_id, self.adm.claims.adapter or "")

    def finish(self, result: GenerationResult, outcome: str) -> None:
        self.service._completions.put((self.adm, result, outcome))


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
        policy: TenantPolicy | None = None,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        governed: bool = True,
    ) -> None:
        self.settings = settings
        # governed=False exists only for the governed-vs-open benchmark: each distinct ticket is
        # verified once and remembered, revocation is not checked and nothing is written to the
        # ledger. Never on in a deployment (see backend.triton_glue).
        self.governed = governed
        self._verified: dict[str, TicketClaims] = {}
        self.host = host or socket.gethostname()
        db = make_engine(settings.db_url)
        self.routing = RoutingView(db)
        self.ledger = Ledger(db)
        self.store = ArtifactStore(settings.store_dir)
        base = next((b for b in self.routing.bases() if b.digest == base_digest), None)
        if base is None:
            raise RuntimeError("the base model digest to serve is not registered")
        self.base_digest = base_digest
        self.tokenizer_digest = base.tokenizer_digest
        if engine is None:
            engine = Engine(
                self.store.verify(base_digest),
                self.store.verify(self.tokenizer_digest),
                max_rank=settings.max_rank,
            )
        self.engine = engine
        self.limits = limits or SchedulerLimits.from_env()
        self.prefix_cache: PrefixCache[DecodeBatch] = PrefixCache(prefix_cache_bytes)
        self.cache = AdapterCache(engine, self.store.read_verified, budgets=budgets, policy=policy,
                                  on_event=self._record_load,
                                  on_purge=self.prefix_cache.purge_adapter)
        self.scheduler = Scheduler(engine, self.limits, self.prefix_cache)
        self._verifier_lock = threading.Lock()
        self.verifier = self._load_verifier()
        self.stats = ServiceStats()
        # Revoked before this process started: never resident here, nothing to drain or report.
        self._known_revoked: frozenset[str] = self.routing.revoked_digests()
        self._reported_revocations: set[str] = set()
        self._registry: Any = None
        self._steps = ThreadPoolExecutor(max_workers=1, thread_name_prefix="revocation-steps")
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._admission = ThreadPoolExecutor(max_workers=8, thread_name_prefix="admission")
        self._completions: queue.Queue[tuple[_Admitted, GenerationResult, str] | None] = (
            queue.Queue())
        self._completer = threading.Thread(target=self._complete_loop, name="completions",
                                           daemon=True)
        self._completer.start()
        failed = self.ledger.fail_running(self.host)
        if failed:
            log.warning("marked %d requests left running by a previous process as failed", failed)

    def _load_verifier(self) -> TicketVerifier:
        return TicketVerifier(
            load_public_keys(self.settings.keys_dir / "public"),
            model=self.settings.model_name,
            base=self.base_digest,
            tokenizer=self.tokenizer_digest,
        )

    def _verify(self, token: str) -> TicketClaims:
        if not self.governed:
            claims = self._verified.get(token)
            if claims is None:
                claims = self._verified[token] = self.verifier.verify(token)
            return claims
        try:
            return self.verifier.verify(token)
        except TicketRejected as e:
            if e.reason != "unknown_key":
                raise
            # A key may have been rotated in since start: reload public keys once.
            with self._verifier_lock:
                self.verifier = self._load_verifier()
            return self.verifier.verify(token)

    # -- entry points -----------------------------------------------------------------------

    def submit(self, req: IncomingRequest, sink: AnswerSink) -> None:
        """Take one request; its answer (and streamed pieces) go to ``sink`` later.

        Returns at once. Past the bound on requests in flight the sink gets a busy answer.
        """
        with self._inflight_lock:
            busy = self._inflight >= self.limits.max_queued + self.limits.max_running
            if not busy:
                self._inflight += 1
        if busy:
            self.stats.refused["busy"] = self.stats.refused.get("busy", 0) + 1
            sink.answer(Answer(ok=False, error=BUSY_MESSAGE, status="unavailable",
                               outcome="rejected"))
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

    def close(self) -> None:
        """Stop the scheduler and the worker threads."""
        self.scheduler.stop()
        self._admission.shutdown(wait=True)
        self._steps.shutdown(wait=True)
        self._completions.put(None)
        self._completer.join(timeout=30)

    # -- admission --------------------------------------------------------------------------

    def _done(self) -> None:
        with self._inflight_lock:
            self._inflight -= 1

    def _refuse(self, sink: AnswerSink, entry: LedgerEntry, error: str, status: str) -> None:
        self.ledger.admit([entry])  # durable before the answer leaves
        self._done()
        sink.answer(Answer(ok=False, request_id=entry.request_id, error=error, status=status,
                           outcome="rejected"))

    def _admit(self, req: IncomingRequest, sink: AnswerSink) -> None:
        try:
            self._admit_checked(req, sink)
        except Exception:
            log.exception("admission failed")
            self._done()
            sink.answer(Answer(ok=False, error=INTERNAL_MESSAGE, status="internal",
                               outcome="failed"))

    def _admit_checked(self, req: IncomingRequest, sink: AnswerSink) -> None:
        now = time.time()
        rid = str(uuid.uuid4())
        claims: TicketClaims | None = None
        # 1. the ticket, 2. the revocation set; only then may any adapter bytes be read
        try:
            claims = self._verify(ticket_from_parameters(req.parameters))
            if self.governed:
                revoked = self.routing.revoked_digests()
                self._purge(revoked)
                if claims.adapter is not None and claims.adapter in revoked:
                    raise RequestRefused("revoked")
            gen = self._generation_request(req, claims)
        except (TicketRejected, RequestRefused) as e:
            self.stats.refused[e.reason] = self.stats.refused.get(e.reason, 0) + 1
            self._refuse(sink, self._entry(rid, claims, now, outcome="rejected", reason=e.reason),
                         GENERIC_REFUSAL, "invalid_arg")
            return

        lease: Lease | None = None
        if claims.adapter is not None:
            try:
                lease = self.cache.acquire(claims.adapter, claims.tenant)
            except CacheRefused as e:
                # Not served, so "rejected": the incident view lists only what a digest served.
                self.stats.load_failures += 1
                reason = "revoked" if e.reason == "revoked" else f"adapter_{e.reason}"[:64]
                error, status = ((GENERIC_REFUSAL, "invalid_arg") if e.reason == "revoked"
                                 else (FAILURE_MESSAGE, "unavailable"))
                self._refuse(sink, self._entry(rid, claims, now, outcome="rejected",
                                               reason=reason), error, status)
                return
        try:
            seq = self.engine.open_sequence(gen)
        except (InvalidRequestError, EngineError) as e:
            if lease is not None:
                self.cache.release(lease)
            limits = isinstance(e, InvalidRequestError)
            self._refuse(sink, self._entry(rid, claims, now, outcome="rejected",
                                           reason="request_limits" if limits else "adapter_load"),
                         LIMITS_MESSAGE if limits else FAILURE_MESSAGE,
                         "invalid_arg" if limits else "unavailable")
            return
        adm = _Admitted(rid, claims, sink, req.stream, lease, now)
        if self.governed:
            try:
                self.ledger.admit([self._entry(rid, claims, now)])  # durable before any token
            except Exception:
                self.engine.close_sequence(seq)  # nothing may stay referenced by a lost row
                if lease is not None:
                    self.cache.release(lease)
                raise
        key = PrefixKey(self.base_digest, claims.adapter, self.tokenizer_digest,
                        tuple(seq.prompt_ids)) if gen.temperature == 0.0 else None
        try:
            self.scheduler.submit(seq, _SequenceSink(self, adm), stream=req.stream, key=key)
        except QueueFull:
            self.engine.close_sequence(seq)
            self._completions.put((adm, seq.result(""), "busy"))

    # -- completion -------------------------------------------------------------------------

    def _complete_loop(self) -> None:
        while True:
            item = self._completions.get()
            if item is None:
                return
            batch = [item]
            while True:  # everything that finished meanwhile shares one ledger transaction
                try:
                    more = self._completions.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._completions.put(None)
                    break
                batch.append(more)
            try:
                self._complete(batch)
            except Exception:
                log.exception("completing %d requests failed", len(batch))

    def _complete(self, batch: list[tuple[_Admitted, GenerationResult, str]]) -> None:
        rows = []
        for adm, r, outcome in batch:
            ledger_outcome = {"ok": "ok", "cancelled": "cancelled"}.get(outcome, "failed")
            reason = None if outcome == "ok" else outcome if outcome != "failed" else "engine"
            rows.append(Completion(adm.request_id, ledger_outcome, r.tokens_in, r.tokens_out,
                                   reason=reason))
        if self.governed:
            try:
                self._durably(lambda: self.ledger.complete(rows))
            except Exception:
                # The ledger cannot hold these rows: no answer may leave that it does not record.
                # The rows stay "running" and are marked failed when the host restarts.
                log.exception("ledger unavailable; failing %d requests", len(batch))
                batch = [(adm, r, "failed") for adm, r, _ in batch]
        for adm, r, outcome in batch:
            if adm.lease is not None:
                self.cache.release(adm.lease)
            self._done()
            digest = adm.claims.adapter or ""
            if outcome == "ok":
                self.stats.served += 1
                text = "" if adm.stream else r.text
                adm.sink.answer(Answer(ok=True, text=text, request_id=adm.request_id,
                                       adapter_digest=digest, outcome="ok"))
            elif outcome == "cancelled":
                self.stats.cancelled += 1
                adm.sink.answer(Answer(ok=False, request_id=adm.request_id, error="cancelled",
                                       status="cancelled", outcome="cancelled"))
            elif outcome == "busy":
                adm.sink.answer(Answer(ok=False, request_id=adm.request_id, error=BUSY_MESSAGE,
                                       status="unavailable", outcome="failed"))
            else:
                adm.sink.answer(Answer(ok=False, request_id=adm.request_id,
                                       error=INTERNAL_MESSAGE, status="internal",
                                       outcome="failed"))

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _durably(write: Callable[[], None], attempts: int = 3) -> None:
        """Run a ledger write, retrying a few times across a short database outage."""
        for i in range(attempts):
            try:
                write()
                return
            except Exception:
                if i == attempts - 1:
                    raise
                time.sleep(0.5 * (i + 1))

    def _generation_request(self, req: IncomingRequest, claims: TicketClaims) -> GenerationRequest:
        text = req.text
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestRefused("prompt_encoding") from None
        if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS:
            raise RequestRefused("prompt")
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else int(req.max_tokens)
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise RequestRefused("max_tokens")
        temperature = 0.0 if req.temperature is None else float(req.temperature)
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        if not (0.0 <= temperature <= 10.0 and 0.0 < top_p <= 1.0):
            raise RequestRefused("sampling")
        return GenerationRequest(
            prompt=text,
            adapter=claims.adapter,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=req.seed,
        )

    def _record_load(self, digest: str, outcome: str, started: float, seconds: float,
                     nbytes: int | None, reason: str | None) -> None:
        self.ledger.record_load(AdapterLoad(self.host, digest, started, seconds, outcome,
                                            nbytes, reason=reason))
        if outcome == "unloaded" and reason == "revoked":
            self._report_revocation(digest)

    def _purge(self, revoked: frozenset[str]) -> None:
        """Revoke newly revoked digests in the cache: purge now, unload once drained."""
        fresh = revoked - self._known_revoked
        if not fresh:
            return
        self._known_revoked = revoked
        for digest in fresh:
            self.cache.revoke(digest)
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
        from control.registry import Registry  # the event store, only when there is news

        try:
            if self._registry is None:
                self._registry = Registry(self.settings, follow=False)
            done = self._registry.adapter(digest).serving_steps.get(self.host, [])
            for step in ("drained", "purged", "unloaded")[len(done):]:
                self._registry.record_serving_step(digest, self.host, step,
                                                   actor=f"host:{self.host}")
        except Exception:
            log.exception("could not record the revocation steps of this host")

    def _entry(
        self,
        rid: str,
        claims: TicketClaims | None,
        now: float,
        *,
        outcome: str = "running",
        reason: str | None = None,
    ) -> LedgerEntry:
        # Claims of a ticket that failed verification are never recorded: they are unproven.
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
