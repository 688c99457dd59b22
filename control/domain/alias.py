"""The ``Alias`` aggregate: a global route name and the releases it points at.

An alias is owned by a tenant (or by the operator, for base-only routes). It points at a stable
release plus, optionally, a canary release at a percentage of sessions
(``control.domain.canary``); it keeps the history of its previous stable releases for rollback
and the tenants granted to resolve it (a grant can be removed). Only releases the caller found
servable may be pointed at.

It also carries its fallback policy (``control.domain.fallback``: what it serves after the
adapter of its stable release is revoked; ``none`` unless set) and records the outcome of each
revocation that touched it (``AliasFellBack``). Sessions pinned to one of its releases
(``control.domain.session``) can be moved all at once, after a rollback: ``repin_sessions``
re-pins every session holding a release to another one, ``drain_sessions`` records that they
keep it until they end or expire. Either is one event on the alias.
"""

from __future__ import annotations

from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.canary import MAX_CANARY_PERCENT
from control.domain.errors import AlreadyExists, DomainError, IllegalTransition, NotFound
from control.domain.fallback import (
    DEFAULT_FALLBACK,
    FallbackOutcome,
    FallbackPolicy,
    check_policy,
)
from control.domain.ids import alias_id
from control.domain.names import check_actor, check_name
from control.domain.release import Release


class Alias(Aggregate):
    """A route name. ``owner`` is a tenant, or ``None`` for an operator's base-only alias.

    ``stable`` and ``canary`` are release manifest digests; ``history`` the stable releases it
    pointed at before, most recent last (rollback pops it).
    """

    class AliasCreated(Aggregate.Created):
        name: str
        owner: str | None
        release: str | None
        actor: str

    class AliasPointed(Aggregate.Event):
        alias: str
        release: str
        previous: str | None
        actor: str

    class AliasCanarySet(Aggregate.Event):
        alias: str
        release: str
        percent: int
        actor: str

    class AliasCanaryCleared(Aggregate.Event):
        alias: str
        actor: str

    class AliasRolledBack(Aggregate.Event):
        alias: str
        from_release: str | None
        to_release: str
        actor: str

    class AliasGranted(Aggregate.Event):
        alias: str
        tenant: str
        actor: str

    class AliasGrantRemoved(Aggregate.Event):
        alias: str
        tenant: str
        actor: str

    class AliasFallbackSet(Aggregate.Event):
        alias: str
        policy: str  # a FallbackPolicy
        actor: str

    class AliasFellBack(Aggregate.Event):
        """A revocation reached this alias: ``revoked_release`` used the revoked adapter;
        ``to_release`` is the stable release from now on (None: nothing is served)."""

        alias: str
        adapter_digest: str
        revoked_release: str
        policy: str
        to_release: str | None
        canary_cleared: bool
        actor: str

    class AliasSessionsRepinned(Aggregate.Event):
        """Every session pinned to ``from_release`` on this alias now holds ``to_release``."""

        alias: str
        from_release: str
        to_release: str
        reason: str
        actor: str

    class AliasSessionsDrained(Aggregate.Event):
        """Sessions pinned to ``release`` keep it until they end or expire (recorded so the
        choice is on the record; nothing moves)."""

        alias: str
        release: str
        reason: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return alias_id(name)

    @event(AliasCreated)
    def __init__(self, name: str, owner: str | None, release: str | None, actor: str) -> None:
        self.name = name
        self.owner = owner
        self.stable = release
        self.canary: str | None = None
        self.canary_percent = 0
        self.history: list[str] = []
        self.grants: list[str] = []
        self.fallback = DEFAULT_FALLBACK
        self.last_fallback: dict[str, object] | None = None  # the latest AliasFellBack's outcome

    @classmethod
    def create(cls, name: str, owner: str | None, release: str | None, actor: str) -> Alias:
        return cls(name=check_name("alias", name), owner=owner, release=release,
                   actor=check_actor(actor))

    def _check_release(self, release: Release, servable: bool, what: str) -> None:
        # "Not owned" is phrased without naming the release's tenant.
        if release.tenant is not None and release.tenant != self.owner:
            raise DomainError("release does not belong to the alias owner")
        if not servable:
            raise IllegalTransition(
                f"cannot point an alias's {what} at a release whose adapter is not servable "
                "(only canary and stable adapters are; revoked and deprecated never)")

    def point(self, release: Release, servable: bool, actor: str) -> None:
        """Make ``release`` the stable release (the previous one goes to the history)."""
        self._check_release(release, servable, "stable release")
        if release.digest == self.stable:
            raise IllegalTransition("the alias already points at that release")
        self._pointed(alias=self.name, release=release.digest, previous=self.stable,
                      actor=check_actor(actor))

    @event(AliasPointed)
    def _pointed(self, alias: str, release: str, previous: str | None, actor: str) -> None:
        if previous is not None:
            self.history.append(previous)
        self.stable = release
        if self.canary == release:  # the canary graduated
            self.canary = None
            self.canary_percent = 0

    def set_canary(self, release: Release, percent: int, servable: bool, actor: str) -> None:
        """Send ``percent`` per cent of sessions (by tenant+session hash) to ``release``."""
        self._check_release(release, servable, "canary")
        if not isinstance(percent, int) or isinstance(percent, bool) or not (
                0 < percent <= MAX_CANARY_PERCENT):
            raise DomainError("canary percent must be an integer from 1 to 100")
        if release.digest == self.stable:
            raise IllegalTransition("that release is already the alias's stable release")
        self._canary_set(alias=self.name, release=release.digest, percent=percent,
                         actor=check_actor(actor))

    @event(AliasCanarySet)
    def _canary_set(self, alias: str, release: str, percent: int, actor: str) -> None:
        self.canary = release
        self.canary_percent = percent

    def clear_canary(self, actor: str) -> None:
        """Stop the canary split: every session resolves to the stable release."""
        if self.canary is None:
            raise IllegalTransition("the alias has no canary")
        self._canary_cleared(alias=self.name, actor=check_actor(actor))

    @event(AliasCanaryCleared)
    def _canary_cleared(self, alias: str, actor: str) -> None:
        self.canary = None
        self.canary_percent = 0

    def rollback(self, previous_servable: bool, actor: str) -> None:
        """Point back at the previous stable release (one step of the history)."""
        if not self.history:
            raise IllegalTransition("the alias has no previous release to roll back to")
        if not previous_servable:
            raise IllegalTransition(
                "the previous release is no longer servable (revoked or deprecated); "
                "point the alias at a release explicitly")
        self._rolled_back(alias=self.name, from_release=self.stable,
                          to_release=self.history[-1], actor=check_actor(actor))

    @event(AliasRolledBack)
    def _rolled_back(self, alias: str, from_release: str | None, to_release: str,
                     actor: str) -> None:
        self.history.pop()
        self.stable = to_release

    def grant(self, tenant: str, actor: str) -> None:
        """Let ``tenant`` resolve this alias. The owner is not granted implicitly."""
        if tenant in self.grants:
            raise AlreadyExists("tenant is already granted this alias")
        self._granted(alias=self.name, tenant=tenant, actor=check_actor(actor))

    @event(AliasGranted)
    def _granted(self, alias: str, tenant: str, actor: str) -> None:
        self.grants.append(tenant)

    def remove_grant(self, tenant: str, actor: str) -> None:
        """Stop ``tenant`` resolving this alias (tickets already issued run out on their own)."""
        if tenant not in self.grants:
            raise NotFound("that tenant holds no grant of this alias")
        self._grant_removed(alias=self.name, tenant=tenant, actor=check_actor(actor))

    @event(AliasGrantRemoved)
    def _grant_removed(self, alias: str, tenant: str, actor: str) -> None:
        self.grants.remove(tenant)

    def may_resolve(self, tenant: str) -> bool:
        return tenant in self.grants

    def set_fallback(self, policy: str, actor: str) -> None:
        """What this alias serves after its stable release's adapter is revoked."""
        chosen = check_policy(policy)
        if chosen == self.fallback:
            raise IllegalTransition(f"the alias's fallback policy is {chosen.value} already")
        self._fallback_set(alias=self.name, policy=chosen.value, actor=check_actor(actor))

    @event(AliasFallbackSet)
    def _fallback_set(self, alias: str, policy: str, actor: str) -> None:
        self.fallback = FallbackPolicy(policy)

    def fall_back(self, adapter_digest: str, outcome: FallbackOutcome, actor: str) -> None:
        """Record what this alias serves now that ``adapter_digest`` is revoked (``outcome``:
        ``control.domain.fallback.fall_back`` of this alias under its policy)."""
        if outcome.revoked_release not in (self.stable, self.canary):
            raise IllegalTransition("that release is neither the alias's stable nor its canary")
        self._fell_back(alias=self.name, adapter_digest=adapter_digest,
                        revoked_release=outcome.revoked_release, policy=self.fallback.value,
                        to_release=outcome.to_release, canary_cleared=outcome.canary_cleared,
                        actor=check_actor(actor))

    @event(AliasFellBack)
    def _fell_back(self, alias: str, adapter_digest: str, revoked_release: str, policy: str,
                   to_release: str | None, canary_cleared: bool, actor: str) -> None:
        if revoked_release == self.stable:
            if (policy == FallbackPolicy.STABLE and to_release is not None
                    and to_release in self.history):
                # Entries after the one chosen were not servable: a rollback skips them too.
                cut = len(self.history) - 1 - self.history[::-1].index(to_release)
                del self.history[cut:]
            self.stable = to_release
        if canary_cleared:
            self.canary = None
            self.canary_percent = 0
        self.last_fallback = {"adapter_digest": adapter_digest,
                              "revoked_release": revoked_release, "policy": policy,
                              "to_release": to_release, "canary_cleared": canary_cleared}

    def repin_sessions(self, from_release: str, to: Release, servable: bool, reason: str,
                       actor: str) -> None:
        """Move every session pinned to ``from_release`` on this alias to ``to`` (after a
        rollback: the rolled-back release's sessions go to the stable one)."""
        self._check_release(to, servable, "sessions")
        if to.digest == from_release:
            raise IllegalTransition("sessions would be re-pinned to the release they hold")
        if not reason.strip():
            raise DomainError("re-pinning sessions needs a reason")
        self._sessions_repinned(alias=self.name, from_release=from_release,
                                to_release=to.digest, reason=reason, actor=check_actor(actor))

    @event(AliasSessionsRepinned)
    def _sessions_repinned(self, alias: str, from_release: str, to_release: str, reason: str,
                           actor: str) -> None:
        pass  # the pins live in the routing projection; the alias only records the move

    def drain_sessions(self, release: str, reason: str, actor: str) -> None:
        """Record that sessions pinned to ``release`` keep it until they end or expire."""
        if not reason.strip():
            raise DomainError("draining sessions needs a reason")
        self._sessions_drained(alias=self.name, release=release, reason=reason,
                               actor=check_actor(actor))

    @event(AliasSessionsDrained)
    def _sessions_drained(self, alias: str, release: str, reason: str, actor: str) -> None:
        pass  # nothing moves: the event is the record of the choice
