"""Aggregate ids: uuid5 of a natural key (tenant name, alias name, digest, key id).

Two processes that try to create the same thing then collide on the event store's unique index
instead of creating two. Stored events are keyed by these ids: never change ``NAMESPACE`` or the
``"<kind>:<key>"`` form, or every recorded aggregate becomes unreachable.
"""

from __future__ import annotations

from uuid import UUID, uuid5

# Fixed namespace for deterministic aggregate ids. Never change it: ids derive from it.
NAMESPACE = UUID("6f1c1b2e-4d0a-5c57-9a3e-7c1f0e3b9d42")


def _id(kind: str, key: str) -> UUID:
    return uuid5(NAMESPACE, f"{kind}:{key}")


def tenant_id(name: str) -> UUID:
    """The id of the tenant called ``name``."""
    return _id("tenant", name)


def base_id(digest: str) -> UUID:
    """The id of the base model with ``digest``."""
    return _id("base", digest)


def base_name_id(name: str) -> UUID:
    """The id of the name -> digest index entry of a base model called ``name``."""
    return _id("base-name", name)


def adapter_id(digest: str) -> UUID:
    """The id of the adapter with ``digest``."""
    return _id("adapter", digest)


def release_id(digest: str) -> UUID:
    """The id of the release named by the manifest digest ``digest``."""
    return _id("release", digest)


def alias_id(name: str) -> UUID:
    """The id of the alias (route name) ``name``."""
    return _id("alias", name)


def signing_key_id(kid: str) -> UUID:
    """The id of the ticket-signing key with key id ``kid``."""
    return _id("signing-key", kid)


def session_pin_id(tenant: str, alias: str, session: str) -> UUID:
    """The id of the pin of ``tenant``'s session ``session`` on ``alias``. Tenant and alias
    names never hold ``/`` (``names.NAME_RE``), so the key names one session only."""
    return _id("session-pin", f"{tenant}/{alias}/{session}")
