"""Which long prompt gets the next chunk, and when a finished one joins the running batch.

Prompts prefilled in chunks (``backend.serving.chunked_prefill``) were computed one at a time,
oldest first: a tenant that sent five 4,000-token prompts held every other tenant's long prompt
behind all of them, for five prompts' worth of chunks. Here each turn's chunk goes to the oldest
unfinished prompt of the tenant that has had the fewest chunks while it had prompts waiting (a
tenant that starts waiting starts level with the others), so tenants' long prompts advance side
by side, and a tenant's own prompts keep their order.

The list's order is also the order in which the prompts join the running batch, and KV admission
counts on it (``backend.serving.kv_admission.reserved``: the most the buffers hold while they
join in that order). So a prompt that finishes before those ahead of it joins at once only if
``fits`` says the order with it moved to the front stays within the budget; otherwise it keeps
its buffer (counted already) and waits until it reaches the front or moving it fits. The order
only ever changes to one that fits, so what admission reserved always covers what is held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

from backend.serving.chunked_prefill import PartialPrefill
from backend.serving.engine_types import DecodeBatch
from backend.serving.tenant_queues import HasTenant

J = TypeVar("J", bound=HasTenant)


class Prefilling(Generic[J]):
    """Admitted jobs whose prompts are being prefilled in chunks, in the order they join."""

    def __init__(self) -> None:
        self._rows: list[tuple[J, PartialPrefill]] = []
        self._ready: dict[int, DecodeBatch] = {}  # id(job) -> its finished one-row batch
        self._chunks: Counter[str] = Counter()  # chunks each tenant had while it waited

    def __len__(self) -> int:
        return len(self._rows)

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __iter__(self) -> Iterator[tuple[J, PartialPrefill]]:
        return iter(list(self._rows))

    def jobs(self) -> list[J]:
        """The jobs, in the order they will join."""
        return [job for job, _part in self._rows]

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's keys and values held so far, finished prompts' included."""
        return [t for _job, part in self._rows for t in (*part.keys, *part.values)]

    def add(self, jobs: list[J], part: Callable[[J], PartialPrefill]) -> None:
        self._rows += [(j, part(j)) for j in jobs]

    def drop(self, job: J) -> None:
        """Take ``job`` out (it ended before joining)."""
        self._rows = [(j, p) for j, p in self._rows if j is not job]
        self._ready.pop(id(job), None)
        self._forget_idle()

    def clear(self) -> list[J]:
        jobs = self.jobs()
        self._rows, self._ready = [], {}
        self._chunks.clear()
        return jobs

    def next(self) -> tuple[J, PartialPrefill] | None:
        """The job to compute a chunk of now (see the module notes), counted as its tenant's;
        None when every prompt is finished."""
        waiting = [(j, p) for j, p in self._rows if id(j) not in self._ready]
        if not waiting:
            return None
        first: dict[str, tuple[J, PartialPrefill]] = {}
        for j, p in waiting:  # each tenant's oldest
            first.setdefault(j.tenant, (j, p))
        # A tenant new to the prefill starts level with the others (fair queueing's virtual
        # time), not at zero: it would otherwise take every chunk until it caught up.
        level = min(self._chunks.values(), default=0)
        for t in first:
            self._chunks.setdefault(t, level)
        tenant = min(first, key=lambda t: self._chunks[t])  # dicts keep order: oldest on ties
        self._chunks[tenant] += 1
        return first[tenant]

    def finished(self, job: J, batch: DecodeBatch) -> None:
        """``job``'s prompt is done: ``batch`` waits to join."""
        self._ready[id(job)] = batch

    def advance(self, chunk: Callable[[PartialPrefill], DecodeBatch | None]) -> None:
        """Compute one chunk (``chunk(part)``: the one-row batch once the prompt is done) of the
        job :meth:`next` names, if any."""
        picked = self.next()
        if picked is not None and (done := chunk(picked[1])) is not None:
            self.finished(picked[0], done)

    def join_next(self, fits: Callable[[list[J]], bool]) -> tuple[J, DecodeBatch] | None:
        """Take out the first finished job that may join now: the front one, or one that
        ``fits(order)`` allows at the front of the others; None when none may. One at a time:
        what ``fits`` counts changes with each join."""
        for i, (job, _part) in enumerate(self._rows):
            if id(job) not in self._ready:
                continue
            others = [j for k, (j, _p) in enumerate(self._rows) if k != i]
            if i == 0 or fits([job, *others]):
                del self._rows[i]
                self._forget_idle()
                return job, self._ready.pop(id(job))
        return None

    def _forget_idle(self) -> None:
        """A tenant with nothing left to prefill starts afresh when it sends more."""
        live = {j.tenant for j, _p in self._rows}
        for tenant in [t for t in self._chunks if t not in live]:
            del self._chunks[tenant]
