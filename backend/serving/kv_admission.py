"""Which queued sequences may join the running batch now: by count, and by the KV the engine's
buffers will hold.

A row's KV grows to its prompt plus every token it may make (:func:`kv_need`). What the engine
holds is more, and admission counts that:

- **Padding and room.** Rows are left-padded to the longest row, and when rows join, every layer's
  buffer is made with room for the most tokens any row may still make
  (``backend.serving.kv_arena``): a join allocates rows x (the longest row now + the most tokens
  any row has left) (:func:`_join`). A short prompt with many tokens to make joining a long
  prompt with few holds the long width plus the many tokens on both rows: up to twice what
  rows x the longest need (the count before) said.
- **Leaves keep the buffer.** Rows that leave the running batch stay in its buffer
  (``kv_arena.compacted``), so it holds what its last join allocated until the next join
  (``KvHeld.batch``, read from the buffer itself).
- **Chunked prompts have their own buffer** (``backend.serving.chunked_prefill``): prompt plus
  max_tokens each, beside the running batch's until they join it, oldest first.

So the most the buffers can hold before the live rows end (:func:`reserved`) is the larger of
the batch's buffer plus every chunked prompt's, and, after the k-th chunked prompt has joined,
the join over the batch's rows and those k plus the chunked prompts still to come. A row's now +
left is its need, which does not change, so a later join of the same rows allocates no more than
this counts. The scheduler admits in the order the waiting room gives (the head of the tenant
whose live requests reserve least, ``backend.serving.tenant_queues``) while that stays within
the budget (``SchedulerLimits.max_kv_tokens``, from the memory plan); the job named next that
does not fit waits, and nothing overtakes it, so a long request is never starved by short
ones. The copies a join or a prefill holds for a moment are not counted here: the memory plan's
KV reserve is twice the budget for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol, TypeVar

from backend.serving.engine_types import DecodeBatch, Sequence
from backend.serving.tenant_queues import TenantQueues


class HasSequence(Protocol):
    @property
    def seq(self) -> Sequence: ...

    @property
    def tenant(self) -> str: ...


J = TypeVar("J", bound=HasSequence)

Extent = tuple[int, int]  # (KV positions a row has now, positions it may still add)


def kv_need(seq: Sequence) -> int:
    """KV positions ``seq`` reaches at its end: its prompt plus every token it may make."""
    return len(seq.prompt_ids) + seq.request.max_tokens


@dataclass(frozen=True)
class KvHeld:
    """What the engine holds now that the rows' extents do not say."""

    batch: int = 0  # positions the running batch's buffer holds (rows that left in place too)

    @classmethod
    def of(cls, batch: DecodeBatch | None) -> KvHeld:
        """Read from the running batch's own buffer (layer 0's keys: every layer's is alike)."""
        if batch is None or not batch.keys:
            return cls()
        k = batch.keys[0]
        return cls(k.untyped_storage().nbytes() // (k.shape[1] * k.shape[3] * k.element_size()))


def _extent(seq: Sequence) -> Extent:
    produced = len(seq.produced)
    # at least 1: the room a buffer keeps is
    return len(seq.prompt_ids) + produced, max(1, seq.request.max_tokens - produced)


def _join(rows: Seq[Extent]) -> int:
    """Positions a join of ``rows`` allocates: rows x (the longest now + the most left)."""
    if not rows:
        return 0
    return len(rows) * (max(n for n, _ in rows) + max(left for _, left in rows))


def _most_held(batch: list[Extent], chunked: list[Extent], held: KvHeld) -> int:
    """The most the buffers hold until the rows end (see the module notes)."""
    waiting = sum(n + left for n, left in chunked)  # each chunked prompt's own buffer
    worst = max(held.batch, _join(batch)) + waiting
    joined = list(batch)
    for n, left in chunked:  # they join one at a time, oldest first
        joined.append((n, left))
        waiting -= n + left
        worst = max(worst, _join(joined) + waiting)
    return worst


def reserved(running: Seq[HasSequence], chunked: Seq[HasSequence] = (),
             held: KvHeld = KvHeld()) -> int:
    """The most KV positions the buffers of ``running`` (the batch's rows) and ``chunked``
    (prompts prefilled in chunks, oldest first) hold until those rows end."""
    return _most_held([_extent(j.seq) for j in running], [_extent(j.seq) for j in chunked],
                      held)


def over_budget(seq: Sequence, budget: int | None) -> str | None:
    """Why ``seq`` alone can never run under ``budget``, or None when it can."""
    if budget is None or kv_need(seq) <= budget:
        return None
    return (f"the prompt ({len(seq.prompt_ids)} tokens) plus max_tokens "
            f"({seq.request.max_tokens}) need {kv_need(seq)} KV positions, more than this "
            f"host's budget of {budget}: send a shorter prompt or fewer max_tokens")


def admit(queue: TenantQueues[J], running: Seq[J], max_running: int, budget: int | None, *,
          chunked: Seq[J] = (), held: KvHeld = KvHeld(),
          will_chunk: Callable[[Sequence], bool] = lambda _seq: False,
          ) -> tuple[list[J], bool]:
    """Take from ``queue`` what may join now, beside the batch's rows ``running`` and the
    prompts ``chunked`` being prefilled in chunks (``will_chunk``: whether a queued sequence's
    prompt will be), in the order ``queue.next`` gives for each tenant's reserved KV; returns
    the admitted jobs and whether the job named next waited for KV room."""
    room = max_running - len(running) - len(chunked)
    batch = [_extent(j.seq) for j in running]
    pending = [_extent(j.seq) for j in chunked]
    use: Counter[str] = Counter()
    for j in (*running, *chunked):
        use[j.tenant] += kv_need(j.seq)
    admitted: list[J] = []
    while len(admitted) < room and (job := queue.next(use)) is not None:
        if budget is not None:
            head = job.seq
            more = ([*batch, _extent(head)], pending) if not will_chunk(head) else \
                (batch, [*pending, _extent(head)])
            if _most_held(*more, held) > budget:
                return admitted, True
            batch, pending = more
        queue.take(job)
        use[job.tenant] += kv_need(job.seq)
        admitted.append(job)
    return admitted, False
