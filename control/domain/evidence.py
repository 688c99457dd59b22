"""What lets an adapter move up its lifecycle: the evidence each move needs, as pure rules.

The lifecycle table (``control.domain.lifecycle``) says which moves exist; this module says what
a report written outside the gate must say, and on what basis an adapter may become stable.
The ``Adapter`` aggregate records the evidence (gate reports, external reports, break-glass
overrides); the registry applies these rules at the command boundary (issue 21, "no gate
bypass").

- **An external report** (written outside the gate, accepted only with ``external=True``) must
  say that it passed (``"passed": true``, a JSON boolean) and name who produced it
  (``"producer"``: the team, pipeline or tool; a report that names only the evaluation
  ``"suite"`` that wrote it is read as produced by that suite). Before this rule any non-empty
  JSON object counted, ``{"passed": false}`` included.
- **An external report never overrides the gate**: when the latest gate report on the
  combination a canary release would be built on failed, no external report lets the adapter
  into canary. Only a break-glass does (below).
- **Stable** needs one of these bases (:class:`StableBasis`): a completed rollout of the
  adapter's release on its alias (the rollout controller promotes it as it completes); the
  alias's first release, which its canary entry already made the alias's stable release
  (there was nothing a rollout could compare it with, and its gate had to beat the floor and
  the base alone); or a break-glass. Promoting a canary that shares its alias with another
  stable release straight to stable, with no rollout, is refused.
- **A break-glass** (``adapter break-glass DIGEST --to canary|stable --reason ...``) is an
  operator's explicit override, recorded as ``BreakGlassUsed`` with who, why and what it
  overrides, in the same transaction as the move it allows, and allowing that one move only.
  Into canary it overrides a failing gate report (the gate must have run on the combination: a
  break-glass overrides a verdict, it does not replace one); into stable, the missing rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from control.domain.errors import DomainError, IllegalTransition

MAX_PRODUCER_CHARS = 200
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class ExternalReport:
    """What the registry keeps of an external report's claims: that it passed, and who
    produced it (recorded on ``EvaluationRecorded``'s summary as ``producer``)."""

    producer: str


def external_report(report: Mapping[str, Any]) -> ExternalReport:
    """The claims of an external evaluation report; DomainError naming what is missing when it
    does not say it passed or does not name who produced it (see the module notes)."""
    if report.get("passed") is not True:
        raise DomainError("an external evaluation report must say it passed (\"passed\": true); "
                          f"this one says {report.get('passed')!r}")
    for key in ("producer", "suite"):
        value = report.get(key)
        if value is None:
            continue
        if (not isinstance(value, str) or not value.strip()
                or len(value) > MAX_PRODUCER_CHARS or any(ord(c) < 32 for c in value)):
            raise DomainError(f"an external evaluation report's {key!r} must name who produced "
                              f"it: printable text of at most {MAX_PRODUCER_CHARS} characters")
        return ExternalReport(value.strip())
    raise DomainError("an external evaluation report must name who produced it (\"producer\": "
                      "a team, pipeline or tool; or the \"suite\" that wrote it)")


class StableBasis(StrEnum):
    """Why an adapter may become stable (see the module notes)."""

    ROLLOUT = "rollout"  # a completed rollout of its release on its alias
    FIRST_RELEASE = "first_release"  # its canary entry made it the alias's first stable release
    BREAK_GLASS = "break_glass"  # an operator's recorded override


class BreakGlassTarget(StrEnum):
    """The moves a break-glass can allow."""

    CANARY = "canary"
    STABLE = "stable"


def stable_basis(*, release: str | None, alias_stable: str | None, alias_history: list[str],
                 rollout_completed: bool, break_glass: bool) -> StableBasis:
    """The basis on which an adapter whose canary release is ``release`` may become stable, on
    an alias whose stable release is ``alias_stable`` and whose earlier stable releases are
    ``alias_history``; IllegalTransition when there is none (see the module notes)."""
    if rollout_completed:
        return StableBasis.ROLLOUT
    if release is not None and alias_stable == release and not alias_history:
        return StableBasis.FIRST_RELEASE
    if break_glass:
        return StableBasis.BREAK_GLASS
    raise IllegalTransition(
        "stable needs a completed rollout of its canary release (loraplane alias rollout ALIAS "
        "DIGEST: the controller promotes it when the rollout completes), or an operator's "
        "break-glass (loraplane adapter break-glass DIGEST --to stable --reason ...)")


def check_reason(reason: str) -> str:
    """A break-glass reason: non-empty printable text; returned stripped."""
    if (not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON_CHARS
            or any(ord(c) < 32 for c in reason)):
        raise DomainError(f"a break-glass needs a reason: printable text of at most "
                          f"{MAX_REASON_CHARS} characters")
    return reason.strip()


__all__ = ["BreakGlassTarget", "ExternalReport", "StableBasis", "check_reason",
           "external_report", "stable_basis"]
