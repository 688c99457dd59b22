"""The running batch's KV in segments: rows that joined together keep their own buffers.

Before, the running batch held every row's keys and values in one buffer per layer, left-padded
to the longest row: one 2,048-token prompt among 31 short rows made every short row's buffer
2,048 positions wide (``bench engine``'s ``peak_kv_vs_live_kv`` 13.3), and every join copied
the whole running batch into a new, wider buffer (issue 26).

Here a batch's rows are cut into segments of consecutive rows (``DecodeBatch.segments``), each
with its own buffers, padded only to its own widest row, with room for its own rows' tokens
(``backend.serving.kv_arena``). Rows joining become a segment of their own: a join moves no KV.
A decode step writes each segment's new column into that segment's room
(:class:`SegmentedLayer`), and attention runs per segment over the segment's own buffers
(``backend.serving.row_runs``): a row attends over exactly the columns it had before.

Each segment costs an attention call per layer and step, so a batch keeps at most
:data:`MOST_SEGMENTS`: a join past that merges the two neighbouring segments whose merged
buffer is smallest (:func:`coalesced`), one copy of those two segments' rows only. Rows that
leave stay in their segment's buffer (the rows after them move up, ``kv_arena.compacted``); a
segment none of whose rows is left is dropped with its buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from backend.serving.engine_types import KvSegment
from backend.serving.engine_types import Sequence as Row
from backend.serving.kv_arena import ArenaLayer, KvTraffic, room_for, stacked

MOST_SEGMENTS = 4


@dataclass(frozen=True)
class SegmentViews:
    """One layer's keys (or values) of a segmented batch, as a decode step's attention reads
    them: each segment's rows ``[first, end)`` and its view ``[rows, kv_heads, width, dim]``."""

    parts: tuple[tuple[int, int, torch.Tensor], ...]

    def part_of(self, first: int, end: int) -> tuple[int, torch.Tensor]:
        """The segment holding rows ``[first, end)`` (never split by a run): its first row
        and its view."""
        for f, e, t in self.parts:
            if f <= first and end <= e:
                return f, t
        raise ValueError(f"rows [{first}, {end}) cross a segment boundary")


class SegmentedLayer(DynamicLayer):
    """One layer's cache over a segmented batch: an update writes each segment's rows of the
    new position into that segment's buffer (:class:`ArenaLayer`) and returns
    :class:`SegmentViews` instead of one tensor."""

    def __init__(self, parts: Sequence[tuple[int, int, ArenaLayer]]) -> None:
        super().__init__()
        self.parts = list(parts)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[Any, Any]:
        keys, values = [], []
        for first, end, layer in self.parts:
            k, v = layer.update(key_states[first:end], value_states[first:end])
            keys.append((first, end, k))
            values.append((first, end, v))
        return SegmentViews(tuple(keys)), SegmentViews(tuple(values))

    def get_seq_length(self) -> int:
        # the batch's mask is as wide as its widest segment (what the model builds masks for)
        return max(layer.keys.shape[2] for _f, _e, layer in self.parts
                   if layer.keys is not None)


def decode_layers(segments: Sequence[KvSegment], seqs: Sequence[Row], layers: int,
                  traffic: KvTraffic | None) -> list[DynamicLayer]:
    """A decode step's cache layers over ``segments``: plain arena layers for one segment (its
    attention takes plain tensors), segmented ones for several. Each segment reserves room for
    its own rows' tokens only."""
    arenas: list[list[ArenaLayer]] = []
    bounds: list[tuple[int, int]] = []
    first = 0
    for seg in segments:
        room = room_for(seqs[first:first + seg.rows])
        arenas.append([ArenaLayer(k, v, seg.capacity, room, traffic)
                       for k, v in zip(seg.keys, seg.values, strict=True)])
        bounds.append((first, first + seg.rows))
        first += seg.rows
    if len(segments) == 1:
        return list(arenas[0])
    return [SegmentedLayer([(f, e, arenas[s][i]) for s, (f, e) in enumerate(bounds)])
            for i in range(layers)]


def written_back(segments: Sequence[KvSegment], layers: Sequence[DynamicLayer]
                 ) -> list[KvSegment]:
    """The segments after a decode step through ``layers``: new objects, never changed in
    place, because a segment may be shared (a prefix-cache entry's, a batch given up)."""
    out = []
    for s in range(len(segments)):
        arenas: list[ArenaLayer] = [
            layer.parts[s][2] if isinstance(layer, SegmentedLayer) else layer  # type: ignore[misc]
            for layer in layers]
        keys, values = [a.keys for a in arenas], [a.values for a in arenas]
        assert all(k is not None for k in keys) and all(v is not None for v in values)
        out.append(KvSegment(keys, values, arenas[0].capacity))  # type: ignore[arg-type]
    return out


def coalesced(segments: list[KvSegment], seqs: Sequence[Row], *, most: int = MOST_SEGMENTS,
              traffic: KvTraffic | None = None) -> list[KvSegment]:
    """``segments`` cut to at most ``most``: while there are more, the two neighbours whose
    merged buffer (rows x (widest + most tokens left)) is smallest become one, copied once into
    a buffer with room for their rows' tokens. Neighbours only, so rows keep their order."""
    segments = list(segments)
    while len(segments) > most:
        firsts = [0]
        for seg in segments:
            firsts.append(firsts[-1] + seg.rows)
        rooms = [room_for(seqs[firsts[i]:firsts[i + 2]]) for i in range(len(segments) - 1)]
        sizes = [(a.rows + b.rows) * (max(a.width, b.width) + room)
                 for (a, b), room in zip(pairwise(segments), rooms, strict=True)]
        i = min(range(len(sizes)), key=sizes.__getitem__)
        a, b = segments[i], segments[i + 1]
        width, room = max(a.width, b.width), rooms[i]
        segments[i:i + 2] = [KvSegment(
            [stacked([x, y], width, room, traffic) for x, y in zip(a.keys, b.keys, strict=True)],
            [stacked([x, y], width, room, traffic)
             for x, y in zip(a.values, b.values, strict=True)],
            width + room)]
    return segments


def gathered(spans: Sequence[tuple[int, int, KvSegment]], keep: Sequence[int],
             lengths: Sequence[int], room: int, traffic: KvTraffic | None = None) -> KvSegment:
    """Rows ``keep`` (batch rows, in that order) of the segments ``spans`` in one new segment,
    each row's rightmost ``lengths[j]`` columns (its valid ones) right-aligned, zeros left of
    them, with ``room`` more positions."""
    width = max(lengths)
    # each kept row's segment and its row in it, looked up once for every layer
    where = [(seg, row - first) for row in keep
             for first, end, seg in spans if first <= row < end]

    def one(pick: Any) -> list[torch.Tensor]:
        out_layers = []
        for layer in range(len(spans[0][2].keys)):
            like = pick(spans[0][2])[layer]
            _r, h, _w, d = like.shape
            out = like.new_zeros((len(keep), h, width + room, d))[:, :, :width]
            for j, ((seg, r), n) in enumerate(zip(where, lengths, strict=True)):
                if n:
                    out[j, :, width - n:].copy_(pick(seg)[layer][r, :, -n:])
            if traffic is not None:
                traffic.written += out.nbytes
            out_layers.append(out)
        return out_layers

    return KvSegment(one(lambda s: s.keys), one(lambda s: s.values), width + room)
