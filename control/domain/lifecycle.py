"""The adapter lifecycle: which moves exist, what each move needs, and which states serve.

draft -> candidate -> canary -> stable -> deprecated; revoked from any state (its own command,
not a promotion) and final. ``TRANSITIONS`` is the whole rule set for which moves exist;
``lifecycle_guard`` says what each move needs. Only canary and stable adapters are servable.

States are a ``StrEnum``: a member is its plain string, so events store ``"canary"`` as they
always did, and a state read back from an event or a table compares equal to its member.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

from control.domain.errors import IllegalTransition
from control.domain.gate import Combination
from control.domain.policy import TenantPolicy


class AdapterState(StrEnum):
    """Where an adapter stands in its lifecycle."""

    DRAFT = "draft"
    CANDIDATE = "candidate"
    CANARY = "canary"
    STABLE = "stable"
    DEPRECATED = "deprecated"
    REVOKED = "revoked"


DRAFT = AdapterState.DRAFT
CANDIDATE = AdapterState.CANDIDATE
CANARY = AdapterState.CANARY
STABLE = AdapterState.STABLE
DEPRECATED = AdapterState.DEPRECATED
REVOKED = AdapterState.REVOKED

# The main line, in order; revoked is off it.
LIFECYCLE = (DRAFT, CANDIDATE, CANARY, STABLE, DEPRECATED)
# Keyed by str so that a state read back as a plain string looks up the same entry.
TRANSITIONS: dict[str, frozenset[AdapterState]] = {
    DRAFT: frozenset({CANDIDATE}),
    CANDIDATE: frozenset({CANARY, DEPRECATED}),
    CANARY: frozenset({STABLE, DEPRECATED}),  # a canary can be abandoned
    STABLE: frozenset({DEPRECATED}),
    DEPRECATED: frozenset(),
    REVOKED: frozenset(),
}
# Tickets resolve only to releases whose adapter is in one of these states.
SERVABLE_STATES = frozenset({CANARY, STABLE})
# The serving side's steps after a revocation, in order, per host.
SERVING_STEPS = ("drained", "purged", "unloaded")


class Promotable(Protocol):
    """What the lifecycle guards read of an adapter (``Adapter`` has all of it)."""

    @property
    def state(self) -> str: ...
    @property
    def validated(self) -> bool: ...
    @property
    def signature(self) -> dict[str, Any] | None: ...
    @property
    def evaluation_report(self) -> str | None: ...
    @property
    def had_canary(self) -> bool: ...
    def canary_evidence(self, combination: Combination | None) -> str | None: ...


def check_transition(current: str, to: str) -> None:
    """Raise IllegalTransition unless the lifecycle table allows ``current`` -> ``to``."""
    if to == REVOKED:
        raise IllegalTransition("revocation is its own command (adapter revoke), not a promotion")
    if to not in TRANSITIONS:
        raise IllegalTransition(
            f"unknown state {to!r}; the lifecycle is {' -> '.join(LIFECYCLE)}")
    allowed = TRANSITIONS.get(current, frozenset())
    if to not in allowed:
        # str(): quote the plain state name, never the enum's repr.
        here, there = str(current), str(to)
        nexts = ", ".join(sorted(allowed)) if allowed else "nothing"
        raise IllegalTransition(
            f"cannot move an adapter from {here!r} to {there!r} (from {here!r}: {nexts})")


def next_state(current: str) -> AdapterState:
    """The next state along the main line draft -> candidate -> canary -> stable -> deprecated."""
    if current in LIFECYCLE[:-1]:
        return LIFECYCLE[LIFECYCLE.index(current) + 1]
    raise IllegalTransition(f"an adapter in state {str(current)!r} has no next state")


def is_servable(adapter_state: str | None) -> bool:
    """A release is servable when it is the base alone (``None``) or a canary/stable adapter."""
    return adapter_state is None or adapter_state in SERVABLE_STATES


def lifecycle_guard(adapter: Promotable, to: str, policy: TenantPolicy,
                    combination: Combination | None = None) -> None:
    """Raise IllegalTransition unless ``adapter`` may move to ``to`` now.

    - candidate: validation passed (every registered adapter passed it; a refused one was never
      registered) and, where the tenant's policy demands one, a verified signature;
    - canary: a passing gate report for exactly ``combination`` (the base, tokenizer and chat
      template the canary release is built on), or a report written outside the gate, recorded
      as external with an explicit flag (``Adapter.canary_evidence``);
    - stable: the adapter went through a canary phase (the table only allows canary -> stable).
    """
    check_transition(adapter.state, to)
    if to == CANDIDATE:
        if not adapter.validated:
            raise IllegalTransition("candidate needs a passed validation")
        if policy.require_signature and adapter.signature is None:
            raise IllegalTransition(
                "candidate needs a verified signature: the tenant's policy requires signed "
                "adapters (register it again with --signature)")
    elif to == CANARY:
        if adapter.canary_evidence(combination) is None:
            raise IllegalTransition(
                "canary needs an evaluation report: a passing gate report for this adapter on "
                "this base, tokenizer and chat template (adapter gate DIGEST), or a report "
                "written outside the gate, recorded as external (adapter evaluate DIGEST "
                "REPORT.json --external)")
    elif to == STABLE and not adapter.had_canary:
        raise IllegalTransition("stable needs a canary phase first")
