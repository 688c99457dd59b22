"""The ``Alias`` aggregate: a global route name and the releases it points at.

An alias is owned by a tenant (or by the operator, for base-only routes). It points at a stable
release plus, optionally, a canary release at a percentage of sessions
(``control.domain.canary``); it keeps the history of its previous stable releases for rollback
and the tenants granted to resolve it (a grant can be removed). Only releases the caller found
servable may be pointed at.
"""

from __future__ import annotations

from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.canary import MAX_CANARY_PERCENT
from control.domain.errors import AlreadyExists, DomainError, IllegalTransition, NotFound
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
