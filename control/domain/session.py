"""The ``SessionPin`` aggregate: the release one session of a tenant keeps on one alias.

A session is (tenant, alias, session id). Its first resolution pins the release it got; from then
on it keeps that release, across stable promotions and canary moves, so a multi-turn chat or a
stream that reconnects never switches version midway. A pin lasts until the session ends or its
expiry passes (``LORAPLANE_SESSION_TTL_S`` after it was pinned). The expiry is fixed when the pin
is recorded and not extended by use: extending it would cost an event per request.

A pin is never served when its release is no longer servable (revoked, deprecated): the next
resolution re-pins the session to what the alias resolves then (``SessionRepinned``, with the
reason), as does the first resolution after the pin expired or the session ended. Re-pins and
ends are the only changes; the aggregate keeps every one, so an auditor sees which release
each session held and why it moved.

An alias can also move every pin it holds on one release at once (``Alias.repin_sessions``, one
event on the alias, after a rollback): the routing projection applies it to each pin. Such a
pin then holds the alias's release, not the one this aggregate last recorded;
:func:`effective_release` says which one counts. When a rollback has no servable stable release
to re-pin to, it ends each pin on the rolled-back release instead (``SessionEnded``, in the
rollback's transaction: ``control.app.rollouts``): no session stays on it.

The id is uuid5 of (tenant, alias, session id): two gateways pinning one session at once
collide on the event store's unique index, and the loser reads the winner's pin.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.errors import DomainError, IllegalTransition
from control.domain.ids import session_pin_id
from control.domain.names import check_actor, check_name

# A session id as clients send it (gateway body field ``session``, header ``x-session-id``).
SESSION_RE = re.compile(r"^[\x21-\x7e]{1,128}$")


class RepinReason(StrEnum):
    """Why a session was pinned again."""

    EXPIRED = "expired"  # the pin's lifetime passed
    NOT_SERVABLE = "not_servable"  # its release was revoked or deprecated
    RESTARTED = "restarted"  # the session had ended; the same id started again


def check_session(session: str) -> str:
    """Return ``session`` if it is a valid session id (1-128 printable ASCII, no space)."""
    if not isinstance(session, str) or not SESSION_RE.match(session):
        raise DomainError("a session id is 1-128 printable ASCII characters, without spaces")
    return session


def why_repin(*, ended: bool, expires_at: float, now: float,
              servable: bool) -> RepinReason | None:
    """Why a pin no longer holds at ``now`` (epoch seconds), or None when it does.

    A release that is not servable wins over expiry, so the record says that the session left a
    revoked release, not merely that its time ran out."""
    if ended:
        return RepinReason.RESTARTED
    if not servable:
        return RepinReason.NOT_SERVABLE
    if now >= expires_at:
        return RepinReason.EXPIRED
    return None


def effective_release(recorded: str, recorded_version: int, projected: str | None,
                      projected_version: int | None) -> str:
    """The release a pin holds: the projection's, when the projection has applied this pin's
    latest own event (then it also holds every alias-wide re-pin recorded after it); else the
    aggregate's own, newer than anything the projection shows."""
    if projected is not None and projected_version == recorded_version:
        return projected
    return recorded


class SessionPin(Aggregate):
    """The release of one session; ``expires_at`` in epoch seconds (UTC)."""

    class SessionPinned(Aggregate.Created):
        tenant: str
        alias: str
        session: str
        release: str
        expires_at: datetime
        actor: str

    class SessionRepinned(Aggregate.Event):
        tenant: str
        alias: str
        session: str
        release: str
        expires_at: datetime
        reason: str  # a RepinReason
        actor: str

    class SessionEnded(Aggregate.Event):
        tenant: str
        alias: str
        session: str
        actor: str

    @staticmethod
    def create_id(tenant: str, alias: str, session: str) -> UUID:
        return session_pin_id(tenant, alias, session)

    @event(SessionPinned)
    def __init__(self, tenant: str, alias: str, session: str, release: str,
                 expires_at: datetime, actor: str) -> None:
        self.tenant = tenant
        self.alias = alias
        self.session = session
        self.release = release
        self.expires_at = expires_at
        self.ended = False

    @classmethod
    def create(cls, tenant: str, alias: str, session: str, release: str, expires_at: datetime,
               actor: str) -> SessionPin:
        """The first pin of a session: ``release`` until ``expires_at``."""
        return cls(tenant=check_name("tenant", tenant), alias=check_name("alias", alias),
                   session=check_session(session), release=release,
                   expires_at=_aware(expires_at), actor=check_actor(actor))

    def why_repin(self, now: float, servable: bool) -> RepinReason | None:
        """Why this pin no longer holds at ``now`` (``servable``: of the release it holds)."""
        return why_repin(ended=self.ended, expires_at=self.expires_at.timestamp(), now=now,
                         servable=servable)

    def repin(self, release: str, expires_at: datetime, reason: RepinReason,
              actor: str) -> None:
        """Pin the session to ``release`` afresh because of ``reason``."""
        self._repinned(tenant=self.tenant, alias=self.alias, session=self.session,
                       release=release, expires_at=_aware(expires_at),
                       reason=RepinReason(reason).value, actor=check_actor(actor))

    @event(SessionRepinned)
    def _repinned(self, tenant: str, alias: str, session: str, release: str,
                  expires_at: datetime, reason: str, actor: str) -> None:
        self.release = release
        self.expires_at = expires_at
        self.ended = False

    def end(self, actor: str) -> None:
        """End the session: its next resolution starts a new pin."""
        if self.ended:
            raise IllegalTransition("the session has ended already")
        self._ended(tenant=self.tenant, alias=self.alias, session=self.session,
                    actor=check_actor(actor))

    @event(SessionEnded)
    def _ended(self, tenant: str, alias: str, session: str, actor: str) -> None:
        self.ended = True


@dataclass(frozen=True)
class Pin:
    """One session's pin as a view or a command sees it (a value, not the aggregate: the
    routing projection, the gateway's route cache and ``control.app.sessions`` all pass it).

    ``expires_at``: epoch seconds. ``version``: the SessionPin aggregate's version its row last
    applied. ``position``: where its event sits in the notification log, when it was recorded
    just now (0 otherwise): a gateway remembers such a pin until its view has passed that
    position."""

    tenant: str
    alias: str
    session: str
    release: str
    expires_at: float
    version: int
    ended: bool = False
    position: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.tenant, self.alias, self.session)

    def holds(self, now: float) -> bool:
        """Not ended and not expired at ``now`` (servability is the view's to judge)."""
        return not self.ended and now < self.expires_at


def _aware(when: datetime) -> datetime:
    if when.tzinfo is None:
        raise DomainError("a pin's expiry must carry its time zone (UTC)")
    return when
