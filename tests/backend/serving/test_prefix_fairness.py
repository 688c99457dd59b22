"""The prefix cache's budget is shared fairly between tenants (``PrefixCache``): one tenant
flooding new prompts evicts its own entries, never another's while that one holds no more than
its part; a tenant alone may use the whole budget. A state machine of three tenants putting,
reading and purging checks the rule on every insert, and the byte counts after every step."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings as hsettings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from backend.serving.prefix_cache import PrefixCache, PrefixKey, TenantSalts

SALTS = TenantSalts(b"k" * 32)
BUDGET = 1000


def _key(tenant: str, n: int, adapter: str | None = None) -> PrefixKey:
    return PrefixKey("base", adapter, "tok", (n,), salt=SALTS.of(tenant))


def test_a_flood_of_new_prompts_evicts_only_the_flooders_entries() -> None:
    cache: PrefixCache[str] = PrefixCache(BUDGET)
    for n in range(4):  # 400 bytes: under half the budget
        cache.put(_key("globex", n), f"globex {n}", 100)
    for n in range(200):
        cache.put(_key("acme", n), f"acme {n}", 100)
    assert all(cache.get(_key("globex", n)) == f"globex {n}" for n in range(4))
    assert cache.get(_key("acme", 199)) == "acme 199"  # acme keeps the rest, newest first
    assert len(cache) == 10 and cache.stats.bytes == BUDGET


def test_a_tenant_alone_uses_the_whole_budget_and_then_gives_back_its_part() -> None:
    cache: PrefixCache[str] = PrefixCache(BUDGET)
    for n in range(10):
        cache.put(_key("acme", n), "a", 100)
    assert len(cache) == 10
    for n in range(10):  # globex arrives: acme, over its half, gives way
        cache.put(_key("globex", n), "g", 100)
    held = [sum(cache.get(_key(t, n)) is not None for n in range(10)) for t in ("acme", "globex")]
    assert held == [5, 5]


TENANTS = ("acme", "globex", "initech")


class Tenants(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PrefixCache[int] = PrefixCache(BUDGET)
        self.sizes: dict[PrefixKey, int] = {}  # what the model knows was put
        self.n = 0

    def held(self) -> dict[str, int]:
        out: dict[str, int] = dict.fromkeys(TENANTS, 0)
        for key, size in self.sizes.items():
            if key in self.cache._items:
                out[next(t for t in TENANTS if SALTS.of(t) == key.salt)] += size
        return out

    @rule(tenant=st.sampled_from(TENANTS), size=st.integers(1, 400),
          adapter=st.sampled_from([None, "a1", "a2"]))
    def put(self, tenant: str, size: int, adapter: str | None) -> None:
        before = {k for k in self.sizes if k in self.cache._items}
        held = self.held()
        present = {t for t, b in held.items() if b} | {tenant}
        fair = BUDGET / len(present)
        self.n += 1
        key = _key(tenant, self.n, adapter)
        self.sizes[key] = size
        kept = self.cache.put(key, self.n, size)
        assert (self.cache.get(key) == self.n) == kept
        if not kept:  # only when the inserting tenant would be over its part
            assert held[tenant] + size > fair, (tenant, held, size, fair)
        gone = before - {k for k in self.sizes if k in self.cache._items}
        for k in gone:
            owner = next(t for t in TENANTS if SALTS.of(t) == k.salt)
            if owner != tenant:
                assert held[owner] > fair, (owner, held, fair)  # only a tenant over its part

    @rule(tenant=st.sampled_from(TENANTS))
    def read_oldest(self, tenant: str) -> None:
        mine = [k for k in self.sizes if k in self.cache._items and k.salt == SALTS.of(tenant)]
        if mine:
            assert self.cache.get(mine[0]) is not None

    @rule(adapter=st.sampled_from(["a1", "a2"]))
    def purge(self, adapter: str) -> None:
        self.cache.purge_adapter(adapter)
        assert not any(k.adapter == adapter for k in self.cache._items)

    @invariant()
    def bytes_add_up(self) -> None:
        assert self.cache.stats.bytes == sum(self.held().values()) <= BUDGET
        assert self.cache.stats.bytes == sum(self.cache._tenant_bytes.values())


def test_no_insert_evicts_a_tenant_within_its_part() -> None:
    Tenants.TestCase.settings = hsettings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
    Tenants.TestCase().runTest()
