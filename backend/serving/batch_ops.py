"""Rows joining and leaving a running batch: the KV-cache bookkeeping of continuous batching.

A ``DecodeBatch`` holds its rows' keys and values left-padded to one width. Merging two batches
pads the narrower and writes every row once into new buffers with room for the tokens the rows
may still produce (``backend.serving.kv_arena``), so the decode steps that follow write only
their new column. Keeping some rows drops the left columns that became padding for every row
left: the running batch's rows stay in its own buffers (those after a row that left move up, the
scheduler's ``reuse``), any other caller's rows are copied into new ones.
``backend.serving.engine`` calls these under its lock.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from backend.serving.engine_types import DecodeBatch
from backend.serving.kv_arena import KvTraffic, compacted, picked, room_for, stacked
from backend.serving.lora_ops import SlotBatch


def merged(a: DecodeBatch, b: DecodeBatch, device: torch.device,
           traffic: KvTraffic | None = None) -> DecodeBatch:
    """One batch holding the rows of both; the narrower KV is left-padded to match."""
    wa, wb = a.mask.shape[1], b.mask.shape[1]
    width = max(wa, wb)

    def pad_mask(m: torch.Tensor, w: int) -> torch.Tensor:
        return m if w == width else F.pad(m, (width - w, 0))

    seqs = a.seqs + b.seqs
    room = room_for(seqs)
    if traffic is not None:
        traffic.joins += 1
    return DecodeBatch(
        seqs,
        [stacked([x, y], width, room, traffic) for x, y in zip(a.keys, b.keys, strict=True)],
        [stacked([x, y], width, room, traffic)
         for x, y in zip(a.values, b.values, strict=True)],
        torch.cat([pad_mask(a.mask, wa), pad_mask(b.mask, wb)]),
        torch.cat([a.last_pos, b.last_pos]),
        torch.cat([a.logits, b.logits]),
        SlotBatch.from_slots([s.slot for s in seqs], device),
        kv_capacity=width + room,
    )


def selected(batch: DecodeBatch, keep: list[int], device: torch.device,
             traffic: KvTraffic | None = None, *, reuse: bool = False) -> DecodeBatch:
    """The batch with only rows ``keep`` (in that order). ``reuse``: the caller gives ``batch``
    up, so rows kept in order stay in its buffers (``kv_arena.compacted``) instead of moving
    to new ones."""
    if keep == list(range(len(batch))):
        return batch
    idx = torch.tensor(keep, dtype=torch.long, device=device)
    mask = batch.mask.index_select(0, idx)
    # drop left columns that are padding for every remaining row
    used = mask.any(dim=0).nonzero()
    first = int(used[0]) if used.numel() else 0
    seqs = [batch.seqs[i] for i in keep]
    if traffic is not None:
        traffic.leaves += 1
    if reuse and batch.kv_capacity and keep == sorted(keep):
        keys = [compacted(k, keep, first, traffic) for k in batch.keys]
        values = [compacted(v, keep, first, traffic) for v in batch.values]
        capacity = batch.kv_capacity - first
    else:
        room = room_for(seqs)
        keys = [picked(k, idx, first, room, traffic) for k in batch.keys]
        values = [picked(v, idx, first, room, traffic) for v in batch.values]
        capacity = mask.shape[1] - first + room
    return DecodeBatch(seqs, keys, values, mask[:, first:], batch.last_pos.index_select(0, idx),
                       batch.logits.index_select(0, idx),
                       SlotBatch.from_slots([s.slot for s in seqs], device),
                       kv_capacity=capacity)


def cache_tensors(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values ([batch, kv_heads, width, head_dim]) of a filled cache."""
    layers: list[Any] = list(cache.layers)
    return [layer.keys for layer in layers], [layer.values for layer in layers]
