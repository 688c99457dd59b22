"""Names and actors: what a tenant, alias, base, key, host or task may be called, and who acted.

Names travel into URLs, file names and log lines, so they are short and drawn from a small
alphabet. Every event names the ``actor`` who caused it; an empty actor is refused.
"""

from __future__ import annotations

import re

from control.domain.errors import DomainError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid tenant/alias/base/key name, else raise DomainError."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise DomainError(
            f"invalid {kind} name: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return value


def check_actor(actor: str) -> str:
    """Every event names who caused it; an empty actor is refused."""
    if not isinstance(actor, str) or not actor.strip():
        raise DomainError("actor is required")
    return actor
