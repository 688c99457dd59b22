"""Where one engine's memory goes, by category: for the metrics and for the GPU check.

Each category is counted from the live tensors that hold it, by storage: a storage shared by
several tensors or views counts once, in the first category of :data:`MEMORY_CATEGORIES` that
reaches it, so the categories add up to what the tensors really occupy.

- ``base_weights``: the base model's parameters and buffers;
- ``adapter_banks``: the slot banks of every target module, every slot, resident or empty (they
  are allocated in full when the engine starts, see ``backend.serving.memory``);
- ``gathered``: the per-row copies of A and B the gather path made for the running batch (up to
  one slot's bytes per row, kept while the batch's rows stay the same);
- ``kv_cache``: keys and values of the running batch;
- ``prefix_cache``: everything the prefix cache's entries hold (keys, values, mask, positions,
  first-token logits);
- ``workspace``: the running batch's other tensors (mask, positions, logits, slot indices).

Activations live only inside one forward pass and are not counted: the report describes the
engine between steps. On CUDA the sum is comparable with ``torch.cuda.memory_allocated()`` for a
process whose only tensors on that device are the engine's; what the allocator reserves beyond
that (``memory_reserved() - memory_allocated()``) is cached, not allocated, and not a category.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from backend.serving.engine import DecodeBatch, Engine
from backend.serving.prefix_cache import PrefixCache
from backend.serving.scheduler import Scheduler

MEMORY_CATEGORIES = ("base_weights", "adapter_banks", "gathered", "kv_cache", "prefix_cache",
                     "workspace")


def resident_memory(engine: Engine, scheduler: Scheduler | None = None,
                    prefix_cache: PrefixCache[DecodeBatch] | None = None) -> dict[str, int]:
    """Bytes by category (every key of :data:`MEMORY_CATEGORIES`) held right now by ``engine``,
    the batch ``scheduler`` is running and the entries of ``prefix_cache``."""
    counter = _StorageCounter()
    counter.add("base_weights", engine.base_tensors())
    counter.add("adapter_banks", engine.bank_tensors())
    running = scheduler.running_batch() if scheduler is not None else None
    if running is not None:
        counter.add("gathered", [t for pair in dict(running.slots.gathered).values()
                                 for t in pair])
        counter.add("kv_cache", running.kv_tensors())
        counter.add("workspace", _bookkeeping(running))
    if scheduler is not None:
        counter.add("kv_cache", scheduler.prefill_tensors())
    if prefix_cache is not None and prefix_cache.tracks_storages:
        # kept by the cache as entries come and go: O(what was counted above), not O(entries)
        counter.totals["prefix_cache"] += prefix_cache.held_bytes(excluding=counter.seen)
    elif prefix_cache is not None:
        for entry in prefix_cache.values():
            counter.add("prefix_cache", entry_tensors(entry))
    return counter.totals


def entry_tensors(entry: DecodeBatch) -> list[torch.Tensor]:
    """Every tensor a prefix-cache entry holds."""
    return [*entry.keys, *entry.values, *_bookkeeping(entry)]


def entry_footprint(entry: DecodeBatch) -> list[tuple[tuple[str, int], int]]:
    """(storage identity, bytes) of each tensor a prefix-cache entry holds, the identity as
    :class:`_StorageCounter` keys it (``PrefixCache``'s ``footprint``)."""
    return [(_key(t), t.untyped_storage().nbytes()) for t in entry_tensors(entry)]


def _key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _bookkeeping(batch: DecodeBatch) -> list[torch.Tensor]:
    """A batch's tensors other than its KV and gathered copies."""
    rows = [r for _slot, r in batch.slots.segments]
    return [batch.mask, batch.last_pos, batch.logits, batch.slots.slots, *rows]


class _StorageCounter:
    """Bytes per category, each storage counted once."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self.seen: set[tuple[str, int]] = set()

    def add(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            key = _key(t)
            if key in self.seen:
                continue
            self.seen.add(key)
            self.totals[category] += t.untyped_storage().nbytes()
