"""Decode attention per run of rows over the run's own columns (backend.serving.row_runs).

The plan is checked against a brute-force optimum, and the engine's decode with runs against
each request decoded alone (a batch of one has no padding, so it never takes the runs' path):
the same tokens, and logits equal to the batch decoded over the whole width.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backend.serving.row_runs as row_runs
from backend.serving.engine import Engine, GenerationRequest
from backend.serving.row_runs import RowRuns, plan
from tests.backend.serving.sequences import opened


def _cost(lengths: list[int], spans: list[tuple[int, int]], run_cost: int) -> int:
    return sum((end - first) * max(lengths[first:end]) + run_cost for first, end in spans)


def _brute_force(lengths: list[int], most: int, run_cost: int) -> int:
    """The least cost over every split of the rows into at most ``most`` consecutive runs."""
    n, best = len(lengths), None
    for k in range(0, min(most, n) - 1 + 1):
        for cuts in itertools.combinations(range(1, n), k):
            edges = [0, *cuts, n]
            c = _cost(lengths, list(itertools.pairwise(edges)), run_cost)
            best = c if best is None else min(best, c)
    assert best is not None
    return best


@settings(max_examples=400, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=8),
       extra=st.integers(0, 40), run_cost=st.sampled_from([0, 50, 500, 4096]),
       most=st.integers(1, 4))
def test_the_plan_is_the_cheapest_split_and_covers_every_row(
        lengths: list[int], extra: int, run_cost: int, most: int) -> None:
    width = max(lengths) + extra
    got = plan(lengths, width, run_cost=run_cost, most=most)
    whole = len(lengths) * width + run_cost
    if got is None:  # one run over the whole width: must be as cheap as any split
        assert whole <= _brute_force(lengths, most, run_cost) or \
            (width - min(lengths)) * len(lengths) <= run_cost
        return
    spans = got.spans
    assert 1 <= len(spans) <= most
    assert spans[0][0] == 0 and spans[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # consecutive, in order
    assert all(cols == max(lengths[first:end]) for first, end, cols in spans)  # no row cut
    cost = _cost(lengths, [(f, e) for f, e, _c in spans], run_cost)
    assert cost == _brute_force(lengths, most, run_cost) and cost <= whole


def test_lengths_over_the_width_are_refused() -> None:
    with pytest.raises(ValueError, match="over the batch width"):
        plan([5, 9], 8)


@pytest.fixture(scope="module")
def engine(kit_dir: Path) -> Engine:
    return Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=16,
                  max_adapters=2)


def test_rows_decode_over_their_own_columns_and_answer_as_alone(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    long = GenerationRequest("Once upon a time " * 8, None, max_tokens=8)
    short = [GenerationRequest(p, None, max_tokens=8) for p in ("Hi", "The cat", "1 + 1")]
    requests = [*short[:2], long, short[2]]  # the long row between short ones
    alone = [engine.generate([r])[0].token_ids for r in requests]

    seen: list[RowRuns] = []
    first_seen: list[RowRuns] = []
    attend = row_runs.row_run_attention

    def spy(*args: object, row_runs: RowRuns | None = None, **kwargs: object) -> object:
        if row_runs is not None:
            seen.append(row_runs)
        return attend(*args, row_runs=row_runs, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(row_runs, "RUN_COST", 0)
    from transformers import AttentionInterface
    AttentionInterface.register(row_runs.NAME, spy)
    try:
        logits = {}
        for cost in (0, 10**12):  # with runs, then over the whole width
            monkeypatch.setattr(row_runs, "RUN_COST", cost)
            if cost:  # the runs of the first pass only: KV segments (kv_segments) have runs too
                seen, first_seen = [], seen
            with opened(engine, *requests) as seqs:
                batch = engine.prefill(seqs)
                steps = []
                for _ in range(6):
                    engine.choose(batch)
                    engine.advance(batch)
                    steps.append(batch.logits.clone())
                logits[cost] = (steps, [list(s.produced) for s in seqs])
    finally:
        AttentionInterface.register(row_runs.NAME, attend)
    with_runs, whole = logits[0], logits[10**12]
    for a, b in zip(with_runs[0], whole[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert with_runs[1] == whole[1]
    for got, want in zip(with_runs[1], alone, strict=True):
        assert got == want[: len(got)]
    # every decode step of the run with runs split the batch around the long row, and left out
    # most of the padding the short rows had
    layers = engine.base_config.num_hidden_layers
    assert len(first_seen) == 6 * layers
    width = len(seqs[2].prompt_ids) + 7
    for runs in first_seen:
        assert (2, 3) in [(f, e) for f, e, _c in runs.spans]  # the long row in a run alone
        attended = sum((e - f) * c for f, e, c in runs.spans)
        assert attended < 0.5 * len(requests) * width
