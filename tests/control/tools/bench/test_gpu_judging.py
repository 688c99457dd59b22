"""How the GPU check judges what it measures on a GPU, checked on the CPU with given numbers: the
per-dtype logit bounds, memory accounting beyond the weights, the continuous-batching share of
the measured batch speedup, and a batch's peak memory against the memory plan."""

from __future__ import annotations

import pytest
import torch

from backend.serving.memory import AdapterBudget, BaseShapes, plan_memory
from control.tools.bench import gpu_check
from control.tools.bench.gpu_check import Greedy, compare, logit_rtol
from control.tools.bench.gpu_perf import SCHEDULER_SHARE, Status, judge_memory, judge_share
from control.tools.bench.gpu_shapes import peak_against_plan

GIB = 2**30


def test_the_logit_bound_is_per_dtype_and_grows_with_depth() -> None:
    assert logit_rtol(torch.float32, 2) == 2.0**-18
    assert logit_rtol(torch.bfloat16, 2) == 2.0**-6
    assert logit_rtol(torch.float16, 2) == 2.0**-9
    assert logit_rtol(torch.bfloat16, 32) == pytest.approx(2.0**-6 * 4)
    assert logit_rtol(torch.float32, 32) < 1e-4  # 8B depth: float32 stays tight


def _parting(gap: float) -> tuple[Greedy, Greedy]:
    """Two greedy rows parting at their first token, the two candidates ``gap`` apart, the
    largest logit 10."""
    logits = torch.zeros(4)
    logits[0], logits[1], logits[3] = 5.0, 5.0 - gap, 10.0
    flipped = logits.clone()
    flipped[0], flipped[1] = 5.0 - gap, 5.0
    return Greedy([0], [logits]), Greedy([1], [flipped])


def test_a_parting_that_bf16_calls_a_near_tie_is_a_failure_in_float32() -> None:
    ours, theirs = _parting(gap=1e-3)  # 1e-4 of the largest logit
    bf16 = compare(0, ours, theirs, logit_rtol(torch.bfloat16, 2))
    fp32 = compare(0, ours, theirs, logit_rtol(torch.float32, 2))
    assert bf16 is not None and bf16["tie"] is True
    assert fp32 is not None and fp32["tie"] is False
    # the old bound, 2^-5 for every dtype, excused a gap 3000 times float32's
    assert compare(0, ours, theirs, 2.0**-5)["tie"] is True  # type: ignore[index]
    assert gpu_check.BASE_RTOL[torch.float32] < 2.0**-5 / 3000


CATEGORIES = {"base_weights": 16 * GIB, "adapter_banks": 2 * GIB, "gathered": 0,
              "kv_cache": 2 * GIB, "prefix_cache": 0, "workspace": 0}


def test_memory_counted_right_passes() -> None:
    out = judge_memory(CATEGORIES, allocated=20 * GIB)
    assert out["status"] == Status.PASS
    assert out["counted_over_allocated_beyond_weights"] == pytest.approx(1.0)


def test_a_kv_miscount_hidden_by_the_weights_fails() -> None:
    """Half the KV not counted: 1 GiB of 20 is within 5 % of the total, but half of what is
    beyond the weights is missing."""
    missed = {**CATEGORIES, "kv_cache": 1 * GIB}
    out = judge_memory(missed, allocated=20 * GIB)
    assert out["counted_over_allocated"] == pytest.approx(0.95)  # what alone passed before
    assert out["counted_over_allocated_beyond_weights"] == pytest.approx(0.75)
    assert out["status"] == Status.FAIL


@pytest.mark.parametrize(("share", "complete", "judged", "status"), [
    (SCHEDULER_SHARE, True, True, Status.PASS),
    (SCHEDULER_SHARE - 0.01, True, True, Status.FAIL),
    (0.1, True, False, Status.MEASURED),
    (1.0, False, False, Status.FAIL),
])
def test_continuous_batching_is_judged_on_its_share_of_the_batch_speedup(
        share: float, complete: bool, judged: bool, status: Status) -> None:
    assert judge_share(share, complete, judged) == status


def test_a_peak_beyond_the_plans_kv_is_over_the_plan() -> None:
    shapes = BaseShapes(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128,
                        layers=32, vocab=128256)
    plan = plan_memory(shapes, max_rank=64, element_size=2, budget=AdapterBudget(),
                       device_bytes=140 * GIB, slots=4)
    tokens = 8 * 4112
    weights = shapes.weight_count() * 2
    kv = tokens * plan.kv_token_bytes
    assert kv == tokens * 128 * 1024  # 128 KiB a token at 8B's shape in bf16
    within = peak_against_plan(plan, tokens, weights + plan.bank_bytes + 2 * kv, 140 * GIB)
    assert within["peak_over_plan"] < 1
    assert within["peak_beyond_weights_and_banks_over_live_kv"] == pytest.approx(2.0)
    # one byte past what the plan allows: over it
    over = peak_against_plan(plan, tokens, within["planned_bytes"] + 1, 140 * GIB)
    assert over["peak_over_plan"] > 1
