"""Admission checks on a Triton host: the ticket, the governance state it must pass, and the
request's own parameters. Nothing here reads adapter bytes; only what passes may lease one.

Order, and why: the ticket is verified first (signature, expiry, lifetime cap, model, base and
tokenizer binding), then checked against governance (its key is recorded in the event store and
not retired; its adapter is not
revoked; its ``release`` claim names a known release binding exactly the ticket's adapter, base
and tokenizer), then the request's parameters. Every ticket or governance failure is the one
generic refusal for the client, with a machine reason for the ledger.

Verified tickets are remembered (:class:`VerifiedTickets`): Ed25519 verification costs more than
the rest of admission together, and a client sends one ticket with many requests. The memory is
bounded (LRU), keyed by the exact token string, and every hit checks expiry again; governance is
checked on every request, hit or not, so a retired key or a revoked adapter takes effect at once.
A ticket naming an unknown key id makes the host re-read its public keys, at most once per
:data:`KEY_RELOAD_INTERVAL_S`, so a flood of forged key ids cannot turn into a flood of reloads.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from backend.serving.cache import CacheClaim
from backend.serving.ticket_param import RequestRefused, ticket_from_parameters
from control.contracts.tickets import TicketClaims, TicketRejected, TicketVerifier
from projections.host_view import GovernanceState, ReleaseBinding

VERIFIED_CACHE_SIZE = 4096
KEY_RELOAD_INTERVAL_S = 1.0
RELOAD_REASONS = frozenset({"unknown_key", "unknown_seal"})
__all__ = ["RequestRefused", "VerifiedTickets", "cache_claim", "check_governance",
           "ticket_from_parameters"]


class VerifiedTickets:
    """Ticket verification with a bounded, expiry-honouring memory and rate-limited key reloads."""

    def __init__(self, load_verifier: Callable[[], TicketVerifier], *,
                 size: int = VERIFIED_CACHE_SIZE,
                 reload_interval_s: float = KEY_RELOAD_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._load_verifier = load_verifier
        self._verifier = load_verifier()
        self._size = size
        self._reload_interval_s = reload_interval_s
        self._clock = clock
        self._last_reload = -math.inf  # the first unknown key may reload at once
        self._lock = threading.Lock()
        self._known: OrderedDict[str, TicketClaims] = OrderedDict()
        self.reloads = 0

    def verify(self, token: str, now: float | None = None) -> TicketClaims:
        """The claims of a valid ticket, else :class:`TicketRejected`."""
        t = time.time() if now is None else now
        with self._lock:
            claims = self._known.get(token)
            if claims is not None:
                if claims.exp > t:
                    self._known.move_to_end(token)
                    return claims
                del self._known[token]  # expired: verified afresh, so refused as expired
        try:
            claims = self._verifier.verify(token, now=t)
        except TicketRejected as e:
            # a key rotated in, or its seal published after this verifier was made
            if e.reason not in RELOAD_REASONS or not self._reload_keys():
                raise
            claims = self._verifier.verify(token, now=t)
        with self._lock:
            self._known[token] = claims
            while len(self._known) > self._size:
                self._known.popitem(last=False)
        return claims

    def _reload_keys(self) -> bool:
        """Re-read the public keys (a key may have been rotated in) and their seals, at most
        once per interval; True when reloaded now."""
        with self._lock:
            now = self._clock()
            if now - self._last_reload < self._reload_interval_s:
                return False
            self._last_reload = now
        verifier = self._load_verifier()
        with self._lock:
            self._verifier = verifier
            self.reloads += 1
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)


def check_governance(claims: TicketClaims, state: GovernanceState) -> None:
    """Refuse a verified ticket that governance no longer allows (RequestRefused)."""
    if claims.kid not in state.recorded_kids:
        # Signed by a key whose public half sits in the host's key folder but was never
        # recorded as an event: a file is not a grant of trust.
        raise RequestRefused("key_unrecorded")
    if claims.kid in state.retired_kids:
        raise RequestRefused("key_retired")
    not_before = state.tickets_not_before.get(claims.tenant)
    if not_before is not None and claims.iat <= not_before:
        # Issued before the tenant's credentials changed; ``iat`` has whole seconds, so a
        # ticket issued in that same second is refused too (fail closed; the gateway issues
        # a new one at once).
        raise RequestRefused("credentials")
    if claims.adapter is not None and claims.adapter in state.revoked:
        raise RequestRefused("revoked")
    if claims.release is None:
        if claims.adapter is not None:  # every adapter is served through a release manifest
            raise RequestRefused("release")
        return
    bound = state.releases.get(claims.release)
    if bound is None or (bound.adapter_digest, bound.base_digest, bound.tokenizer_digest) != (
            claims.adapter, claims.base, claims.tokenizer):
        raise RequestRefused("release")


def cache_claim(claims: TicketClaims, bound: ReleaseBinding | None,
                state: GovernanceState) -> CacheClaim:
    """Whom the ticket's adapter counts against in the host's cache: the owner of the release
    it names (``check_governance`` has matched the release to the ticket's adapter, so the
    owner comes from the event store, never from the client), with that owner's resident share
    and the requester's load rate from their policies."""
    owner = bound.tenant if bound is not None and bound.tenant is not None else claims.tenant
    owned = state.cache_limits.get(owner)
    asks = state.cache_limits.get(claims.tenant)
    return CacheClaim(requester=claims.tenant, owner=owner,
                      owner_share=owned.resident_share if owned is not None else None,
                      requester_loads_per_minute=asks.loads_per_minute if asks is not None
                      else None,
                      owner_max_replicas=owned.max_replicas if owned is not None else None)
