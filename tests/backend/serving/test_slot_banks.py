"""The slot banks as one buffer (``backend.serving.slots.SlotBanks``): each module's A and B views
cover their own part of every slot, one slot's region holds all its modules' weights and nothing
of any other slot, clearing a slot zeroes exactly that region, and the weight fingerprint sees a
change anywhere in it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from backend.serving.fingerprint import BankFingerprints
from backend.serving.slots import SlotBanks

dims_st = st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(dims=dims_st, rank=st.integers(1, 4), slots=st.integers(2, 5), data=st.data())
def test_views_tile_each_slot_and_clear_touches_one_slot(dims: list[tuple[int, int]], rank: int,
                                                          slots: int, data: st.DataObject) -> None:
    banks = SlotBanks(dims, slots, rank, torch.float32, torch.device("cpu"))
    views = [banks.views(i) for i in range(len(dims))]
    for (i, o), (a, b) in zip(dims, views, strict=True):
        assert a.shape == (slots, rank, i) and b.shape == (slots, o, rank)
        assert a[0].is_contiguous() and b[0].is_contiguous()  # what the LoRA kernels read
    # writing a distinct value through every view of every slot fills each element once
    n = 0
    for s in range(slots):
        for a, b in views:
            for t in (a[s], b[s]):
                t.copy_(torch.arange(n, n + t.numel(), dtype=torch.float32).view_as(t))
                n += t.numel()
    assert n == banks.flat.numel()
    assert torch.equal(banks.flat.flatten().sort().values, torch.arange(n, dtype=torch.float32))
    # one slot's region is its own modules' weights, and clearing it zeroes nothing else
    slot = data.draw(st.integers(0, slots - 1))
    mine = torch.cat([t[slot].flatten() for a, b in views for t in (a, b)])
    assert torch.equal(banks.region(slot), mine)
    before = banks.flat.clone()
    banks.clear(slot)
    assert not banks.region(slot).any()
    others = [s for s in range(slots) if s != slot]
    assert torch.equal(banks.flat[others], before[others])


@settings(max_examples=60, deadline=None)
@given(dims=dims_st, rank=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data())
def test_the_fingerprint_sees_a_change_anywhere_in_the_slot(dims: list[tuple[int, int]],
                                                            rank: int, dtype: torch.dtype,
                                                            data: st.DataObject) -> None:
    banks = SlotBanks(dims, 3, rank, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    banks.flat[1] = torch.randn(banks.flat.shape[1], generator=g).to(dtype)
    prints = BankFingerprints(banks, 3, torch.device("cpu"))
    prints.record(1)
    assert prints.changed([1]) == []
    where = data.draw(st.integers(0, banks.flat.shape[1] - 1))
    was = banks.flat[1, where].clone()
    banks.flat[1, where] += 1.0
    assert prints.changed([1]) == [1]
    banks.flat[1, where] = was  # the same weights again: the same sums
    assert prints.changed([1]) == []


def test_a_check_on_more_threads_sums_what_a_one_thread_placement_summed() -> None:
    """Placement sums on a load worker with one thread, checks on the serving thread with all
    of them: the sums must not depend on how the reduction is split."""
    banks = SlotBanks([(512, 512)] * 8, 3, 16, torch.float32, torch.device("cpu"))
    banks.flat[1].normal_(generator=torch.Generator().manual_seed(1))
    prints = BankFingerprints(banks, 3, torch.device("cpu"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        prints.record(1)
        torch.set_num_threads(max(2, threads))
        assert prints.changed([1]) == []
    finally:
        torch.set_num_threads(threads)


def test_summing_a_slot_allocates_nothing_the_size_of_the_slot() -> None:
    """The fingerprint reads the banks where they are. Summing in float64 cast the whole slot to
    a fresh float64 copy first, on every placement, and on a host with slow page faults those
    fresh pages were most of a cold load's time (``backend.serving.fingerprint``)."""
    banks = SlotBanks([(512, 512)] * 8, 3, 16, torch.float32, torch.device("cpu"))
    banks.flat[1].normal_(generator=torch.Generator().manual_seed(2))
    prints = BankFingerprints(banks, 3, torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        prints.record(1)
        prints.changed([1])
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    slot_bytes = banks.region(1).numel() * banks.flat.element_size()
    assert largest < slot_bytes // 64, (largest, slot_bytes)
