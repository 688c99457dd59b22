"""The scheduler's use of the prefix cache: which new prompts it restores, and which computed
prompts it keeps (``backend.serving.prefix_cache`` holds the entries)."""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Sequence_

import torch

from backend.serving.engine import DecodeBatch, Sequence
from backend.serving.lora_ops import SlotBatch
from backend.serving.prefix_cache import PrefixCache, PrefixKey


def cached_entries(cache: PrefixCache[DecodeBatch] | None,
                   keys: Sequence_[PrefixKey | None]) -> dict[int, DecodeBatch]:
    """Index of each key in ``keys`` -> its entry, for the keys the cache holds."""
    if cache is None:
        return {}
    hits: dict[int, DecodeBatch] = {}
    for i, key in enumerate(keys):
        if key is not None:
            found = cache.get(key)
            if found is not None:
                hits[i] = found
    return hits


def remember(cache: PrefixCache[DecodeBatch] | None,
             rows: Sequence_[tuple[Sequence, PrefixKey | None]], batch: DecodeBatch,
             skip: Collection[int] = ()) -> None:
    """Keep the prompts of ``batch``'s rows (``rows[i]`` is row i's sequence and key), each as a
    compact one-row entry of its own, when it was computed with its key's own adapter; rows
    ``skip`` came from the cache and are not stored again.

    A row's entry is one copy of its own columns (the batch is left-padded: they are the columns
    from its first unmasked one on). Taking the row out as a batch of its own first, as before,
    copied it twice, and counted as a leave of the running batch."""
    if cache is None:
        return
    for i, (seq, key) in enumerate(rows):
        if key is None or i in skip or seq.mismatched or not seq.observed:
            continue  # only a prompt computed with the key's own adapter is remembered
        logits = batch.logits[i:i + 1]
        if not bool(torch.isfinite(logits).all()):
            continue  # a row that will fail alone is no prompt to remember
        first = int(batch.mask[i].nonzero()[0])
        top, _end, seg = next(s for s in batch.spans() if s[0] <= i < s[1])
        # the row's columns in its segment, which is right-aligned with the batch's mask
        row, col = i - top, first - (batch.mask.shape[1] - seg.width)

        def own(t: torch.Tensor, row: int = row, col: int = col) -> torch.Tensor:
            return t[row:row + 1, :, col:].clone(memory_format=torch.contiguous_format)

        keys, values = [own(k) for k in seg.keys], [own(v) for v in seg.values]
        entry = DecodeBatch.one([], keys, values, batch.mask[i:i + 1, first:].clone(),
                                batch.last_pos[i:i + 1].clone(), logits.clone(),
                                SlotBatch.from_slots([seq.slot], logits.device),
                                observed=frozenset(seq.observed))
        cache.put(key, entry, sum(t.numel() * t.element_size() for t in keys + values))
