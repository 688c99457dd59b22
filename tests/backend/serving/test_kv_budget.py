"""Admission by KV positions as well as by count (issue 26): a burst larger than the budget
queues and runs in turns, the running batch's KV never passes the budget (read from the batch's
own tensors after every step, not from the scheduler's accounting), every request still gets
its answer, and a request that alone needs more than the budget is refused at once with a clear
message instead of waiting forever.

Before: admission counted rows only, so a burst of long requests was decoded at once, however
much KV it needed (an out-of-memory in a step fails every live row)."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.serving.engine import Engine, GenerationRequest
from backend.serving.kv_admission import kv_need
from backend.serving.memory import KV_HEADROOM_FRACTION, AdapterBudget, plan_memory
from backend.serving.scheduler import OverKVBudget, QueueFull, Scheduler, SchedulerLimits
from tests.backend.serving.test_scheduler import Sink

PROMPT = "The quick brown fox jumps"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(kit_dir: Path) -> Engine:
    return Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=16,
                  max_adapters=2)


def _kv_positions(sched: Scheduler) -> int:
    """Positions the running batch's KV tensors hold now: rows x width, from layer 0."""
    batch = sched.running_batch()
    if batch is None:
        return 0
    return sum(seg.rows * seg.width for seg in batch.segments)


def test_a_burst_over_the_budget_queues_and_every_request_is_answered(engine: Engine) -> None:
    one = engine.open_sequence(GenerationRequest(PROMPT, None, max_tokens=MAX_TOKENS))
    need = kv_need(one)
    engine.close_sequence(one)
    budget = 3 * need  # three such rows at once, not eight
    sched = Scheduler(engine, SchedulerLimits(max_running=32, max_queued=64,
                                              max_kv_tokens=budget), start=False)
    sinks = [Sink() for _ in range(8)]
    for sink in sinks:
        sched.submit(engine.open_sequence(GenerationRequest(PROMPT, None,
                                                            max_tokens=MAX_TOKENS)), sink)
    most_running, widest = 0, 0
    while sched.run_once():
        running, _queued = sched.load()
        most_running = max(most_running, running)
        widest = max(widest, _kv_positions(sched))
        assert sched.kv_reserved() <= budget
    assert widest <= budget, f"the batch held {widest} KV positions over a budget of {budget}"
    assert most_running == 3  # the budget, not the count, bounded the batch
    assert sched.kv_waits > 0
    assert [s.outcome for s in sinks] == ["ok"] * 8
    assert len({tuple(s.result.token_ids) for s in sinks if s.result}) == 1  # same greedy rows


def test_a_request_larger_than_the_whole_budget_is_refused_at_once(engine: Engine) -> None:
    sched = Scheduler(engine, SchedulerLimits(max_running=4, max_kv_tokens=16), start=False)
    seq = engine.open_sequence(GenerationRequest(PROMPT, None, max_tokens=64))
    with pytest.raises(OverKVBudget, match="KV positions, more than this host's budget of 16"):
        sched.submit(seq, Sink())
    assert isinstance(OverKVBudget("x"), QueueFull)  # callers that only know "busy" still cope
    engine.close_sequence(seq)
    assert sched.load() == (0, 0)


def test_the_memory_plan_reserves_kv_after_weights_banks_and_headroom(engine: Engine) -> None:
    plan = engine.plan
    device = 64 * 2**30
    p = plan_memory(plan.shapes, max_rank=plan.max_rank, element_size=plan.element_size,
                    budget=AdapterBudget(adapter_bytes=2**30, max_slots=8), device_bytes=device)
    weights = plan.shapes.weight_count() * plan.element_size
    left = device - weights - p.bank_bytes - int(KV_HEADROOM_FRACTION * device)
    assert p.kv_tokens == left // (2 * p.kv_token_bytes)  # old and new KV at a step's peak
    assert p.kv_token_bytes == 2 * plan.shapes.layers * plan.shapes.kv_heads \
        * plan.shapes.head_dim * plan.element_size
    assert f"{p.kv_tokens:,} positions" in p.describe()


def _held_positions(sched: Scheduler) -> int:
    """Positions the running batch's layer-0 key buffers hold, their room and any rows that left
    in place included: what the engine allocated, not what the accounting says."""
    batch = sched.running_batch()
    if batch is None:
        return 0
    return sum(seg.keys[0].untyped_storage().nbytes()
               // (seg.keys[0].shape[1] * seg.keys[0].shape[3] * seg.keys[0].element_size())
               for seg in batch.segments)


def test_a_short_row_joining_a_long_one_takes_only_its_own_shape(engine: Engine) -> None:
    """Rows that join are a KV segment of their own (``backend.serving.kv_segments``): a short
    prompt with many tokens joining a long prompt with few holds its own width plus its own
    tokens, not the long width plus the many tokens on both rows. Before, one buffer padded to
    the longest held twice the budget here, so admission had to make the short row wait for the
    long one; now both shapes fit the budget together and run at once."""
    long = GenerationRequest("word " * 24, None, max_tokens=4)  # 121 tokens with bos
    a = engine.open_sequence(long)
    b = engine.open_sequence(GenerationRequest("Hi", None, max_tokens=kv_need(a) - 3))
    assert kv_need(a) == kv_need(b)
    budget = 2 * kv_need(a)  # both rows, each its own shape
    sched = Scheduler(engine, SchedulerLimits(max_running=4, max_kv_tokens=budget),
                      start=False)
    sinks = [Sink(), Sink()]
    sched.submit(a, sinks[0])
    sched.run_once()
    sched.submit(b, sinks[1])
    held, together = 0, 0
    while sched.run_once():
        held = max(held, _held_positions(sched))
        together = max(together, sched.load()[0])
        assert sched.kv_reserved() <= budget
    assert held <= budget, f"the KV buffers held {held} positions over a budget of {budget}"
    assert sched.kv_waits == 0 and together == 2  # the short row did not wait
    assert [s.outcome for s in sinks] == ["ok", "ok"]


def test_merged_segments_stay_within_the_budget(engine: Engine) -> None:
    """Rows arriving one at a time each make a segment; past the limit two neighbours are
    merged into one buffer padded to the wider. Whatever the shapes, the buffers the engine
    holds (read from the tensors) never pass the budget admission counted against."""
    shapes = [("word " * 20, 3), ("Hi", 40), ("The cat sat", 9), ("word " * 8, 20),
              ("A", 30), ("word " * 14, 6), ("Once upon a time", 12), ("Yes", 25)]
    needs = []
    for prompt, n in shapes:
        seq = engine.open_sequence(GenerationRequest(prompt, None, max_tokens=n))
        needs.append(kv_need(seq))
        engine.close_sequence(seq)
    budget = sum(needs) // 2
    sched = Scheduler(engine, SchedulerLimits(max_running=8, max_kv_tokens=budget),
                      start=False)
    sinks = [Sink() for _ in shapes]
    held, most_segments = 0, 0
    for (prompt, n), sink in zip(shapes, sinks, strict=True):
        sched.submit(engine.open_sequence(GenerationRequest(prompt, None, max_tokens=n)), sink)
        sched.run_once()
        held = max(held, _held_positions(sched))
    while sched.run_once():
        held = max(held, _held_positions(sched))
        batch = sched.running_batch()
        most_segments = max(most_segments, len(batch.segments) if batch else 0)
        assert sched.kv_reserved() <= budget
    assert held <= budget, f"the KV buffers held {held} positions over a budget of {budget}"
    assert most_segments > 1
    assert [s.outcome for s in sinks] == ["ok"] * len(shapes)
