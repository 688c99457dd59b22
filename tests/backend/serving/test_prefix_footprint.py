"""The prefix cache's storage footprint (``PrefixCache(footprint=...)``): the bytes its entries
hold, each storage once, kept as entries come (put, replacing an entry under its key) and go
(LRU eviction, purge of an adapter), must always equal a count made afresh over every entry,
however entries share storages. The memory report reads it instead of walking the entries
(tests/backend/serving/test_memory_report.py checks the report both ways on a real engine).

Before: there was no footprint; the report walked every entry's tensors after every finished
batch, a third of the engine process's time once the cache was full (issue 24)."""

from __future__ import annotations

import pytest
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from backend.serving.prefix_cache import PrefixCache, PrefixKey

# An entry is the storages it holds: (storage id, bytes). Ids repeat across entries (shared
# storages) and within one (two views of one storage).
STORAGES = {i: 16 * (i + 1) for i in range(12)}
Entry = tuple[tuple[int, int], ...]


def footprint(entry: Entry) -> Entry:
    return entry


def recount(cache: PrefixCache[Entry], excluding: set[int]) -> int:
    held = {sid: n for entry in cache.values() for sid, n in entry}
    return sum(n for sid, n in held.items() if sid not in excluding)


def key(i: int, adapter: str | None) -> PrefixKey:
    return PrefixKey("base", adapter, "tok", (i,), salt=b"s")


class FootprintMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # a budget of a few entries' nbytes, so that puts evict
        self.cache: PrefixCache[Entry] = PrefixCache(300, footprint=footprint)

    @rule(i=st.integers(0, 9), adapter=st.sampled_from([None, "a", "b"]),
          ids=st.lists(st.sampled_from(sorted(STORAGES)), min_size=1, max_size=5),
          nbytes=st.integers(1, 320))
    def put(self, i: int, adapter: str | None, ids: list[int], nbytes: int) -> None:
        self.cache.put(key(i, adapter), tuple((s, STORAGES[s]) for s in ids), nbytes)

    @rule(adapter=st.sampled_from(["a", "b"]))
    def purge(self, adapter: str) -> None:
        self.cache.purge_adapter(adapter)

    @invariant()
    def held_bytes_equal_a_fresh_count(self) -> None:
        assert self.cache.held_bytes() == recount(self.cache, set())
        for excluded in ({0}, {1, 5, 11}, set(STORAGES)):
            assert self.cache.held_bytes(excluding=excluded) == recount(self.cache, excluded)


TestFootprint = FootprintMachine.TestCase
TestFootprint.settings = hsettings(max_examples=150, stateful_step_count=30, deadline=None)


def test_an_empty_cache_holds_nothing_and_a_cache_without_footprint_says_so() -> None:
    cache: PrefixCache[Entry] = PrefixCache(100, footprint=footprint)
    assert cache.held_bytes() == 0
    cache.put(key(1, "a"), ((3, 64), (3, 64)), 10)  # one storage, two views: counted once
    assert cache.held_bytes() == 64
    cache.purge_adapter("a")
    assert cache.held_bytes() == 0
    plain: PrefixCache[Entry] = PrefixCache(100)
    assert not plain.tracks_storages
    with pytest.raises(RuntimeError, match="footprint"):
        plain.held_bytes()
