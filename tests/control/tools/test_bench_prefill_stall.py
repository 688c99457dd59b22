"""``bench engine``'s decode-stall measurement (``control.tools.bench.prefill_stall``) on the
test kit, scaled down: real streams through a real scheduler, a long prompt arriving, chunked and
in one pass. Speed itself is not asserted (tests assert behaviour); the bench reports it."""

from __future__ import annotations

import math
from pathlib import Path

from control.tools.bench.prefill_stall import decode_stall
from tests.faults import EndlessEngine


def test_the_stall_report_measures_every_figure(kit_dir: Path) -> None:
    engine = EndlessEngine(kit_dir / "base", kit_dir / "tokenizer", device="cpu")
    prompts = ["the cat sat", "a quiet river", "on the hill"]
    report = decode_stall(engine, prompts, 1, long_tokens=160, n_streams=3, chunk=8)
    assert report["prefill_chunk"] == 8 and report["streams"] == 3
    assert report["long_prompt_tokens"] == 160
    for key in ("decode_stall_during_prefill", "decode_stall_unchunked",
                "stream_gap_p95_quiet_s", "stream_gap_p95_chunked_s",
                "stream_gap_p95_unchunked_s", "long_ttft_chunked_s", "long_ttft_unchunked_s"):
        assert math.isfinite(report[key]) and report[key] > 0, key
    assert report["decode_stall_during_prefill"] == (report["stream_gap_p95_chunked_s"]
                                                     / report["stream_gap_p95_quiet_s"])
    assert engine.pins() == {}
