"""The revocation desk: taking an adapter away, the fallback of every alias it served, and the
serving side's report of each step of the work.

A revocation and the fallback of every alias routed to the adapter are ONE transaction: no
projection ever shows the revocation without the fallback (``control.domain.fallback`` holds
the rules). It takes something away, so it returns only once the revocation set Triton hosts
read holds the digest (else :class:`~control.app.unit_of_work.NotYetVisible`).

Kept apart from the lifecycle desk (``control.app.lifecycle``), which moves adapters forward:
this one reads the routing projection to find every alias to fall back.
"""

from __future__ import annotations

import logging

from eventsourcing.domain import Aggregate

from control.app.unit_of_work import VISIBLE_WITHIN_S, UnitOfWork
from control.domain import Adapter, Conflict, Release, fall_back

log = logging.getLogger("loraplane.registry")

_ATTEMPTS = 5  # a save lost to a concurrent alias move or host report is retried


class RevocationDesk:
    """Revokes adapters and records the serving side's revocation steps on ``registry``."""

    def __init__(self, registry: UnitOfWork) -> None:
        self.registry = registry

    def revoke(self, digest: str, reason: str, *, actor: str, immediate: bool = False,
               wait_s: float = VISIBLE_WITHIN_S) -> None:
        """Revoke an adapter, from any state: no new resolution from the next projection
        update on; queued requests on it are refused; running ones drain, or, with
        ``immediate`` (the kill switch, for security and licence events), end at once. The
        serving side then reports drained, purged, unloaded per host. ``immediate`` on an
        adapter that is already revoked escalates its revocation.

        Returns only once the revocation set that Triton hosts read holds ``digest`` (and its
        kill switch, if asked); else NotYetVisible after ``wait_s`` seconds (the revocation
        stays recorded).
        """
        reg = self.registry
        for attempt in range(_ATTEMPTS):
            adapter = reg.adapter(digest)
            escalation = adapter.revoked
            adapter.revoke(reason, actor, immediate=immediate)
            # Every alias routed to the adapter applies its fallback policy in this same
            # transaction: no projection ever shows the revocation without the fallback. (An
            # escalation applied it with the first revocation.)
            fallen = [] if escalation else self._fall_back(adapter, actor)
            try:
                position = reg.commit(adapter, *fallen, what="adapter")
                break
            except Conflict:
                if attempt == _ATTEMPTS - 1:  # an alias kept moving under the revocation
                    raise
        reg.confirm_visible(position, lambda v: v.is_revoked(digest, immediate=immediate),
                            "the revocation", wait_s)

    def _fall_back(self, adapter: Adapter, actor: str) -> list[Aggregate]:
        """Apply the fallback policy of every alias whose stable or canary release uses
        ``adapter`` (just revoked, not saved); return the aggregates that changed (aliases, and
        a base-only release a ``base`` policy created). See ``control.domain.fallback``."""
        reg = self.registry
        names = {adapter.alias}
        try:
            if reg.follows:
                reg.follower.catch_up()  # the aliases pointed at it a moment ago count too
            names.update(reg.follower.routing().aliases_using_adapter(adapter.digest))
        except Exception:
            # Never let the lookup block the revocation: an alias missed here still serves
            # nothing of the revoked adapter (resolution skips releases that are not servable).
            log.warning("finding the aliases routed to a revoked adapter failed; falling back "
                        "only on its own alias", exc_info=True)
        releases: dict[str, Release] = {}

        def release(digest: str) -> Release:
            if digest not in releases:
                releases[digest] = reg.release_manifest(digest)
            return releases[digest]

        def servable(digest: str) -> bool:
            r = release(digest)
            return r.adapter_digest != adapter.digest and reg.release_servable(r)

        changed: list[Aggregate] = []
        for name in sorted(names):
            route = reg.alias_or_none(name)
            if route is None:
                continue
            revoked_stable = route.stable

            def base_release(stable: str | None = revoked_stable) -> str:
                assert stable is not None  # asked only when the stable release was revoked
                made = reg.catalogue.new_base_release(reg.base(release(stable).base_digest),
                                                      actor)
                releases.setdefault(made.digest, made)
                return made.digest

            outcome = fall_back(
                route.fallback, stable=route.stable, canary=route.canary,
                history=route.history,
                revoked=lambda d: release(d).adapter_digest == adapter.digest,
                servable=servable, base_release=base_release)
            if outcome is None:
                continue
            route.fall_back(adapter.digest, outcome, actor)
            changed.append(route)
        changed.extend(r for r in releases.values() if r.pending_events)
        return changed

    def record_serving_step(self, digest: str, host: str, step: str, *, actor: str) -> None:
        """Record one step of the serving side's revocation work on ``host``:
        ``drained`` (references at zero), ``purged`` (every cache entry of the digest gone),
        ``unloaded`` (no longer resident). Steps come in that order, once each per host.

        The backend calls this (or ``loraplane adapter serving-step``) after each step; a lost
        race with another host's report on the same adapter is retried here.
        """
        for attempt in range(_ATTEMPTS):
            adapter = self.registry.adapter(digest)
            adapter.record_serving_step(host, step, actor)
            try:
                self.registry.commit(adapter, what="adapter")
                return
            except Conflict:
                if attempt == _ATTEMPTS - 1:
                    raise


__all__ = ["RevocationDesk"]
