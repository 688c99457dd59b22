"""The aliases desk: grants, an alias's stable release and canary split, its fallback policy,
rollbacks, and the alias-wide moves of its sessions' pins.

An alias only ever moves to a verified unit (:meth:`AliasDesk.target_release`): a release, an
adapter's release, or a base alone; an adapter's release on another base than it was
registered on only while a passing gate report vouches for exactly that combination. Removing
a grant takes something away, so it returns only once gateways refuse the tenant.
"""

from __future__ import annotations

from control.app.unit_of_work import VISIBLE_WITHIN_S, UnitOfWork
from control.domain import (
    Combination,
    IllegalTransition,
    NotFound,
    Release,
    adapter_id,
    base_id,
    release_id,
)


class AliasDesk:
    """Grants aliases and moves them on ``registry``."""

    def __init__(self, registry: UnitOfWork) -> None:
        self.registry = registry

    # -- grants -----------------------------------------------------------------------------

    def grant(self, tenant: str, alias: str, *, actor: str) -> None:
        """Allow ``tenant`` to resolve ``alias`` (both must exist)."""
        self.registry.tenant(tenant)
        route = self.registry.alias(alias)
        route.grant(tenant, actor)
        self.registry.commit(route, what="grant")

    def remove_grant(self, tenant: str, alias: str, *, actor: str,
                     wait_s: float = VISIBLE_WITHIN_S) -> None:
        """Stop ``tenant`` resolving ``alias``; returns once gateways refuse it."""
        route = self.registry.alias(alias)
        route.remove_grant(tenant, actor)
        position = self.registry.commit(route, what="grant")
        self.registry.confirm_visible(position, lambda v: not v.is_granted(tenant, alias),
                                      "the grant removal", wait_s)

    # -- where an alias routes ----------------------------------------------------------------

    def target_release(self, target: str, actor: str) -> Release:
        """A release by manifest digest, by adapter digest (its release), or by base digest (a
        base-only release, created if new: then it has pending events).

        An adapter's release on another base or tokenizer than the adapter was registered on
        (a base upgrade's) is a target only while a passing gate report vouches for exactly its
        combination: the unit an alias moves to is always a verified one."""
        reg = self.registry
        if reg.exists(release_id(target)):
            release = reg.release_manifest(target)
        elif reg.exists(adapter_id(target)):
            adapter = reg.adapter(target)
            if adapter.release is None:
                raise IllegalTransition("that adapter has no release yet: promote it to canary "
                                        "first")
            release = reg.release_manifest(adapter.release)
        elif reg.exists(base_id(target)):
            return reg.catalogue.new_base_release(reg.base(target), actor)
        else:
            raise NotFound("no release, adapter or base model with that digest")
        if release.adapter_digest is not None and not reg.adapter(
                release.adapter_digest).verified_on(Combination(
                    release.base_digest, release.tokenizer_digest,
                    release.chat_template_digest)):
            raise IllegalTransition(
                "that release serves its adapter on a base, tokenizer and chat template no "
                "passing gate report vouches for: gate it there first (loraplane base upgrade "
                "plan NEW_BASE)")
        return release

    def point_alias(self, alias: str, target: str, *, actor: str) -> str:
        """Make ``target`` (release, adapter or base digest) the alias's stable release; return
        the release digest. The previous stable release goes to the alias history."""
        reg = self.registry
        route = reg.alias(alias)
        release = self.target_release(target, actor)
        route.point(release, reg.release_servable(release), actor)
        reg.commit(route, release if release.pending_events else None, what="alias")
        return release.digest

    def set_canary(self, alias: str, target: str, percent: int, *, actor: str) -> str:
        """Send ``percent`` per cent of sessions (hash of tenant and session id) to ``target``."""
        reg = self.registry
        route = reg.alias(alias)
        release = self.target_release(target, actor)
        route.set_canary(release, percent, reg.release_servable(release), actor)
        reg.commit(route, release if release.pending_events else None, what="alias")
        return release.digest

    def clear_canary(self, alias: str, *, actor: str) -> None:
        """End an alias's canary split."""
        route = self.registry.alias(alias)
        route.clear_canary(actor)
        self.registry.commit(route, what="alias")

    def set_fallback(self, alias: str, policy: str, *, actor: str) -> str:
        """Set what ``alias`` serves after its stable release's adapter is revoked: ``stable``
        (its most recent servable earlier release), ``base`` (the base alone) or ``none``
        (refuse). Returns the policy."""
        route = self.registry.alias(alias)
        route.set_fallback(policy, actor)
        self.registry.commit(route, what="alias")
        return route.fallback.value

    def rollback(self, alias: str, *, actor: str) -> str:
        """Point ``alias`` back at its previous stable release (recorded as AliasRolledBack);
        return that release's digest."""
        reg = self.registry
        route = reg.alias(alias)
        if not route.history:
            raise IllegalTransition("the alias has no previous release to roll back to")
        previous = reg.release_manifest(route.history[-1])
        route.rollback(reg.release_servable(previous), actor)
        reg.commit(route, what="alias")
        return previous.digest

    # -- the alias's sessions -----------------------------------------------------------------

    def repin_sessions(self, alias: str, from_release: str, to_release: str, *, reason: str,
                       actor: str) -> int:
        """Move every session pinned to ``from_release`` on ``alias`` to ``to_release`` (a
        release of the alias's owner, or a base release, that is servable): ONE event,
        ``AliasSessionsRepinned``, which the routing projection applies to each pin. For a
        rollout's rollback that re-pins rather than drains. Returns the event's position.

        To record it in the rollback's own transaction, call ``Alias.repin_sessions`` on the
        alias aggregate being rolled back and save both events together instead."""
        reg = self.registry
        route = reg.alias(alias)
        to = reg.release_manifest(to_release)
        route.repin_sessions(from_release, to, reg.release_servable(to), reason, actor)
        return reg.commit(route, what="alias")

    def drain_sessions(self, alias: str, release: str, *, reason: str, actor: str) -> int:
        """Record that sessions pinned to ``release`` on ``alias`` keep it until they end or
        expire (``AliasSessionsDrained``; nothing moves). Returns the event's position."""
        route = self.registry.alias(alias)
        route.drain_sessions(release, reason, actor)
        return self.registry.commit(route, what="alias")


__all__ = ["AliasDesk"]
