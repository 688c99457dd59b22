"""What a command that broke a domain rule raises; nothing is recorded when one is raised."""

from __future__ import annotations


class DomainError(Exception):
    """A command broke a rule; nothing was recorded."""


class NotFound(DomainError):
    """The named tenant, alias, base, adapter or release does not exist."""


class AlreadyExists(DomainError):
    """A tenant, base, adapter, alias or key with that identity exists already."""


class Conflict(DomainError):
    """Another command changed the same aggregate first; nothing was recorded. Retry."""


class IllegalTransition(DomainError):
    """The adapter's lifecycle (or an alias's state) does not allow that move."""


class ValidationFailed(DomainError):
    """An adapter failed the named validation ``check``.

    ``message`` is safe to show the registering tenant: it names the check and what was
    expected, never a store path or another tenant.
    """

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check
        self.message = message
