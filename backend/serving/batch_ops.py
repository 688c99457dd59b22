"""Rows joining and leaving a running batch: the KV-cache bookkeeping of continuous batching.

A ``DecodeBatch`` holds its rows' keys and values in segments (``backend.serving.kv_segments``):
merging two batches puts the second's segments after the first's, so a join moves no KV unless
two neighbouring segments have to become one. Keeping some rows drops, in each segment, the
left columns that became padding for every row it keeps: the running batch's rows stay in
their segments' buffers (those after a row that left move up, the scheduler's ``reuse``), any
other caller's rows are copied into one new segment. ``backend.serving.engine`` calls these
under its lock."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from backend.serving.engine_types import DecodeBatch, KvSegment
from backend.serving.kv_arena import KvTraffic, compacted, picked, room_for
from backend.serving.kv_segments import coalesced, gathered
from backend.serving.lora_ops import SlotBatch


def merged(a: DecodeBatch, b: DecodeBatch, device: torch.device,
           traffic: KvTraffic | None = None) -> DecodeBatch:
    """One batch holding the rows of both: ``b``'s segments follow ``a``'s, no KV moves
    (``backend.serving.kv_segments``), unless the segments pass their limit and two
    neighbours are merged. The narrower mask is left-padded to match."""
    wa, wb = a.mask.shape[1], b.mask.shape[1]
    width = max(wa, wb)

    def pad_mask(m: torch.Tensor, w: int) -> torch.Tensor:
        return m if w == width else F.pad(m, (width - w, 0))

    seqs = a.seqs + b.seqs
    if traffic is not None:
        traffic.joins += 1
    return DecodeBatch(
        seqs,
        coalesced([*a.segments, *b.segments], seqs, traffic=traffic),
        torch.cat([pad_mask(a.mask, wa), pad_mask(b.mask, wb)]),
        torch.cat([a.last_pos, b.last_pos]),
        torch.cat([a.logits, b.logits]),
        SlotBatch.from_slots([s.slot for s in seqs], device),
    )


def selected(batch: DecodeBatch, keep: list[int], device: torch.device,
             traffic: KvTraffic | None = None, *, reuse: bool = False) -> DecodeBatch:
    """The batch with only rows ``keep`` (in that order). ``reuse``: the caller gives ``batch``
    up, so rows kept in order stay in their segments' buffers (``kv_arena.compacted``; a
    segment with no row kept is dropped) instead of moving to a new one."""
    if keep == list(range(len(batch))):
        return batch
    idx = torch.tensor(keep, dtype=torch.long, device=device)
    mask = batch.mask.index_select(0, idx)
    lengths = [int(n) for n in mask.sum(dim=1).tolist()]  # each kept row's valid columns
    seqs = [batch.seqs[i] for i in keep]
    if traffic is not None:
        traffic.leaves += 1
    if reuse and keep == sorted(keep):
        segments = _kept_in_place(batch, keep, lengths, traffic)
    else:
        room = room_for(seqs)
        segments = [gathered(batch.spans(), keep, lengths, room, traffic)] if keep else []
    width = max((seg.width for seg in segments), default=0)
    return DecodeBatch(seqs, segments, mask[:, mask.shape[1] - width:],
                       batch.last_pos.index_select(0, idx), batch.logits.index_select(0, idx),
                       SlotBatch.from_slots([s.slot for s in seqs], device))


def _kept_in_place(batch: DecodeBatch, keep: list[int], lengths: list[int],
                   traffic: KvTraffic | None) -> list[KvSegment]:
    """Each segment with only its rows in ``keep`` (ascending), in its own buffers where it has
    room to be written into, and without the left columns that became padding for all of
    them."""
    out = []
    length_of = dict(zip(keep, lengths, strict=True))
    for first, end, seg in batch.spans():
        local = [i - first for i in keep if first <= i < end]
        if not local:
            continue  # every row left: the buffers go with the segment
        drop = seg.width - max(length_of[first + i] for i in local)
        if local == list(range(seg.rows)) and drop == 0:
            out.append(seg)
        elif seg.capacity:
            out.append(KvSegment([compacted(k, local, drop, traffic) for k in seg.keys],
                                 [compacted(v, local, drop, traffic) for v in seg.values],
                                 seg.capacity - drop))
        else:  # a compact segment (a prefix-cache entry's) is never written into
            idx = torch.tensor(local, dtype=torch.long, device=seg.keys[0].device)
            out.append(KvSegment([picked(k, idx, drop, 0, traffic) for k in seg.keys],
                                 [picked(v, idx, drop, 0, traffic) for v in seg.values], 0))
    return out


def cache_tensors(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values ([batch, kv_heads, width, head_dim]) of a filled cache."""
    layers: list[Any] = list(cache.layers)
    return [layer.keys for layer in layers], [layer.values for layer in layers]
