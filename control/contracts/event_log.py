"""Reading the event store's notification log, a page at a time: the one loop every reader uses.

The notification log gives every stored event a position (its notification id), in the order
the events were recorded. The audit view, the integrity seal and the projection follower all
read "the positions after ``after``, up to ``stop``", one bounded page at a time so a long
history never sits in memory at once. The rules of that loop live here:

- ``after`` is exclusive (``inclusive_of_start=False``): a reader passes the last position it
  has seen, never "that plus one", so a gap in the positions cannot make it skip an event.
  ``after=None`` reads from the very first row, even one at a (forged) position ``<= 0``, which
  the integrity check must see.
- ``stop`` is inclusive, as eventsourcing's ``select_notifications`` has it.
- The log is read until a page comes back empty, not until one comes back short: an event
  recorded while a reader pages through is still read, as each reader did before this helper.

Every reader chooses its own page size (the follower's is its batch: one page, one
transaction), so there is no shared default.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from eventsourcing.persistence import Notification


class NotificationLog(Protocol):
    """What the helpers need of an eventsourcing ``ApplicationRecorder``."""

    def select_notifications(
        self,
        start: int | None,
        limit: int,
        stop: int | None = None,
        topics: Sequence[str] = (),
        *,
        inclusive_of_start: bool = True,
    ) -> Sequence[Notification]:
        """Notifications from ``start`` (see eventsourcing), at most ``limit``, up to ``stop``."""
        ...


def page_after(
    log: NotificationLog, after: int | None, page_size: int, *, stop: int | None = None,
    topics: Sequence[str] = (),
) -> Sequence[Notification]:
    """The first ``page_size`` notifications after position ``after`` (and at most ``stop``);
    ``topics``: only events of these topics (a reader that follows one kind of event)."""
    return log.select_notifications(start=after, limit=page_size, stop=stop, topics=topics,
                                    inclusive_of_start=False)


def notification_pages(
    log: NotificationLog,
    *,
    after: int | None = 0,
    stop: int | None = None,
    page_size: int,
    limit: int | None = None,
) -> Iterator[Sequence[Notification]]:
    """Pages of the notifications after ``after`` up to ``stop``, in order, none of them empty.

    ``limit`` caps how many notifications all pages hold together (the last page is shortened
    to fit). Pages are read lazily: a reader that stops early reads no further.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, found {page_size}")
    position = after
    left = limit
    while left is None or left > 0:
        page = page_after(log, position, page_size if left is None else min(page_size, left),
                          stop=stop)
        if not page:
            return
        yield page
        position = page[-1].id
        if left is not None:
            left -= len(page)
        if stop is not None and position >= stop:
            return  # nothing beyond stop can come back: spare the empty read


def notifications(
    log: NotificationLog,
    *,
    after: int | None = 0,
    stop: int | None = None,
    page_size: int,
    limit: int | None = None,
) -> Iterator[Notification]:
    """The notifications of :func:`notification_pages`, one at a time."""
    for page in notification_pages(log, after=after, stop=stop, page_size=page_size,
                                   limit=limit):
        yield from page
