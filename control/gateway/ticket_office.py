"""Issuing routing tickets: resolve (tenant, alias) on the routing projection, then sign.

The gateway and the operator CLI both issue through here, so both follow the same rules: a tenant
gets a ticket only for an alias it is granted, that points at a servable release, signed by a key
that is not retired. When the key in use is retired, the office switches to the newest key it
holds that is recorded and not retired (``control.app.key_ring``); holding none, it issues nothing
(:class:`SigningUnavailable`, which the gateway answers with 503).

Sessions keep their release (``control.domain.session``). A request that names a session gets
the release its pin holds, when the pin still holds; otherwise the office resolves the alias
afresh and, given a :class:`control.app.sessions.SessionPins`, records the pin before it signs,
and remembers it in its routing view so the session's next request gets it at once. Two
offices pinning one session at once end with one pin: the loser signs the winner's release. An
office opened without pins (the operator CLI) honours the pins it finds and records none.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import sqlalchemy as sa
from eventsourcing.persistence import PersistenceError

from control.app import key_ring
from control.app.sessions import Pin, SessionPins
from control.contracts.config import SHARED_POOL, Settings
from control.contracts.placement import affinity_of
from control.contracts.ticket_seals import publish_seal
from control.contracts.tickets import TicketClaims, TicketSigner
from control.domain import Conflict
from projections.route_cache import RoutingUnavailable
from projections.routing import Route, RoutingView

log = logging.getLogger("loraplane.ticket_office")

# With no usable key, look at the keys folder again at most this often: a flood of ticket
# requests must not turn into a flood of key-file reads and database queries.
RESCAN_S = 1.0


class NotGranted(Exception):
    """No ticket: unknown alias, not granted, not servable or revoked (deliberately one error
    for tenants; :func:`why_not` tells an operator which)."""


def why_not(routing: RoutingView, tenant: str, alias: str) -> str:
    """For operators only (it names the cause): why ``tenant`` gets no ticket for ``alias``.

    A tenant always gets the one generic refusal, so it cannot probe which aliases exist.
    """
    if tenant not in routing.tenants():
        return f"unknown tenant {tenant!r}: run `loraplane tenant create {tenant}`"
    if routing.alias_row(alias) is None:
        return f"unknown alias {alias!r}: no alias of that name exists"
    if not routing.is_granted(tenant, alias):
        return f"not granted: run `loraplane grant {tenant} {alias}`"
    row = routing.alias_row(alias)
    if row is not None and row.stable_release is None and row.canary_release is None:
        return (f"alias {alias!r} points at no servable release: it points at none (never "
                f"promoted to canary or stable, or its release's adapter was revoked and its "
                f"fallback policy ({row.fallback}) left nothing servable); point it "
                f"(`loraplane alias point {alias} TARGET`), see `loraplane alias show {alias}`")
    return (f"alias {alias!r} points at no servable release (revoked, or never promoted to "
            "canary or stable): see `loraplane alias show " + alias + "`")


class SigningUnavailable(RuntimeError):
    """No ticket: the signing key is retired and no other recorded, unretired key is held."""


@dataclass(frozen=True)
class IssuedTicket:
    token: str
    claims: TicketClaims
    alias: str
    release: str | None = None  # the release manifest resolved at issue time (also signed)


class TicketOffice:
    def __init__(self, settings: Settings, routing: RoutingView, signer: TicketSigner,
                 pins: SessionPins | None = None) -> None:
        """``pins``: where this office records session pins (None: it records none)."""
        self.settings = settings
        self.routing = routing
        self.signer = signer
        self.pins = pins
        self._switch = threading.Lock()
        self._sealed: set[str] = set()  # key ids whose seal this office has published
        self._failed_scan_at = float("-inf")

    def issue(self, tenant: str, alias: str, session: str | None = None) -> IssuedTicket:
        """A fresh ticket for ``tenant`` to use ``alias``, else NotGranted.

        ``session``: the client's session id. A session keeps the release it first resolved
        (its pin) until it ends or the pin expires; a fresh resolution splits the canary by
        the hash of (tenant, session). The ticket binds the adapter, base, tokenizer and
        manifest digest of the release resolved now, so a request in flight keeps it when the
        alias moves, and the host's ledger names the release it served.
        """
        route = self.routing.resolve(tenant, alias, session)
        if route is None:
            raise NotGranted()
        if session is not None and self.pins is not None and not route.pinned:
            route = self._pin(tenant, alias, session, route)
        pool, regions = self._placement(tenant, route)
        token, claims = self.current_signer().issue(
            tenant=tenant,
            model=self.settings.model_name,
            base=route.base_digest,
            adapter=route.adapter_digest,
            tokenizer=route.tokenizer_digest,
            release=route.release,
            # the owner alone may be told which adapter served it: a granted tenant must not
            # learn the owner's adapter or which arm of its rollout it is on
            disclose=route.owner is not None and route.owner == tenant,
            ttl_s=self.settings.ticket_ttl_s,
            pool=pool,
            regions=regions,
            # signed, so a host's OpenAI route can hold a request's ``model`` to it and its
            # placement metrics can name the alias's value instead of the sealed digest
            affinity=self._affinity(tenant, alias, route),
        )
        return IssuedTicket(token, claims, alias, route.release)

    def _affinity(self, tenant: str, alias: str, route: Route) -> str:
        """The alias's own value when its owner bounds its adapters' replicas (every tenant's
        requests then go where the owner's do), else the caller's value for the alias (a shared
        alias spreads over the hosts by tenant): ``control.contracts.placement``."""
        bounded = (route.owner is not None
                   and self.routing.placement(route.owner).max_replicas is not None)
        return affinity_of(alias) if bounded else affinity_of(alias, tenant)

    def _placement(self, tenant: str, route: Route) -> tuple[str, tuple[str, ...]]:
        """Where the ticket may run: the dedicated pool of the release's owner or of the
        caller (their prompts and adapter stay in it), else the shared one; in the regions
        both allow. A dedicated owner granting a tenant dedicated elsewhere, or regions that do
        not meet, leave nowhere to run: NotGranted, as any refusal."""
        sides = [self.routing.placement(tenant)]
        if route.owner is not None and route.owner != tenant:
            sides.append(self.routing.placement(route.owner))
        pools = {p.pool for p in sides if p.pool is not None}
        if len(pools) > 1:
            raise NotGranted()
        allowed: set[str] | None = None
        for side in sides:
            if side.regions:
                allowed = set(side.regions) if allowed is None else allowed & set(side.regions)
        if allowed is not None and not allowed:
            raise NotGranted()
        return (pools.pop() if pools else SHARED_POOL), tuple(sorted(allowed or ()))

    def _pin(self, tenant: str, alias: str, session: str, fresh: Route) -> Route:
        """Record ``fresh`` as ``session``'s pin, unless another office's pin holds: then
        return that one's route."""
        assert self.pins is not None and fresh.release is not None

        def servable(release: str) -> bool:
            return self.routing.route_to(tenant, alias, release) is not None

        try:
            pin = self.pins.pin(tenant, alias, session, fresh.release, servable=servable,
                                seen=self.routing.session_pin(tenant, alias, session))
        except (PersistenceError, sa.exc.SQLAlchemyError, Conflict) as e:
            # No ticket without its pin (the session could switch release later): fail
            # closed, as for unreadable routing (the gateway answers 503).
            log.warning("recording a session pin failed: %s", type(e).__name__)
            raise RoutingUnavailable("session pins cannot be recorded") from e
        self.routing.remember_pin(pin)
        if pin.release == fresh.release:
            return replace(fresh, pinned=True)
        route = self.routing.route_to(tenant, alias, pin.release)
        if route is None:  # the winner's release stopped being servable just now
            raise NotGranted()
        return route

    def end_session(self, tenant: str, alias: str, session: str) -> bool:
        """End ``tenant``'s ``session`` on ``alias``: its next request resolves afresh. True
        when a pin was ended; False when there was none (or it had ended), recording nothing.
        A tenant can only name its own sessions: the tenant is part of the pin's identity."""
        if self.pins is None:
            raise RuntimeError("this ticket office records no session pins")
        try:
            pin: Pin | None = self.pins.end(tenant, alias, session)
        except (PersistenceError, sa.exc.SQLAlchemyError, Conflict) as e:
            log.warning("ending a session failed: %s", type(e).__name__)
            raise RoutingUnavailable("session pins cannot be recorded") from e
        if pin is None:
            return False
        self.routing.remember_pin(pin)
        return True

    def current_signer(self) -> TicketSigner:
        """The signer to use now: never one whose key is retired (SigningUnavailable), and
        never one whose seal key hosts cannot find (published here before its first ticket)."""
        retired = self.routing.retired_key_ids()
        signer = self.signer
        if signer.kid in retired:
            with self._switch:
                if self.signer.kid in retired:
                    self.signer = self._replacement(retired)
                signer = self.signer
        if signer.kid not in self._sealed:
            try:
                publish_seal(self.routing.engine, signer)
            except sa.exc.SQLAlchemyError as e:
                raise RoutingUnavailable("the ticket seal cannot be published") from e
            self._sealed.add(signer.kid)
        return signer

    def _replacement(self, retired: frozenset[str]) -> TicketSigner:
        if time.monotonic() - self._failed_scan_at < RESCAN_S:
            raise SigningUnavailable("no unretired ticket signing key")
        # only keys the offline root vouches for: hosts refuse tickets of any other
        recorded = self.routing.vouched_signing_keys(self.settings.keys_dir)
        found = key_ring.pick_signer(self.settings.keys_dir,
                                     lambda kid: kid in recorded and kid not in retired)
        if found is None:
            self._failed_scan_at = time.monotonic()
            log.error("signing key %s is retired and no recorded, unretired key is held under "
                      "%s: no tickets until `loraplane key rotate`", self.signer.kid,
                      self.settings.keys_dir)
            raise SigningUnavailable("no unretired ticket signing key")
        log.warning("signing key %s is retired; signing with %s from now on", self.signer.kid,
                    found.kid)
        return found
