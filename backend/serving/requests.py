"""What goes in and out of the serving service (``backend.serving.service``): a request as
Triton delivered it, the answer a client gets, where answers go, and the service's counters; and
where a host records its revocation steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from backend.serving.messages import InvalidInput


class RevocationSteps(Protocol):
    """Where a host records its revocation steps for an adapter (drained, purged, unloaded, in
    that order, once each): the registry's event store (``control.app.serving_steps``). Injected
    at startup so that serving never imports the registry: dependencies point one way."""

    def done(self, digest: str, host: str) -> list[str]: ...

    def record(self, digest: str, host: str, step: str) -> None: ...


@dataclass(frozen=True)
class IncomingRequest:
    """One request as Triton delivered it, before anything is trusted."""

    text: bytes | str | None
    parameters: str | dict[str, object] | None  # request.parameters(): a JSON string
    max_tokens: object = None
    temperature: object = None
    top_p: object = None
    seed: object = None
    stream: bool = False
    # What the Triton glue found malformed in the request's inputs (a tensor holding a batch of
    # prompts, say); refused with its own message and a ledger row, after the ticket is checked.
    problem: InvalidInput | None = None


@dataclass(frozen=True)
class Answer:
    """What goes back to the client: text, or an error with a generic message."""

    ok: bool
    text: str = ""
    request_id: str = ""
    adapter_digest: str = ""  # read from the slot that computed the text; "" for the base
    error: str = ""
    status: str = ""  # "invalid_arg" | "unavailable" | "internal" | "cancelled"
    outcome: str = ""  # an Outcome


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
    failed: int = 0
    load_failures: int = 0
    identity_mismatches: int = 0

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
