"""What an alias serves after the adapter of one of its releases is revoked: its fallback policy.

Each alias carries a policy, set by an event (``Alias.set_fallback``); an alias that never set
one has ``none``. The revocation applies it to every alias whose stable or canary release uses
the revoked adapter, in the revocation's own transaction, and records the outcome as one
``Alias.AliasFellBack`` event per alias:

- ``stable``: the most recent release in the alias's history that is still servable becomes its
  stable release (history entries after it, none of them servable, are dropped); with none left,
  nothing is served.
- ``base``: a base-only release of the revoked release's base model (the base alone, no
  adapter) becomes its stable release.
- ``none``: nothing is served; tickets are refused until an operator points the alias again.

A revoked canary is simply cleared. Whenever the stable slot ends up empty the canary is cleared
too: a canary alone would otherwise take every session, a promotion nobody decided.

A rollout in progress on the alias is not rolled back for its stable release's revocation: it
pauses with an alert, and resuming it compares the canary with whatever stable release the
alias has then, giving the canary its share back (``control.app.rollouts``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from control.domain.errors import DomainError


class FallbackPolicy(StrEnum):
    """What an alias falls back to when its stable release's adapter is revoked."""

    STABLE = "stable"
    BASE = "base"
    NONE = "none"


DEFAULT_FALLBACK = FallbackPolicy.NONE


def check_policy(policy: str) -> FallbackPolicy:
    """``policy`` as a :class:`FallbackPolicy`, else DomainError naming the choices."""
    try:
        return FallbackPolicy(policy)
    except ValueError:
        raise DomainError("a fallback policy is one of stable, base, none") from None


@dataclass(frozen=True)
class FallbackOutcome:
    """What one alias serves after a revocation. ``to_release`` None: nothing."""

    revoked_release: str  # the alias's release that used the revoked adapter (stable first)
    to_release: str | None  # the stable release from now on
    canary_cleared: bool


def fall_back(policy: FallbackPolicy, *, stable: str | None, canary: str | None,
              history: Sequence[str], revoked: Callable[[str], bool],
              servable: Callable[[str], bool],
              base_release: Callable[[], str]) -> FallbackOutcome | None:
    """The outcome of revoking an adapter for one alias, or None when neither its stable nor its
    canary release uses it.

    ``revoked(release)``: the release uses the revoked adapter; ``servable(release)``: it may be
    served now (the revocation already counted); ``base_release()``: the digest of the
    base-only release of the revoked release's base (asked only under ``base``).
    """
    stable_hit = stable is not None and revoked(stable)
    canary_hit = canary is not None and revoked(canary)
    if not stable_hit:
        if not canary_hit:
            return None
        assert canary is not None
        return FallbackOutcome(revoked_release=canary, to_release=stable, canary_cleared=True)
    assert stable is not None
    to: str | None = None
    if policy == FallbackPolicy.STABLE:
        to = next((r for r in reversed(history) if not revoked(r) and servable(r)), None)
    elif policy == FallbackPolicy.BASE:
        to = base_release()
    cleared = canary is not None and (canary_hit or to is None or canary == to)
    return FallbackOutcome(revoked_release=stable, to_release=to, canary_cleared=cleared)
