"""The throughput and memory checks of ``gpu-check`` (``control.tools.bench.gpu_check``), and
the types its checks share: a check's status, a mode's profile, a forced LoRA path."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from backend.serving import lora_ops
from backend.serving.engine import DecodeBatch, Engine, GenerationRequest, GenerationResult
from backend.serving.memory_report import resident_memory
from backend.serving.prefix_cache import PrefixCache, PrefixKey
from backend.serving.scheduler import Scheduler, SchedulerLimits
from control.tools.bench.kit import (
    GOALS,
    NEW_TOKENS,
    BenchKit,
    BenchShape,
    bench_prompts,
    best_alternating,
    continuous_batching,
    count_tokens,
    meets,
)

# The memory categories must add up to what the allocator holds within this share (the issue's).
MEMORY_RTOL = 0.05
PREFIX_CACHE_BYTES = 1 << 30  # holds every prompt of the memory check at the real sizes
# The share of the engine's own batch speedup that streams through the scheduler must keep: the
# scheduler may cost a fifth, as Triton may against the in-process engine (triton_vs_inprocess).
SCHEDULER_SHARE = 0.8


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    MEASURED = "measured"  # numbers taken; the goal is judged on a GPU only
    SKIPPED = "skipped"
    NOT_AVAILABLE = "not available"


@dataclass(frozen=True)
class Profile:
    """What one mode builds and how it judges."""

    device: str
    shape: BenchShape
    adapters: int
    judged: bool  # throughput goals judged (real sizes on a GPU), else only measured
    reps: int


@contextlib.contextmanager
def forced_path(path: str) -> Iterator[None]:
    """Every batch made inside takes ``path`` ("segment" or "gather") whatever its number of
    distinct adapters (``SlotBatch.from_slots`` reads the threshold at call time)."""
    saved = lora_ops.SEGMENT_MAX_ADAPTERS
    lora_ops.SEGMENT_MAX_ADAPTERS = 0 if path == "gather" else sys.maxsize
    try:
        yield
    finally:
        lora_ops.SEGMENT_MAX_ADAPTERS = saved


# -- throughput ------------------------------------------------------------------------------

def _goal(name: str) -> str:
    op, value = GOALS[name]
    return f"{op} {value}"


def judge(name: str, ratio: float, complete: bool, judged: bool) -> Status:
    """A throughput check's status: a measurement that lost tokens fails; otherwise the ratio
    against the goal of ``name`` where ``judged``, else only measured."""
    if not complete:
        return Status.FAIL
    if not judged:
        return Status.MEASURED
    return Status.PASS if meets(name, ratio) else Status.FAIL


def check_mixed_vs_base(engine: Engine, kit: BenchKit, profile: Profile) -> dict[str, Any]:
    """The mixed batch against the base alone on the same prompts, alternated."""
    prompts = bench_prompts(len(kit.adapters))
    mixed = [GenerationRequest(p, d, max_tokens=NEW_TOKENS)
             for p, d in zip(prompts, kit.adapters, strict=True)]
    bare = [GenerationRequest(p, None, max_tokens=NEW_TOKENS) for p in prompts]
    counts: dict[str, int] = {}

    def run(name: str, requests: list[GenerationRequest]) -> Callable[[], int]:
        def once() -> int:
            results: list[GenerationResult] = engine.generate(requests)
            counts[name] = count_tokens(results)
            return counts[name]
        return once

    run("mixed", mixed[:2])()  # warm-up: first kernels, allocator pools
    best = best_alternating({"mixed": run("mixed", mixed), "base": run("base", bare)},
                            profile.reps)
    expected = len(prompts) * NEW_TOKENS  # the printable head: no row stops early
    ratio = best["mixed"] / best["base"]
    complete = counts == {"mixed": expected, "base": expected}
    return {"status": judge("mixed_vs_base", ratio, complete, profile.judged),
            "ratio": ratio, "goal": _goal("mixed_vs_base"), "goal_judged": profile.judged,
            "mixed_tokens_per_s": best["mixed"], "base_tokens_per_s": best["base"],
            "requests": len(mixed), "adapters": len(set(kit.adapters)),
            "tokens_per_run": counts, "tokens_expected": expected, "reps": profile.reps}


def judge_share(share: float, complete: bool, judged: bool) -> Status:
    """The continuous-batching check's status: lost tokens fail; otherwise the streams' share
    of the batch speedup against :data:`SCHEDULER_SHARE` where ``judged``."""
    if not complete:
        return Status.FAIL
    if not judged:
        return Status.MEASURED
    return Status.PASS if share >= SCHEDULER_SHARE else Status.FAIL


def check_continuous(engine: Engine, kit: BenchKit, profile: Profile) -> dict[str, Any]:
    """Every request as a concurrent stream against one stream alone (the scheduler), judged
    against what the same hardware gains from batching without the scheduler.

    A fixed goal (``continuous_32_vs_1 >= 6``) cannot fail on a large GPU: one row of a small
    model leaves it almost idle, so 32 rows cost about what one does. The engine's own batch
    speedup (every request as one ``generate`` batch against the first alone) is measured on
    the same device instead, and the scheduler must keep :data:`SCHEDULER_SHARE` of it: what is
    lost is the scheduler's own cost between steps (admission, sends, cancellation polls)."""
    prompts = bench_prompts(len(kit.adapters))
    requests = [GenerationRequest(p, d, max_tokens=NEW_TOKENS)
                for p, d in zip(prompts, kit.adapters, strict=True)]
    rates = continuous_batching(engine, requests, profile.reps)
    ratio = rates.many / rates.one
    counts: dict[str, int] = {}

    def batch(name: str, rows: list[GenerationRequest]) -> Callable[[], int]:
        def once() -> int:
            counts[name] = count_tokens(engine.generate(rows))
            return counts[name]
        return once

    best = best_alternating({"all": batch("all", requests), "one": batch("one", requests[:1])},
                            profile.reps)
    speedup = best["all"] / best["one"]
    share = ratio / speedup
    tokens = {"many": rates.many_tokens, "one": rates.one_tokens}
    expected = {"many": len(requests) * NEW_TOKENS, "one": NEW_TOKENS}
    complete = tokens == expected and counts == {"all": expected["many"], "one": NEW_TOKENS}
    status = judge_share(share, complete, profile.judged)
    return {"status": status, "ratio": ratio, "batch_speedup": speedup,
            "share_of_batch_speedup": share, "goal": f"share_of_batch_speedup >= "
            f"{SCHEDULER_SHARE}", "goal_judged": profile.judged,
            "fixed_goal_not_judged": _goal("continuous_32_vs_1"),
            "streams": len(requests), "many_streams_tokens_per_s": rates.many,
            "one_stream_tokens_per_s": rates.one, "batch_tokens_per_s": best,
            "tokens_per_run": tokens, "tokens_expected": expected, "reps": profile.reps}


# -- memory ----------------------------------------------------------------------------------

class _Quiet:
    """A sink that takes every token and keeps nothing."""

    def cancelled(self) -> bool:
        return False

    def token(self, piece: str) -> None:
        pass

    def finish(self, result: GenerationResult, outcome: str, reason: str | None) -> None:
        pass


def judge_memory(categories: dict[str, int], allocated: int) -> dict[str, Any]:
    """The categories' sum against what the allocator holds (``allocated``), in total and beyond
    the base weights: at the real sizes the weights are most of the total, so the total alone
    would hide a KV or workspace miscount."""
    counted = sum(categories.values())
    share = counted / allocated
    weights = categories["base_weights"]
    rest = (counted - weights) / (allocated - weights) if allocated > weights else 0.0
    ok = abs(share - 1) <= MEMORY_RTOL and abs(rest - 1) <= MEMORY_RTOL
    return {"status": Status.PASS if ok else Status.FAIL, "allocated_bytes": allocated,
            "counted_over_allocated": share, "counted_over_allocated_beyond_weights": rest}


def check_memory(engine: Engine, kit: BenchKit, allocated_before: int) -> dict[str, Any]:
    """The engine's categories with a batch of every adapter running (between two decode
    steps, driven on this thread) and its prompts in a prefix cache, against the allocator."""
    prompts = bench_prompts(len(kit.adapters))
    prefix: PrefixCache[DecodeBatch] = PrefixCache(PREFIX_CACHE_BYTES)
    sched = Scheduler(engine, SchedulerLimits(max_running=len(prompts),
                                              max_queued=len(prompts)), prefix, start=False)
    try:
        with forced_path("gather"):  # what a batch of this many adapters takes anyway
            for p, d in zip(prompts, kit.adapters, strict=True):
                seq = engine.open_sequence(GenerationRequest(p, d, max_tokens=NEW_TOKENS))
                sched.submit(seq, _Quiet(), key=PrefixKey("bench", d, "bench",
                                                          tuple(seq.prompt_ids), salt=b"bench"))
            for _ in range(3):  # prefill, then decode steps: KV, gathered copies, workspace
                sched.run_once()
        categories = resident_memory(engine, sched, prefix)
        counted = sum(categories.values())
        out: dict[str, Any] = {"categories": categories, "counted_bytes": counted,
                               "tolerance": MEMORY_RTOL}
        if engine.device.type != "cuda":
            return {"status": Status.SKIPPED,
                    "reason": "torch.cuda.memory_allocated() needs a CUDA device (on a CPU, "
                              "tests/backend/serving/test_memory_report.py counts every live "
                              "tensor instead)",
                    **out}
        torch.cuda.synchronize(engine.device)
        allocated = torch.cuda.memory_allocated(engine.device) - allocated_before
        return {**judge_memory(categories, allocated), **out}
    finally:
        sched.stop()
