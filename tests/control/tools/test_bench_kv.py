"""``loraplane bench kv --quick``: both sides measured on the same tensors, the same values after
every round, and the arena allocating nothing per step while the concatenating step allocates
the whole KV each time."""

from __future__ import annotations

from control.tools.bench_kv import HEAD_DIM, KV_HEADS, LAYERS, ROWS, run_bench


def test_quick_bench_measures_both_sides_on_the_same_values() -> None:
    seen: list[str] = []
    result = run_bench(quick=True, progress=seen.append)
    assert len(seen) == len(result["widths"]) == 2
    for w in result["widths"]:
        assert w["same_values"]
        assert len(w["round_ratios"]) == result["setup"]["rounds"]
        assert w["bytes_allocated_per_step"]["arena"] == 0
        # the old step allocates keys and values of every layer at least as wide as the context
        whole = 2 * LAYERS * ROWS * KV_HEADS * w["width"] * HEAD_DIM * 4
        assert w["bytes_allocated_per_step"]["concat"] >= whole
        assert w["concat_step_s"]["median"] > 0 and w["arena_step_s"]["median"] > 0
