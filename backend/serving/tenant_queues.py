"""The scheduler's waiting room, shared fairly between tenants.

One FIFO queue let a single tenant decide everyone's service: a flood of its requests filled the
``max_queued`` bound, so every other tenant was refused as busy, and whatever got in waited
behind the whole flood. Tenants are adversaries; the order and the room they get must not be
something another tenant can buy with volume. So each tenant has its own FIFO, and:

- **Room, by push-out.** While the bound is not reached, anyone queues: a lone tenant may use it
  all. At the bound, a request from a tenant that holds fewer than the largest holder minus one
  takes the place of that holder's newest request, which is refused as busy (what it would have
  got had it come when the queue was full); otherwise the newcomer is refused. So under
  contention every tenant can hold an equal part of the queue, and only the tenants over it lose
  requests.
- **Order, by least use.** The scheduler asks for the next job with each tenant's use now (the
  KV positions its running and prefilling requests reserve, ``kv_admission.kv_need``). The head of
  the tenant using least goes first; between equals, the oldest head. A tenant's requests keep
  their own order. Use is KV rather than a count of rows, so a tenant whose few requests hold
  the whole KV budget goes last until they end, and one that sends long prompts gets the share
  its requests' size says, no more.

Jobs are identified by identity; a job is in at most one tenant's FIFO, at most once.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar


class QueueFull(Exception):
    """The scheduler holds ``max_queued`` waiting requests already, and this tenant holds its
    part of them."""


class HasTenant(Protocol):
    @property
    def tenant(self) -> str: ...


J = TypeVar("J", bound=HasTenant)


class TenantQueues(Generic[J]):
    """Waiting jobs, one FIFO per tenant, at most ``bound`` in all."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._fifo: dict[str, deque[tuple[int, J]]] = {}  # tenant -> (arrival, job), oldest first
        self._arrivals = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[J]:
        """Every waiting job, in arrival order."""
        entries = sorted((e for q in self._fifo.values() for e in q), key=lambda e: e[0])
        return (job for _arrival, job in entries)

    def waiting(self, tenant: str) -> int:
        q = self._fifo.get(tenant)
        return len(q) if q else 0

    def push(self, job: J) -> J | None:
        """Queue ``job`` at the back of its tenant's FIFO. Returns the job it displaced (the
        newest of the largest holder's, now out of the queue: the caller refuses it as busy), or
        None; raises QueueFull when the newcomer is refused instead."""
        displaced: J | None = None
        if self._size >= self.bound:
            largest = max(self._fifo, key=lambda t: (len(self._fifo[t]), self._fifo[t][-1][0]),
                          default=None)
            if largest is None or self.waiting(job.tenant) + 1 >= len(self._fifo[largest]):
                raise QueueFull(f"server busy: {self.bound} requests already queued")
            displaced = self._fifo[largest].pop()[1]
            self._dropped(largest)
        self._fifo.setdefault(job.tenant, deque()).append((next(self._arrivals), job))
        self._size += 1
        return displaced

    def next(self, use: Mapping[str, int]) -> J | None:
        """The job to admit next, given each tenant's ``use`` now (absent: 0), left queued:
        the head of the tenant using least, the oldest head between equals."""
        if not self._fifo:
            return None
        tenant = min(self._fifo, key=lambda t: (use.get(t, 0), self._fifo[t][0][0]))
        return self._fifo[tenant][0][1]

    def take(self, job: J) -> None:
        """Remove ``job``, which :meth:`next` just returned."""
        q = self._fifo[job.tenant]
        if not q or q[0][1] is not job:
            raise ValueError("take() must be given the job next() returned")
        q.popleft()
        self._dropped(job.tenant)

    def remove_if(self, doomed: Callable[[J], bool]) -> list[J]:
        """Take out every waiting job for which ``doomed`` holds; returns them, oldest first."""
        gone: list[tuple[int, J]] = []
        for tenant in list(self._fifo):
            kept: deque[tuple[int, J]] = deque()
            for entry in self._fifo[tenant]:
                (gone if doomed(entry[1]) else kept).append(entry)
            self._fifo[tenant] = kept
            if not kept:
                del self._fifo[tenant]
        self._size -= len(gone)
        return [job for _arrival, job in sorted(gone, key=lambda e: e[0])]

    def clear(self) -> list[J]:
        """Empty the room; returns what waited, in arrival order."""
        jobs = list(self)
        self._fifo.clear()
        self._size = 0
        return jobs

    def _dropped(self, tenant: str) -> None:
        """One job of ``tenant`` left its FIFO."""
        self._size -= 1
        if not self._fifo[tenant]:
            del self._fifo[tenant]
