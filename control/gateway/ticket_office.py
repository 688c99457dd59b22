"""Issuing routing tickets: resolve (tenant, alias) on the routing projection, then sign.

The gateway and the operator CLI both issue through here, so both follow the same rules: a tenant
gets a ticket only for an alias it is granted, that points at a servable release, signed by a key
that is not retired. When the key in use is retired, the office switches to the newest key it
holds that is recorded and not retired (``control.app.key_ring``); holding none, it issues nothing
(:class:`SigningUnavailable`, which the gateway answers with 503).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from control.app import key_ring
from control.contracts.config import Settings
from control.contracts.tickets import TicketClaims, TicketSigner
from projections.routing import RoutingView

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
    def __init__(self, settings: Settings, routing: RoutingView, signer: TicketSigner) -> None:
        self.settings = settings
        self.routing = routing
        self.signer = signer
        self._switch = threading.Lock()
        self._failed_scan_at = float("-inf")

    def issue(self, tenant: str, alias: str, session: str | None = None) -> IssuedTicket:
        """A fresh ticket for ``tenant`` to use ``alias``, else NotGranted.

        ``session``: the client's session id; the alias's canary split hashes (tenant, session)
        so a session keeps landing on one release. The ticket binds the adapter, base,
        tokenizer and manifest digest of the release resolved now, so a request in flight keeps
        it when the alias moves, and the host's ledger names the release it served.
        """
        route = self.routing.resolve(tenant, alias, session)
        if route is None:
            raise NotGranted()
        token, claims = self.current_signer().issue(
            tenant=tenant,
            model=self.settings.model_name,
            base=route.base_digest,
            adapter=route.adapter_digest,
            tokenizer=route.tokenizer_digest,
            release=route.release,
            ttl_s=self.settings.ticket_ttl_s,
        )
        return IssuedTicket(token, claims, alias, route.release)

    def current_signer(self) -> TicketSigner:
        """The signer to use now: never one whose key is retired (SigningUnavailable)."""
        retired = self.routing.retired_key_ids()
        if self.signer.kid not in retired:
            return self.signer
        with self._switch:
            if self.signer.kid in retired:
                self.signer = self._replacement(retired)
            return self.signer

    def _replacement(self, retired: frozenset[str]) -> TicketSigner:
        if time.monotonic() - self._failed_scan_at < RESCAN_S:
            raise SigningUnavailable("no unretired ticket signing key")
        recorded = self.routing.signing_keys()
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
