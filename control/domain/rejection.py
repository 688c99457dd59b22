"""The ``RegistrationRejection`` aggregate: one refused adapter registration, for the audit.

A refused adapter leaves nothing in the artifact store; this record of which check refused it
and why is all that remains.
"""

from __future__ import annotations

from eventsourcing.domain import Aggregate, event


class RegistrationRejection(Aggregate):
    """One refused adapter registration (random id: every refusal is its own record)."""

    class RegistrationRejected(Aggregate.Created):
        check: str
        message: str
        tenant: str
        actor: str

    @event(RegistrationRejected)
    def __init__(self, check: str, message: str, tenant: str, actor: str) -> None:
        self.check = check
        self.message = message
        self.tenant = tenant
