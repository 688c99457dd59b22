"""The scheduler's use of the prefix cache: which new prompts it restores, and which computed
prompts it keeps (``backend.serving.prefix_cache`` holds the entries)."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_

import torch

from backend.serving.engine import DecodeBatch, Engine, Sequence
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


def remember(cache: PrefixCache[DecodeBatch] | None, engine: Engine,
             rows: Sequence_[tuple[Sequence, PrefixKey | None]], batch: DecodeBatch) -> None:
    """Keep the prompts of ``batch``'s rows (``rows[i]`` is row i's sequence and key), each as a
    compact one-row entry of its own, when it was computed with its key's own adapter."""
    if cache is None:
        return
    for i, (seq, key) in enumerate(rows):
        if key is None or seq.mismatched or not seq.observed:
            continue  # only a prompt computed with the key's own adapter is remembered
        one = engine.retain(batch, [i])
        assert one is not None
        if not bool(torch.isfinite(one.logits).all()):
            continue  # a row that will fail alone is no prompt to remember
        keys = [k.clone(memory_format=torch.contiguous_format) for k in one.keys]
        values = [v.clone(memory_format=torch.contiguous_format) for v in one.values]
        entry = DecodeBatch([], keys, values, one.mask.clone(), one.last_pos.clone(),
                            one.logits.clone(), one.slots, observed=frozenset(seq.observed))
        cache.put(key, entry, sum(t.numel() * t.element_size() for t in keys + values))
