"""Issuing routing tickets: resolve (tenant, alias) on the routing projection, then sign.

The gateway and the operator CLI both issue through here, so both follow the same rules: a tenant
gets a ticket only for an alias it is granted, that points at a servable release.
"""

from __future__ import annotations

from dataclasses import dataclass

from control.config import Settings
from control.tickets import TicketClaims, TicketSigner
from projections.routing import RoutingView


class NotGranted(Exception):
    """No ticket: unknown alias, not granted, not servable or revoked (deliberately one error)."""


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
        token, claims = self.signer.issue(
            tenant=tenant,
            model=self.settings.model_name,
            base=route.base_digest,
            adapter=route.adapter_digest,
            tokenizer=route.tokenizer_digest,
            release=route.release,
            ttl_s=self.settings.ticket_ttl_s,
        )
        return IssuedTicket(token, claims, alias, route.release)
