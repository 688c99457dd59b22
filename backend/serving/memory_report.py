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
        counter.add("kv_cache", [*running.keys, *running.values])
        counter.add("workspace", _bookkeeping(running))
    if prefix_cache is not None:
        for entry in prefix_cache.values():
            counter.add("prefix_cache", [*entry.keys, *entry.values, *_bookkeeping(entry)])
    return counter.totals


def _bookkeeping(batch: DecodeBatch) -> list[torch.Tensor]:
    """A batch's tensors other than its KV and gathered copies."""
    rows = [r for _slot, r in batch.slots.segments]
    return [batch.mask, batch.last_pos, batch.logits, batch.slots.slots, *rows]


class _StorageCounter:
    """Bytes per category, each storage counted once."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self._seen: set[tuple[str, int]] = set()

    def add(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in self._seen:
                continue
            self._seen.add(key)
            self.totals[category] += storage.nbytes()
