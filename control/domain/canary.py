"""The canary split: which release one session of a tenant gets from an alias.

A session lands in one of 100 buckets by the hash of (tenant, session id), so the same session
always gets the same release while the split stands, and ``percent`` per cent of sessions get
the canary.
"""

from __future__ import annotations

import hashlib

MAX_CANARY_PERCENT = 100


def canary_bucket(tenant: str, session: str) -> int:
    """The bucket 0..99 of (tenant, session id): the same session always lands in one bucket."""
    h = hashlib.sha256(f"{tenant}\0{session}".encode()).digest()
    return int.from_bytes(h[:8], "big") % 100


def choose_release(stable: str | None, canary: str | None, percent: int,
                   bucket: int) -> list[str]:
    """The releases to try for one resolution, preferred first.

    The bucket picks the canary for ``percent`` per cent of sessions; with no stable release the
    canary takes every session. The other release follows as a fallback (used only when the
    preferred one is no longer servable, e.g. revoked).
    """
    if canary is not None and (stable is None or bucket < percent):
        order = [canary, stable]
    else:
        order = [stable, canary]
    return [r for r in order if r is not None]
