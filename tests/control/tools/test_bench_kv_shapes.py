"""``bench engine``'s padding figures (``control.tools.bench.kv_shapes``) on the test kit, scaled
down: real streams through a real scheduler, one long row among short ones. The held/live count
is checked against the engine's own buffers; speed is reported by the bench, not asserted."""

from __future__ import annotations

from pathlib import Path

from control.tools.bench.kv_shapes import padding_costs
from tests.faults import EndlessEngine


def test_a_long_row_among_short_ones_holds_only_what_the_rows_need(kit_dir: Path) -> None:
    engine = EndlessEngine(kit_dir / "base", kit_dir / "tokenizer", device="cpu")
    prompts = ["ab", "cd", "ef"]  # 3 tokens each with bos; the long row has 200
    report = padding_costs(engine, prompts, 8, 1, long_tokens=200, rows=4)
    c = engine.base_config
    position = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # fp32
    # live at the peak: three short rows and the long one, each with its prompt and 8 tokens
    # at most (the last step samples before its token: 7)
    assert report["kv_peak_live_bytes_mixed"] <= (3 * (3 + 8) + 200 + 8) * position
    assert report["kv_peak_live_bytes_mixed"] >= (3 * 3 + 200) * position
    # held: the long row is a KV segment of its own (backend.serving.kv_segments), so the short
    # rows are not padded to its width; what is held is what the rows' tokens need, within a
    # tenth. (One buffer padded to the longest row held four rows x 200 and more: over 3x live.)
    assert report["kv_peak_held_bytes_mixed"] >= report["kv_peak_live_bytes_mixed"]
    assert report["kv_peak_held_bytes_mixed"] < 2 * 200 * position
    assert report["peak_kv_vs_live_kv"] == (report["kv_peak_held_bytes_mixed"]
                                            / report["kv_peak_live_bytes_mixed"]) <= 1.1
    assert report["decode_tokens_per_s_uniform"] > 0 and report["decode_tokens_per_s_mixed"] > 0
    assert report["mixed_lengths_vs_uniform"] == (report["decode_tokens_per_s_mixed"]
                                                  / report["decode_tokens_per_s_uniform"])
    assert engine.pins() == {}
