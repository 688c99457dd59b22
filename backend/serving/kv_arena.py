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
produce, capped by the longest row's need (:func:`room_for`), so a batch whose rows stay the same
copies its KV at most once more, and usually never.

Rows joining (``merged``) and leaving (``selected``) are written straight into a buffer with room
(one copy of the KV per join or leave, as before, but none per token). Rows are still left-padded
to the batch's longest; paged storage that moves no KV on joins and leaves is not built yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

# Room is rounded up to a multiple of this many positions (fewer distinct buffer shapes for the
# allocator to cache).
BLOCK = 16


def room_for(seqs: Sequence[Any], width: int) -> int:
    """Positions to reserve beyond ``width`` for rows ``seqs``: the most tokens any row may still
    produce (``max_tokens`` minus what it produced), rounded up to :data:`BLOCK`, but no more
    than takes the width to the longest row's prompt plus max_tokens (at least 1).

    The cap keeps the peak within what the memory plan budgets: while the buffers move (a join,
    a leave, a step that ran out of room) the old ``width`` and the new ``width + room`` are alive
    together, at most twice the longest row's need (``backend.serving.kv_admission.kv_need``).
    """
    most = max((max(s.request.max_tokens - len(s.produced), 0) for s in seqs), default=1)
    rounded = -(-max(most, 1) // BLOCK) * BLOCK
    longest = max((len(s.prompt_ids) + s.request.max_tokens for s in seqs), default=0)
    return max(1, min(rounded, longest - width))


def empty_room(like: torch.Tensor, rows: int, width: int, room: int) -> torch.Tensor:
    """A view ``[rows, heads, width, head_dim]`` of a new buffer with ``room`` more positions;
    its contents are undefined: callers fill every column of the view."""
    _b, h, _w, d = like.shape
    buffer = like.new_empty((rows, h, width + room, d))
    return buffer[:, :, :width]


def stacked(parts: Sequence[torch.Tensor], width: int, room: int) -> torch.Tensor:
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
    return out


def picked(t: torch.Tensor, idx: torch.Tensor, first: int, room: int) -> torch.Tensor:
    """Rows ``idx`` of ``t`` from column ``first`` on, in a new buffer with ``room``."""
    src = t[:, :, first:]
    out = empty_room(t, idx.numel(), src.shape[2], room)
    torch.index_select(src, 0, idx, out=out)
    return out


class ArenaLayer(DynamicLayer):
    """One layer's cache over a batch's KV: an update writes the new positions into the buffer's
    room (moving the columns to a bigger buffer only when there is none left) and returns views.

    ``capacity``: positions the buffer under ``keys`` and ``values`` holds (their width when they
    are not views this module made); ``room``: what to reserve when it must move them.
    """

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None, capacity: int,
                 room: int) -> None:
        super().__init__()
        self.room, self.capacity = room, capacity
        if keys is not None and values is not None:
            self.keys, self.values = keys, values
            self.capacity = max(capacity, keys.shape[2])
            self.device = keys.device
            self.is_initialized = True

    @classmethod
    def empty(cls, room: int) -> ArenaLayer:
        """A prefill's layer: its first update writes the prompts' columns straight into a
        buffer with ``room`` more (so the decode steps after it need not move them)."""
        return cls(None, None, 0, room)

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
            self.keys = stacked([self.keys], width, room)
            self.values = stacked([self.values], width, room)
            self.capacity = width + room
        self.keys = _extended(self.keys, width + n)
        self.values = _extended(self.values, width + n)
        self.keys[:, :, width:].copy_(key_states)
        self.values[:, :, width:].copy_(value_states)
        return self.keys, self.values


def _extended(view: torch.Tensor, width: int) -> torch.Tensor:
    """The same buffer seen ``width`` positions wide (within its capacity)."""
    b, h, _w, d = view.shape
    return view.as_strided((b, h, width, d), view.stride(), view.storage_offset())
