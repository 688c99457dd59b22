"""Which queued sequences may join the running batch now: by count, and by KV positions.

A row's KV grows to its prompt plus every token it may make (:func:`kv_need`), and rows are
padded to the longest, so the batch's KV at its peak is rows x the longest need. The scheduler
admits oldest first while that stays within the budget (``SchedulerLimits.max_kv_tokens``, from
the memory plan); a head that does not fit waits, and nothing overtakes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Protocol, TypeVar

from backend.serving.engine_types import Sequence


class HasSequence(Protocol):
    @property
    def seq(self) -> Sequence: ...


J = TypeVar("J", bound=HasSequence)


def kv_need(seq: Sequence) -> int:
    """KV positions ``seq`` reaches at its end: its prompt plus every token it may make."""
    return len(seq.prompt_ids) + seq.request.max_tokens


def reserved(running: Seq[HasSequence]) -> int:
    """KV positions the batch of ``running`` may reach at its peak."""
    return len(running) * max((kv_need(j.seq) for j in running), default=0)


def over_budget(seq: Sequence, budget: int | None) -> str | None:
    """Why ``seq`` alone can never run under ``budget``, or None when it can."""
    if budget is None or kv_need(seq) <= budget:
        return None
    return (f"the prompt ({len(seq.prompt_ids)} tokens) plus max_tokens "
            f"({seq.request.max_tokens}) need {kv_need(seq)} KV positions, more than this "
            f"host's budget of {budget}: send a shorter prompt or fewer max_tokens")


def admit(queue: deque[J], running: Seq[J], max_running: int,
          budget: int | None) -> tuple[list[J], bool]:
    """Take from the head of ``queue`` what may join ``running`` now; returns the admitted
    jobs and whether the head waited for KV room."""
    room = max_running - len(running)
    rows = len(running)
    longest = max((kv_need(j.seq) for j in running), default=0)
    admitted: list[J] = []
    while queue and len(admitted) < room:
        if budget is not None:
            wider = max(longest, kv_need(queue[0].seq))
            if (rows + 1) * wider > budget:
                return admitted, True
            rows, longest = rows + 1, wider
        admitted.append(queue.popleft())
    return admitted, False
