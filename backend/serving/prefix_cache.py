"""A prompt (prefix) cache: the KV cache and first-token logits of a prompt already run.

Every entry is keyed by the base, adapter and tokenizer digests and the prompt's token ids. The
adapter part is the digest from the verified ticket, never an alias: when an alias moves, its
tickets name the new digest, so the old adapter's entries cannot answer them. Two adapters with the
same prompt have different keys. Revoking a digest purges its entries.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class PrefixKey:
    """What a cached prompt result depends on; equal keys must give equal results."""

    base: str
    adapter: str | None  # None: the bare base model
    tokenizer: str
    token_ids: tuple[int, ...]


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    entries: int = 0
    bytes: int = 0


class PrefixCache(Generic[V]):
    """LRU over a byte budget; thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[PrefixKey, tuple[V, int]] = OrderedDict()
        self.stats = PrefixStats()

    def get(self, key: PrefixKey) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return item[0]

    def put(self, key: PrefixKey, value: V, nbytes: int) -> None:
        """Insert (or replace) an entry; evict least recently used ones to fit the budget."""
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.stats.bytes -= old[1]
            while self._items and self.stats.bytes + nbytes > self.max_bytes:
                _, (_, n) = self._items.popitem(last=False)
                self.stats.bytes -= n
            self._items[key] = (value, nbytes)
            self.stats.bytes += nbytes
            self.stats.entries = len(self._items)

    def purge_adapter(self, adapter: str) -> int:
        """Drop every entry of one adapter digest; return how many."""
        with self._lock:
            doomed = [k for k in self._items if k.adapter == adapter]
            for k in doomed:
                self.stats.bytes -= self._items.pop(k)[1]
            self.stats.entries = len(self._items)
            return len(doomed)

    def values(self) -> list[V]:
        """Every cached value, least recently used first (memory accounting)."""
        with self._lock:
            return [v for v, _n in self._items.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
