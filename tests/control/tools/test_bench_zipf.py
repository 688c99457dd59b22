"""``zipf_1000_vs_32`` at a small size: a real deployment (real tritonserver), 40 registered
adapters over 8 tenants on 8 device slots against 8 of them, two alternating rounds a side.

Checked: every request answered ok, every ok answer served by the digest its ticket was issued
for (answer, ledger row, and sampled outputs equal to PEFT's), the figures in range and derived
from what the host recorded (the warm-up's first loads read the store, later ones hit the host
tier, the large side loaded). Speed is not asserted: the bench reports it against its goal.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from control.ops.triton_server import TritonUnavailable, find_triton
from control.tools.bench_zipf import run_bench
from tests.required import unavailable

pytestmark = pytest.mark.triton

ADAPTERS, SMALL, REQUESTS = 40, 8, 64


def test_zipf_bench_serves_every_request_by_its_own_adapter(kit_dir: Path,
                                                             tmp_path: Path) -> None:
    try:
        find_triton(tmp_path / "probe")
    except TritonUnavailable as e:
        unavailable("the real tritonserver", str(e))
    r = run_bench(kit_dir, adapters=ADAPTERS, small=SMALL, slots=SMALL, clients=8,
                  requests=REQUESTS, rounds=2, samples=4, work_dir=tmp_path / "work")

    p = r["provenance"]
    assert r["provenance_ok"] and p["provenance_ok"], p
    assert p["digest_mismatches"] == p["ledger_mismatches"] == p["sample_mismatches"] == 0
    assert p["sampled"] == 4 and all(row["equal"] for row in p["rows"])
    # the random adapters answer their own way: a swap for the base would show
    assert p["sample_distinct_from_base"] == 4
    assert r["all_ok"]
    assert p["ok_answers"] == ADAPTERS + 2 * SMALL + 4 * REQUESTS  # warm-ups and rounds

    assert r["adapters"] == ADAPTERS and r["small_adapters"] == SMALL
    assert r["setup"]["order"] == ["small", "large", "large", "small"]  # ABBA
    for side in ("small", "large"):
        s = r["sides"][side]
        assert s["requests"] == s["ok"] == 2 * REQUESTS and not s["refused"]
        assert s["tokens"] > 0 and len(s["tokens_per_s"]["rounds"]) == 2
        for rate in s["hit_rate"].values():
            assert rate is None or 0.0 <= rate <= 1.0
    large = r["sides"]["large"]
    assert large["loads"] > 0 and large["waited_on_load"] > 0 and large["load_failures"] == 0
    assert large["hit_rate"]["device"] < 1.0
    assert large["loads_per_s"] > 0 and sum(large["evictions"].values()) > 0
    assert large["load_wait_s"]["p95_waiting"] > 0
    # every adapter's first load (the warm-up's) read the store; the host tier kept them all
    assert r["warmup"]["loads"] == r["warmup"]["store_loads"] == ADAPTERS
    assert r["host"]["host_tier_never_full"] and r["host"]["adapters_ever_loaded"] == ADAPTERS
    assert large["hit_rate"]["host"] == 1.0 and large["hit_rate"]["store"] == 0.0

    ratio = r["zipf_1000_vs_32"]
    assert isinstance(ratio, float) and ratio > 0 and math.isfinite(ratio)
    assert len(r["spread"]["round_ratios"]) == 2
    assert r["met"] == {"goal": ratio >= 0.9, "floor": ratio >= 0.8}
