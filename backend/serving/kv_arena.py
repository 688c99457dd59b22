"""KV storage that a decode step writes into in place: the running batch's keys and values are
views of per-layer buffers with room for the tokens its rows may still produce.

Before, each decode step wrapped the batch's tensors in a fresh ``DynamicCache``, whose update
concatenates every layer's keys and values with the new token's: a copy of the whole KV per
token, with the old and new tensors alive together (issue 26). Here a layer's keys are
``buffer[:, :, :width]`` of a buffer ``[batch, kv_heads, capacity, head_dim]``; a step writes
only its new column into ``buffer[:, :, width]`` and the view grows by one. Attention reads the
view, so it sees exactly the columns it saw before and the results are unchanged.

The batch records its buffers' capacity (``DecodeBatch.kv_capacity``). A prefill writes its
prompts' columns straight into buffers with room (:meth:`ArenaLayer.empty`); a batch made
anywhere else (a prefix-cache entry) records 0 and is never written into: the first step after it
copies the rows once into a buffer with room. Capacity is carried, never inferred
from a tensor's strides, because a slice such as ``t[:, :, first:]`` has the strides of a buffer
with room while its "room" is the next head's columns. Room is the most tokens any row may still
produce (:func:`room_for`), so a batch whose rows stay the same never moves its KV. (An earlier
cap, the longest row's prompt plus max_tokens, was wrong for rows that joined wider ones: they
end further right than their own length says, and ran out of room once before finishing.)

The running batch is cut into segments, each with buffers of its own
(``backend.serving.kv_segments``): rows joining become a segment, so a join moves no KV unless
two segments are merged. Rows leaving stay in their segment's buffer: the rows kept after a row
that left move up over it (:func:`compacted`), so a leave allocates nothing, and when the
oldest rows leave (or the newest) it moves nothing. Within a segment rows are left-padded to its
longest; paged storage (blocks per row) is not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


@dataclass
class KvTraffic:
    """What the engine wrote into KV buffers (``Engine.kv_traffic``; ``bench engine`` reports
    ``written / computed`` as ``kv_bytes_copied_per_token``): ``computed``, the bytes of keys and
    values the model computed (prompt and decode tokens), each written once where it lands;
    ``written``, those plus every byte a join, a leave or a step out of room moved or padded.
    Plain counters, added to under the engine's lock."""

    computed: int = 0
    written: int = 0
    joins: int = 0  # merges of new rows into a batch
    leaves: int = 0  # rows leaving a batch, copied or moved up in place

    def copied_per_computed(self) -> float:
        return self.written / self.computed if self.computed else 0.0


def room_for(seqs: Sequence[Any]) -> int:
    """Positions to reserve beyond ``width`` for rows ``seqs``: the most tokens any row may still
    produce (``max_tokens`` minus what it produced), at least 1.

    Every row ends at the right edge, so the row with the most tokens left decides how far the
    batch grows: a row that joined wider rows is left-padded to their width, and its prompt's
    length says nothing about where it ends."""
    return max(1, max((s.request.max_tokens - len(s.produced) for s in seqs), default=1))


def empty_room(like: torch.Tensor, rows: int, width: int, room: int) -> torch.Tensor:
    """A view ``[rows, heads, width, head_dim]`` of a new buffer with ``room`` more positions;
    its contents are undefined: callers fill every column of the view."""
    _b, h, _w, d = like.shape
    buffer = like.new_empty((rows, h, width + room, d))
    return buffer[:, :, :width]


def stacked(parts: Sequence[torch.Tensor], width: int, room: int,
            traffic: KvTraffic | None = None) -> torch.Tensor:
    """``parts`` (each [rows_i, heads, w_i, head_dim], w_i <= width) one above the other, each
    left-padded with zeros to ``width``, in a new buffer with ``room``. Padding is zeros, not
    left undefined: a masked column still meets its value in ``softmax(...) @ V``, and 0 x NaN
    would be NaN."""
    rows = sum(p.shape[0] for p in parts)
    out = empty_room(parts[0], rows, width, room)
    r = 0
    for p in parts:
        n, w = p.shape[0], p.shape[2]
        if w < width:
            out[r:r + n, :, :width - w].zero_()
        out[r:r + n, :, width - w:].copy_(p)
        r += n
    if traffic is not None:
        traffic.written += out.nbytes
    return out


def picked(t: torch.Tensor, idx: torch.Tensor, first: int, room: int,
           traffic: KvTraffic | None = None) -> torch.Tensor:
    """Rows ``idx`` of ``t`` from column ``first`` on, in a new buffer with ``room``."""
    src = t[:, :, first:]
    out = empty_room(t, idx.numel(), src.shape[2], room)
    torch.index_select(src, 0, idx, out=out)
    if traffic is not None:
        traffic.written += out.nbytes
    return out


def compacted(t: torch.Tensor, keep: Sequence[int], first: int,
              traffic: KvTraffic | None = None) -> torch.Tensor:
    """Rows ``keep`` (ascending) of ``t`` within the same buffer, seen from column ``first`` on: a
    leave that allocates nothing. The rows kept stay from the first of them on, and only those
    after a row that left move up, each once: when the oldest rows leave, or the newest, nothing
    moves. The caller gives up ``t``: its rows are overwritten."""
    cols, base = t[:, :, first:], keep[0]  # the columns before ``first`` are dropped
    for j, i in enumerate(keep):
        # Ascending, so row ``base + j`` is free when row ``i`` (>= it) moves into it: either it
        # left, or it was kept and has already moved up.
        if i != base + j:
            cols[base + j].copy_(cols[i])
            if traffic is not None:
                traffic.written += cols[i].nbytes
    return cols[base:base + len(keep)]


class ArenaLayer(DynamicLayer):
    """One layer's cache over a batch's KV: an update writes the new positions into the buffer's
    room (moving the columns to a bigger buffer only when there is none left) and returns views.

    ``capacity``: positions the buffer under ``keys`` and ``values`` holds (their width when they
    are not views this module made); ``room``: what to reserve when it must move them.
    """

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None, capacity: int,
                 room: int, traffic: KvTraffic | None = None) -> None:
        super().__init__()
        self.room, self.capacity, self.traffic = room, capacity, traffic
        if keys is not None and values is not None:
            self.keys, self.values = keys, values
            self.capacity = max(capacity, keys.shape[2])
            self.device = keys.device
            self.is_initialized = True

    @classmethod
    def empty(cls, room: int, traffic: KvTraffic | None = None) -> ArenaLayer:
        """A prefill's layer: its first update writes the prompts' columns straight into a
        buffer with ``room`` more (so the decode steps after it need not move them)."""
        return cls(None, None, 0, room, traffic)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:
            rows, n = key_states.shape[0], key_states.shape[2]
            self.keys = empty_room(key_states, rows, 0, n + self.room)
            self.values = empty_room(value_states, rows, 0, n + self.room)
            self.capacity, self.device, self.is_initialized = n + self.room, key_states.device, True
        width, n = self.keys.shape[2], key_states.shape[2]
        if width + n > self.capacity:
            # No room: one copy into a buffer with room for the rest of the rows' tokens.
            room = max(self.room, n)
            self.keys = stacked([self.keys], width, room, self.traffic)
            self.values = stacked([self.values], width, room, self.traffic)
            self.capacity = width + room
        self.keys = _extended(self.keys, width + n)
        self.values = _extended(self.values, width + n)
        self.keys[:, :, width:].copy_(key_states)
        self.values[:, :, width:].copy_(value_states)
        if self.traffic is not None:
            new = key_states.nbytes + value_states.nbytes
            self.traffic.computed += new
            self.traffic.written += new
        return self.keys, self.values


def _extended(view: torch.Tensor, width: int) -> torch.Tensor:
    """The same buffer seen ``width`` positions wide (within its capacity)."""
    b, h, _w, d = view.shape
    return view.as_strided((b, h, width, d), view.stride(), view.storage_offset())
