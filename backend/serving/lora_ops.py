"""The two ways to add per-row LoRA deltas to a base projection, and the selector between them.

Both read the same stacked slot tensors (see ``backend.serving.slots``), in PEFT's layouts:
``a [slots, rank, in]`` and ``b [slots, out, rank]`` with the adapter's scaling folded into ``b``,
read transposed by the matmuls (a view, no copy); slot 0 is all zero.

- ``segment``: one dense matmul pair per distinct adapter in the batch, over that adapter's rows.
  Cheapest when a batch holds few adapters (the rows of one adapter share one weight read).
- ``gather`` (bgmv-like): gather every row's A and B once per batch composition, then two batched
  matmuls for the whole batch. Cost does not grow with the number of distinct adapters, so it wins
  when many adapters share a batch. The gathered weights are kept on the ``SlotBatch`` so decode
  steps with the same rows do not gather again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# At or below this many distinct adapters in a batch, the segment path runs.
SEGMENT_MAX_ADAPTERS = 4


@dataclass
class SlotBatch:
    """Which slot each row of the current forward pass uses, and how the delta is computed."""

    slots: torch.Tensor  # [batch] long, slot per row (0 = the all-zero base slot)
    segments: tuple[tuple[int, torch.Tensor], ...]  # (slot, rows [n] long) per adapter slot > 0
    path: str  # "none" | "segment" | "gather"
    # module id -> (a [batch, rank, in], b [batch, out, rank]) gathered for this composition
    gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def from_slots(cls, slots: list[int], device: torch.device,
                   segment_max: int | None = None) -> SlotBatch:
        """Group rows by slot and choose the path by the number of distinct adapters."""
        if segment_max is None:
            segment_max = SEGMENT_MAX_ADAPTERS  # read at call time: tests force either path
        if any(s < 0 for s in slots):
            # Negative indices would wrap around to a real adapter's slot.
            raise ValueError("slot indices must be >= 0")
        distinct = sorted(set(s for s in slots if s > 0))
        segments = tuple(
            (s, torch.tensor([i for i, x in enumerate(slots) if x == s], dtype=torch.long,
                             device=device))
            for s in distinct
        )
        path = "none" if not distinct else "segment" if len(distinct) <= segment_max else "gather"
        return cls(torch.tensor(slots, dtype=torch.long, device=device), segments, path)


def apply_segment(
    out: torch.Tensor,  # [batch, seq, out], updated in place
    x: torch.Tensor,  # [batch, seq, in]
    a: torch.Tensor,  # [slots, rank, in]
    b: torch.Tensor,  # [slots, out, rank]
    segments: tuple[tuple[int, torch.Tensor], ...],
) -> None:
    """Add ``x[rows] @ A[s]^T @ B[s]^T`` for each adapter slot ``s`` over its rows."""
    for slot, rows in segments:
        xs = x.index_select(0, rows).to(a.dtype)  # [n, seq, in]
        delta = torch.matmul(torch.matmul(xs, a[slot].t()), b[slot].t())  # [n, seq, out]
        out.index_add_(0, rows, delta.to(out.dtype))


def apply_gather(
    out: torch.Tensor,  # [batch, seq, out], updated in place
    x: torch.Tensor,  # [batch, seq, in]
    ga: torch.Tensor,  # [batch, rank, in], gathered per row
    gb: torch.Tensor,  # [batch, out, rank], gathered per row
) -> None:
    """Add every row's delta with two batched matmuls (base rows gather the zero slot)."""
    h = torch.bmm(x.to(ga.dtype), ga.transpose(1, 2))  # [batch, seq, rank]
    out.add_(torch.bmm(h, gb.transpose(1, 2)).to(out.dtype))
