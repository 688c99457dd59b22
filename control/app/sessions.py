"""Recording session pins: the release a session keeps (``control.domain.session``).

A gateway asks for a pin only when its routing view holds none that is still good for the
session (absent, expired, ended, or on a release no longer servable): :meth:`SessionPins.pin`
then records the first pin or a re-pin, each one event on the session's own ``SessionPin``
aggregate. A pin that is still good is read, never written: a session costs one event per
lifetime, not one per request.

Races: the aggregate's id is uuid5 of (tenant, alias, session id), so two gateways pinning one
new session at once collide on the event store's unique index. The loser reads the winner's
pin and serves it; a re-pin that lost is read back the same way. Either way both gateways
issue tickets for one release.

What counts as the pinned release: the aggregate's own, unless the caller's view has applied
its latest event, in which case the view's (it also reflects alias-wide re-pins recorded after
it, ``Alias.repin_sessions``); see ``control.domain.session.effective_release``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

from eventsourcing.application import AggregateNotFoundError

from control.app.registry import Registry
from control.domain import (
    AlreadyExists,
    Conflict,
    Pin,
    RepinReason,
    SessionPin,
    check_actor,
    check_name,
    check_session,
    effective_release,
    session_pin_id,
)

# A pin lost to a concurrent writer is read back and decided again, at most this many times.
_ATTEMPTS = 5


@runtime_checkable
class PinReads(Protocol):
    """The projection's view of pins (``projections.routing.RoutingView.session_pins``)."""

    def session_pins(self, alias: str) -> list[Pin]: ...


class SessionPins:
    """Pins sessions on ``registry``'s event store. ``ttl_s``: a pin's lifetime (default the
    registry's ``session_ttl_s``); ``clock``: epoch seconds (tests move it)."""

    def __init__(self, registry: Registry, *, actor: str, ttl_s: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.actor = check_actor(actor)
        self.ttl_s = registry.settings.session_ttl_s if ttl_s is None else ttl_s
        self.clock = clock

    def _load(self, tenant: str, alias: str, session: str) -> SessionPin | None:
        try:
            agg: object = self.registry.repository.get(session_pin_id(tenant, alias, session))
        except AggregateNotFoundError:
            return None
        return agg if isinstance(agg, SessionPin) else None

    def current(self, tenant: str, alias: str, session: str) -> Pin | None:
        """The pin as recorded in the event store (no projection involved), or None."""
        agg = self._load(tenant, alias, session)
        return None if agg is None else _pin(agg)

    def pin(self, tenant: str, alias: str, session: str, release: str, *,
            servable: Callable[[str], bool], seen: Pin | None = None) -> Pin:
        """The pin ``session`` holds from now on: the one recorded, if it still holds, else a
        new pin (or re-pin) to ``release``, what a fresh resolution gives now.

        ``servable(release)``: whether a release may be served to this tenant through this alias
        now. ``seen``: the pin as the caller's view shows it, if any (it may carry an alias-wide
        re-pin the aggregate does not).
        """
        check_name("tenant", tenant)
        check_name("alias", alias)
        check_session(session)
        for attempt in range(_ATTEMPTS):
            now = self.clock()
            agg = self._load(tenant, alias, session)
            expires_at = datetime.fromtimestamp(now + self.ttl_s, UTC)
            if agg is None:
                agg = SessionPin.create(tenant, alias, session, release, expires_at, self.actor)
            else:
                held = effective_release(agg.release, agg.version,
                                         None if seen is None else seen.release,
                                         None if seen is None else seen.version)
                reason = agg.why_repin(now, servable(held))
                if reason is None:
                    # Recorded elsewhere and not yet in the caller's view: the log's end now
                    # bounds its position, so a caller remembers it until its view gets there.
                    upto = int(self.registry.recorder.max_notification_id() or 0)
                    return _pin(agg, release=held, position=upto)
                agg.repin(release, expires_at, reason, self.actor)
            try:
                position = self.registry.commit(agg, what="session pin")
            except (AlreadyExists, Conflict):
                # Another gateway pinned or re-pinned this session first: decide again on its
                # record (a good pin is served as it is, never overwritten).
                seen = None
                if attempt == _ATTEMPTS - 1:
                    raise
                continue
            return _pin(agg, position=position)
        raise AssertionError("unreachable")  # the loop returns or raises

    def end(self, tenant: str, alias: str, session: str) -> Pin | None:
        """End a session (its next resolution starts a new pin). Returns the ended pin, or None
        when there was no pin or it had ended already: nothing is recorded then."""
        check_name("tenant", tenant)
        check_name("alias", alias)
        check_session(session)
        for attempt in range(_ATTEMPTS):
            agg = self._load(tenant, alias, session)
            if agg is None or agg.ended:
                return None
            agg.end(self.actor)
            try:
                position = self.registry.commit(agg, what="session pin")
            except Conflict:
                if attempt == _ATTEMPTS - 1:
                    raise
                continue
            return _pin(agg, position=position)
        raise AssertionError("unreachable")


    def live_on(self, alias: str, release: str) -> list[Pin]:
        """The sessions of ``alias`` whose pin holds ``release`` now (not ended, not expired),
        as the routing projection shows them once caught up with the event log (it applies
        alias-wide re-pins, which a pin's own aggregate does not know of)."""
        follower = self.registry.follower
        follower.catch_up()
        routing = follower.routing()
        if not isinstance(routing, PinReads):
            raise TypeError("the registry's routing view cannot list session pins")
        now = self.clock()
        return [p for p in routing.session_pins(alias) if p.release == release and p.holds(now)]

    def ending(self, pins: Iterable[Pin]) -> list[SessionPin]:
        """The pin aggregates of ``pins`` with their end applied, not saved: the caller saves
        them in its own transaction (a rollback's). Sessions that ended already are left out."""
        out = []
        for p in pins:
            agg = self._load(p.tenant, p.alias, p.session)
            if agg is not None and not agg.ended:
                agg.end(self.actor)
                out.append(agg)
        return out


def _pin(agg: SessionPin, *, release: str | None = None, position: int = 0) -> Pin:
    return Pin(tenant=agg.tenant, alias=agg.alias, session=agg.session,
               release=release or agg.release, expires_at=agg.expires_at.timestamp(),
               version=agg.version, ended=agg.ended, position=position)


# ``Pin`` lives in the domain (control.domain.session); importable from here as it always was.
__all__ = ["Pin", "PinReads", "RepinReason", "SessionPins"]
