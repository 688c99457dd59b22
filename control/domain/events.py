"""Reading domain events without knowing their class: the payload a reader shows."""

from __future__ import annotations

from typing import Any

# The library's bookkeeping on every event; not part of what the event says.
_BOOKKEEPING = frozenset({"originator_id", "originator_version", "timestamp", "originator_topic"})


def event_fields(domain_event: Any) -> dict[str, Any]:
    """The payload of a domain event: its fields minus the library's bookkeeping."""
    return {k: v for k, v in domain_event.__dict__.items() if k not in _BOOKKEEPING}
