"""Which queued sequences may join the running batch now: by count, and by the KV the engine's
buffers will hold.

A row's KV grows to its prompt plus every token it may make (:func:`kv_need`). What the engine
holds is more, and admission counts that:

- **Segments, padding and room.** The running batch's KV is in segments
  (``backend.serving.kv_segments``): rows prefilled together are one segment, left-padded to its
  own longest row, with room for the most tokens any of its rows may still make
  (``backend.serving.kv_arena``). A join of new rows allocates rows x (their longest + their
  most left) (:func:`_join`) beside the buffers the batch holds, and moves nothing.
- **Leaves keep the buffer.** Rows that leave stay in their segment's buffer
  (``kv_arena.compacted``) until every row of the segment has left (``KvHeld.batch``, read from
  the buffers themselves).
- **Chunked prompts have their own buffer** (``backend.serving.chunked_prefill``): prompt plus
  max_tokens each, which becomes their segment when they join.
- **Merged segments.** A batch keeps at most ``MOST_SEGMENTS``; a join past that merges
  neighbours into one buffer of at most rows x (longest + most left) of their rows. Merged
  segments hold disjoint rows, so together they hold at most :func:`_join` over all the rows:
  when a merge may happen, that much more is counted.

So the most the buffers can hold before the live rows end (:func:`reserved`) is what the
batch's buffers hold, plus the new rows' join, plus every chunked prompt's buffer, plus the
merge allowance when the segments may pass their limit. The scheduler admits in the order the
waiting room gives (the head of the tenant whose live requests reserve least,
``backend.serving.tenant_queues``) while that stays within the budget
(``SchedulerLimits.max_kv_tokens``, from the memory plan); the job named next that does not fit
waits, and nothing overtakes it, so a long request is never starved by short ones. The copies a
merge or a prefill holds for a moment are not counted here: the memory plan's KV reserve is
twice the budget for them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol, TypeVar

from backend.serving.engine_types import DecodeBatch, Sequence
from backend.serving.kv_segments import MOST_SEGMENTS
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

    batch: int = 0  # positions the running batch's buffers hold (rows that left in place too)
    segments: int = 0  # the running batch's KV segments

    @classmethod
    def of(cls, batch: DecodeBatch | None) -> KvHeld:
        """Read from the running batch's own buffers (layer 0's keys: every layer's is alike)."""
        if batch is None or not batch.segments:
            return cls()
        positions = 0
        for seg in batch.segments:
            k = seg.keys[0]
            positions += k.untyped_storage().nbytes() // (k.shape[1] * k.shape[3]
                                                           * k.element_size())
        return cls(positions, len(batch.segments))


def _extent(seq: Sequence) -> Extent:
    produced = len(seq.produced)
    # at least 1: the room a buffer keeps is
    return len(seq.prompt_ids) + produced, max(1, seq.request.max_tokens - produced)


def _join(rows: Seq[Extent]) -> int:
    """Positions a join of ``rows`` allocates: rows x (the longest now + the most left)."""
    if not rows:
        return 0
    return len(rows) * (max(n for n, _ in rows) + max(left for _, left in rows))


def _most_held(running: list[Extent], new: list[Extent], chunked: list[Extent],
               held: KvHeld) -> int:
    """The most the buffers hold until the rows end (see the module notes): ``running``, the
    batch's rows; ``new``, rows prefilled to join it now; ``chunked``, prompts prefilled in
    chunks, each joining as a segment of its own."""
    worst = held.batch + _join(new) + sum(n + left for n, left in chunked)
    # each new row may come as a segment of its own (a prefix-cache entry), each chunked one
    if held.segments + len(new) + len(chunked) > MOST_SEGMENTS:
        worst += _join([*running, *new, *chunked])
    return worst


def reserved(running: Seq[HasSequence], chunked: Seq[HasSequence] = (),
             held: KvHeld = KvHeld()) -> int:
    """The most KV positions the buffers of ``running`` (the batch's rows) and ``chunked``
    (prompts prefilled in chunks, oldest first) hold until those rows end."""
    return _most_held([_extent(j.seq) for j in running], [], [_extent(j.seq) for j in chunked],
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
    new: list[Extent] = []
    pending = [_extent(j.seq) for j in chunked]
    use: Counter[str] = Counter()
    for j in (*running, *chunked):
        use[j.tenant] += kv_need(j.seq)
    admitted: list[J] = []
    while len(admitted) < room and (job := queue.next(use)) is not None:
        if budget is not None:
            head = job.seq
            more = ([*new, _extent(head)], pending) if not will_chunk(head) else \
                (new, [*pending, _extent(head)])
            if _most_held(batch, *more, held) > budget:
                return admitted, True
            new, pending = more
        queue.take(job)
        use[job.tenant] += kv_need(job.seq)
        admitted.append(job)
    return admitted, False
