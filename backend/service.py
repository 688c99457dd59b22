"""The serving pipeline behind the Triton model, importable and testable without Triton.

For each batch Triton hands over: read the ticket from the request parameters, verify it, check
the revocation set, make sure the adapter named by the verified ticket is resident (loaded from
the content-addressed store by digest, bytes checked against the digest), write the ledger rows,
run one mixed-adapter generation for every admitted request, close the ledger rows, answer.

Nothing a client sends other than a verified ticket can choose an adapter: no name, path or digest
in any parameter is read.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from backend.engine import Engine, GenerationRequest, InvalidRequestError
from backend.ledger import AdapterLoad, Completion, Ledger, LedgerEntry
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
FAILURE_MESSAGE = "request failed: the adapter could not be served"
LIMITS_MESSAGE = "request refused: prompt plus max_tokens exceed the model's limits"


@dataclass(frozen=True)
class IncomingRequest:
    """One request as Triton delivered it, before anything is trusted."""

    text: bytes | str | None
    parameters: str | dict[str, object] | None  # request.parameters(): a JSON string
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Answer:
    """What goes back to the client: text, or an error with a generic message."""

    ok: bool
    text: str = ""
    request_id: str = ""
    adapter_digest: str = ""  # "" for the bare base model
    error: str = ""
    status: str = ""  # "invalid_arg" | "unavailable" | "internal"


@dataclass
class _Admitted:
    index: int
    request_id: str
    claims: TicketClaims
    gen: GenerationRequest


@dataclass
class ServiceStats:
    refused: dict[str, int] = field(default_factory=dict)
    served: int = 0
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
            params = json.loads(raw)
        except ValueError:
            raise RequestRefused("parameters") from None
    else:
        params = raw
    if not isinstance(params, dict):
        raise RequestRefused("parameters")
    found = [params[k] for k in (TICKET_PARAM, TICKET_HEADER) if k in params]
    if not found:
        raise RequestRefused("missing")
    if any(not isinstance(v, str) for v in found):
        raise RequestRefused("encoding")
    if len(set(found)) > 1:
        raise RequestRefused("ambiguous")
    return str(found[0])


class LoraService:
    """Verifies, admits, generates and records; one per Triton model instance."""

    def __init__(
        self,
        settings: Settings,
        base_digest: str,
        *,
        host: str | None = None,
        engine: Engine | None = None,
    ) -> None:
        self.settings = settings
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
        self._verifier_lock = threading.Lock()
        self.verifier = self._load_verifier()
        self.stats = ServiceStats()
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
        try:
            return self.verifier.verify(token)
        except TicketRejected as e:
            if e.reason != "unknown_key":
                raise
            # A key may have been rotated in since start: reload public keys once.
            with self._verifier_lock:
                self.verifier = self._load_verifier()
            return self.verifier.verify(token)

    def handle(self, batch: Sequence[IncomingRequest]) -> list[Answer]:
        """Answer every request of a batch, in order."""
        now = time.time()
        answers: list[Answer | None] = [None] * len(batch)
        revoked = self.routing.revoked_digests()
        self._purge(revoked)
        refused: list[LedgerEntry] = []
        admitted: list[_Admitted] = []
        for i, req in enumerate(batch):
            rid = str(uuid.uuid4())
            claims: TicketClaims | None = None
            try:
                claims = self._verify(ticket_from_parameters(req.parameters))
                if claims.adapter is not None and claims.adapter in revoked:
                    raise RequestRefused("revoked")
                gen = self._generation_request(req, claims)
            except (TicketRejected, RequestRefused) as e:
                reason = e.reason
                self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
                refused.append(self._entry(rid, claims, now, outcome="rejected", reason=reason))
                answers[i] = Answer(ok=False, request_id=rid, error=GENERIC_REFUSAL,
                                    status="invalid_arg")
                continue
            admitted.append(_Admitted(i, rid, claims, gen))

        # Load what the verified tickets name; a failed load fails only its own requests.
        runnable: list[_Admitted] = []
        for a in admitted:
            if a.claims.adapter is None or self._ensure_resident(a.claims.adapter):
                try:
                    # One request over the engine's limits must not fail the whole batch.
                    self.engine.validate(a.gen)
                except InvalidRequestError:
                    refused.append(self._entry(a.request_id, a.claims, now, outcome="rejected",
                                               reason="request_limits"))
                    answers[a.index] = Answer(ok=False, request_id=a.request_id,
                                              error=LIMITS_MESSAGE, status="invalid_arg")
                    continue
                runnable.append(a)
            else:
                # Not served, so "rejected": the incident view lists only what a digest served.
                refused.append(self._entry(a.request_id, a.claims, now, outcome="rejected",
                                           reason="adapter_load"))
                answers[a.index] = Answer(ok=False, request_id=a.request_id,
                                          error=FAILURE_MESSAGE, status="unavailable")
        self.ledger.admit(refused + [self._entry(a.request_id, a.claims, now) for a in runnable])

        if runnable:
            try:
                results = self.engine.generate([a.gen for a in runnable])
            except Exception:
                log.exception("generation failed for a batch of %d", len(runnable))
                self.ledger.complete(
                    [Completion(a.request_id, "failed", reason="engine") for a in runnable]
                )
                for a in runnable:
                    answers[a.index] = Answer(ok=False, request_id=a.request_id,
                                              error="request failed", status="internal")
            else:
                # The rows are durable before any response leaves.
                self.ledger.complete(
                    [
                        Completion(a.request_id, "ok", r.tokens_in, r.tokens_out)
                        for a, r in zip(runnable, results, strict=True)
                    ]
                )
                self.stats.served += len(runnable)
                for a, r in zip(runnable, results, strict=True):
                    answers[a.index] = Answer(ok=True, text=r.text, request_id=a.request_id,
                                              adapter_digest=a.claims.adapter or "")
        return [a for a in answers if a is not None]

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

    def _ensure_resident(self, digest: str) -> bool:
        if digest in self.engine.resident_adapters():
            return True
        started = time.time()
        t0 = time.perf_counter()
        try:
            path = self.store.verify(digest)  # re-hashes the stored bytes
            nbytes = self.engine.load_adapter(digest, path)
        except Exception as e:
            # The store or the bytes are wrong: never serve it; the load record says why.
            log.warning("adapter load failed: %s", type(e).__name__)
            self.stats.load_failures += 1
            self.ledger.record_load(AdapterLoad(self.host, digest, started,
                                                time.perf_counter() - t0, "failed",
                                                reason=type(e).__name__[:64]))
            return False
        self.ledger.record_load(AdapterLoad(self.host, digest, started,
                                            time.perf_counter() - t0, "loaded", nbytes))
        return True

    def _purge(self, revoked: frozenset[str]) -> None:
        for digest in list(self.engine.resident_adapters()):
            if digest in revoked:
                self.engine.unload_adapter(digest)
                self.ledger.record_load(AdapterLoad(self.host, digest, time.time(), 0.0,
                                                    "unloaded", reason="revoked"))

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
        )
