"""The fixed messages a client can receive, and the status each one carries.

Kept free of heavy imports: the forwarding model (``backend.triton.front``) maps a message back to
its
status, because Triton 2.51 reports every error of a BLS response as INTERNAL.
"""

from __future__ import annotations

from control.contracts.tickets import GENERIC_REFUSAL

FAILURE_MESSAGE = "request failed: the adapter could not be served"
LIMITS_MESSAGE = "request refused: prompt plus max_tokens exceed the model's limits"
# A request that alone needs more KV positions (prompt + max_tokens) than the host's budget:
# it could never run, so it is refused rather than queued (backend.serving.scheduler).
KV_BUDGET_MESSAGE = ("request refused: the prompt plus max_tokens need more KV cache than this "
                     "host holds; send a shorter prompt or fewer max_tokens")
KV_BUDGET_REASON = "kv_budget"
BUSY_MESSAGE = "server busy: too many requests queued, retry later"
INTERNAL_MESSAGE = "request failed"
# A sampling parameter out of range: the message names the parameter and its range
# (control.contracts.sampling.InvalidParameter), about the caller's own input only.
PARAMETER_PREFIX = "invalid parameter "
# An input the request carries in the wrong form (a batch of prompts in one request, a prompt
# that is not UTF-8 or is too long): the message names the input and what is wrong with the
# caller's own value, never anything else (:class:`InvalidInput`).
INPUT_PREFIX = "invalid input "

# message -> status ("invalid_arg" | "unavailable" | "internal")
STATUS_OF: dict[str, str] = {
    GENERIC_REFUSAL: "invalid_arg",
    LIMITS_MESSAGE: "invalid_arg",
    FAILURE_MESSAGE: "unavailable",
    BUSY_MESSAGE: "unavailable",
    INTERNAL_MESSAGE: "internal",
}


class InvalidInput(ValueError):
    """One of the request's inputs is malformed; ``reason`` is the ledger's, the message the
    client's (it names the input and the rule, nothing of anyone else)."""

    def __init__(self, name: str, why: str, reason: str) -> None:
        super().__init__(f"{INPUT_PREFIX}{name}: {why}")
        self.name = name
        self.reason = reason


CANCELLED_MESSAGE = "cancelled"  # the answer of a request whose client went away


def from_engine(message: str) -> bool:
    """Whether ``message`` is one the engine model answers with (it wrote that request's ledger
    row); anything else came from Triton's plumbing (a stub that died, say)."""
    return (message in STATUS_OF or message == CANCELLED_MESSAGE
            or message.startswith((PARAMETER_PREFIX, INPUT_PREFIX)))


def status_of(message: str) -> str:
    """The status of one of the fixed messages; anything else is internal."""
    if message.startswith((PARAMETER_PREFIX, INPUT_PREFIX)):
        return "invalid_arg"
    return STATUS_OF.get(message, "internal")
