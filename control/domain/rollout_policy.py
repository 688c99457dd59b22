"""The rules a rollout is judged by: its policy (recorded in ``RolloutStarted``) and its steps.

The policy states the error budget of the sequential analysis (``control.domain.rollout_judge``):

- ``alpha`` (default 0.02): the chance that a canary no worse than stable is rolled back at all,
  over the whole rollout. It is split evenly over the judged steps and the four metrics that can
  roll back on statistics (errors, feedback, refusals, latency): :meth:`RolloutPolicy.test_alpha`.
- ``power`` (default 0.95): one minus the chance that a step advances although the canary is
  worse than stable by ``margin_pp`` or more (per gating metric, per step).
- ``margin_pp`` (default 3 points): the non-inferiority margin. A step advances only once the
  canary's success is shown, at level ``1 - power``, to be no more than this below stable's.
- ``min_requests`` / ``min_ratings``: the fewest served requests (ratings) per arm in a step
  before the error (feedback) metric may let it advance; feedback gates a step only once both
  arms hold ``min_ratings`` ratings, and can roll it back at any count.
- ``step_deadline_s`` (default one hour): a step that has neither advanced nor rolled back by
  then pauses as inconclusive and raises an alert (Argo Rollouts' ``inconclusiveLimit``,
  Flagger's ``progressDeadlineSeconds``).
- ``max_p95_ratio`` (default 1.5): the canary's p95 latency may not be significantly above this
  multiple of stable's.
- ``max_identity_mismatches`` / ``max_load_failures`` (default 0): hard failures tolerated before
  the rollout rolls back at once, as soon as the controller sees them.
- ``max_unjudged_s`` (default 120 s): how late a window's judgement may be before the rollout
  records an alert that nothing judged its canary (no controller running).

Policies recorded before these rules (``max_success_drop_pp``, ``max_load_failure_rate``,
``load_failure_windows``, ``max_refusal_rate``) are read with those fields dropped: such a
rollout, still running, is judged by the rules of today (:meth:`RolloutPolicy.from_json`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

from control.domain.errors import DomainError

FULL = 100  # per cent: the last step, where the alias points at the target

# Metrics whose statistics can roll a canary back; each gets an equal share of ``alpha``.
STATISTICAL_METRICS = ("errors", "feedback", "refusals", "latency")

# Fields of policies recorded before the sequential analysis; dropped when read back.
_LEGACY_FIELDS = frozenset({"max_success_drop_pp", "max_load_failure_rate",
                            "load_failure_windows", "max_refusal_rate"})


class Sessions(StrEnum):
    """What happens, on a rollback, to sessions already bound to the target."""

    DRAIN = "drain"  # they keep the target until they end or their pin's TTL passes
    REPIN = "repin"  # they are pinned to the stable release at once
    END = "end"  # they end at once: their next request resolves afresh


def check_steps(steps: list[int]) -> list[int]:
    """Steps are per cent of sessions, strictly increasing, from 1, ending at 100."""
    if (not isinstance(steps, list) or not steps
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)):
        raise DomainError("steps must be a list of whole per cents, e.g. 1,10,50,100")
    if any(s < 1 or s > FULL for s in steps):
        raise DomainError("every step must be between 1 and 100 per cent")
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise DomainError("steps must increase strictly, e.g. 1,10,50,100")
    if steps[-1] != FULL:
        raise DomainError("the last step must be 100 (where the alias points at the target)")
    return list(steps)


@dataclass(frozen=True)
class RolloutPolicy:
    """The rules a rollout is judged by (see the module notes); recorded whole in its started
    event. ``settle_s``: how long after a window's end it is judged, so that requests admitted
    near the end have finished and their tenants had a moment to rate them.
    ``probe_requests``: the health probe's requests per host before each step;
    ``probe_attempts``: probes that may fail (unreachable or unhealthy host) before the rollout
    rolls back (a probe that shows a load failure or an identity mismatch rolls back at once).
    ``sessions``: what becomes of the target's sessions on a rollback (a rollback for a hard
    failure re-pins or ends them whatever this says)."""

    alpha: float = 0.02
    power: float = 0.95
    margin_pp: float = 3.0
    min_requests: int = 100
    min_ratings: int = 100
    step_deadline_s: float = 3600.0
    max_p95_ratio: float = 1.5
    max_identity_mismatches: int = 0
    max_load_failures: int = 0
    max_unjudged_s: float = 120.0
    settle_s: float = 2.0
    probe_requests: int = 2
    probe_attempts: int = 3
    sessions: Sessions = Sessions.REPIN

    def __post_init__(self) -> None:
        def number(name: str, low: float, high: float = math.inf, *,
                   open_low: bool = False, open_high: bool = False) -> None:
            v = getattr(self, name)
            bad = isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v)
            if not bad:
                bad = (v <= low if open_low else v < low) or (v >= high if open_high
                                                             else v > high)
            if bad:
                raise DomainError(f"policy {name} must be a number "
                                  + ("above" if open_low else "from") + f" {low:g}"
                                  + ("" if high == math.inf else
                                     (" and below" if open_high else " to") + f" {high:g}")
                                  + f", found {v!r}")

        def whole(name: str, low: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise DomainError(f"policy {name} must be a whole number of at least {low}, "
                                  f"found {v!r}")

        number("alpha", 0, 0.5, open_low=True)
        number("power", 0.5, 1, open_high=True)
        number("margin_pp", 0, 50, open_low=True)
        number("step_deadline_s", 1, 30 * 86_400)
        number("max_p95_ratio", 1, 1000, open_low=True)
        number("max_unjudged_s", 0, 86_400)
        number("settle_s", 0, 3600)
        for name in ("min_requests", "min_ratings", "probe_requests", "probe_attempts"):
            whole(name, 1)
        whole("max_identity_mismatches", 0)
        whole("max_load_failures", 0)
        try:
            object.__setattr__(self, "sessions", Sessions(self.sessions))
        except ValueError:
            raise DomainError("policy sessions must be drain, repin or end") from None

    @property
    def margin(self) -> float:
        """The non-inferiority margin as a rate (3 points: 0.03)."""
        return self.margin_pp / 100.0

    @property
    def beta(self) -> float:
        """The chance a step advances although the canary is ``margin`` worse or more."""
        return 1.0 - self.power

    def test_alpha(self, judged_steps: int) -> float:
        """The level of each statistical rollback test: ``alpha`` split evenly over the
        judged steps (every step but the last, 100 %) and :data:`STATISTICAL_METRICS`, so
        that over the whole rollout a canary equal to stable rolls back with probability at
        most ``alpha`` (a union bound: the real rate is lower)."""
        return self.alpha / (max(1, judged_steps) * len(STATISTICAL_METRICS))

    def to_json(self) -> dict[str, Any]:
        """The policy as its started event records it."""
        return {**asdict(self), "sessions": self.sessions.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutPolicy:
        """The policy a started event recorded (fields it does not know are refused; those of
        policies recorded before the sequential analysis are dropped, see the module notes)."""
        known = {f.name for f in fields(cls)}
        kept = {k: v for k, v in data.items() if k not in _LEGACY_FIELDS}
        if "max_p95_ratio" in kept and kept["max_p95_ratio"] is None:
            del kept["max_p95_ratio"]  # "off" is no longer a choice: the default applies
        unknown = set(kept) - known
        if unknown:
            raise DomainError(f"unknown rollout policy fields: {', '.join(sorted(unknown))}")
        return cls(**kept)
