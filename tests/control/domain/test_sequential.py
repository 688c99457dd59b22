"""The confidence sequences the rollout judge reads: they hold at every look, not just one."""

from __future__ import annotations

import numpy as np
import pytest

from control.domain.sequential import SCALES, Tally, difference_bounds, radius, rate_bounds


def test_a_bound_narrows_as_evidence_grows_and_never_collapses_on_a_perfect_sample() -> None:
    widths = [radius(0.25 / n, 0.01, 0.05) for n in (10, 100, 1000, 10_000)]
    assert widths == sorted(widths, reverse=True)
    perfect = rate_bounds(Tally(20, 20), 0.01, 0.05)
    assert perfect is not None and perfect.low < 0.9  # 20 of 20 is not certainty


def test_more_scales_see_a_gross_difference_sooner() -> None:
    worse, stable = Tally(10, 30), Tally(270, 300)
    one = difference_bounds(worse, stable, 0.0025, 0.03)
    many = difference_bounds(worse, stable, 0.0025, 0.03, SCALES)
    assert one is not None and many is not None
    assert many.high < 0 < one.high  # significant with the scales, not with the margin's alone


def test_no_data_gives_no_bounds_and_bad_counts_are_refused() -> None:
    assert difference_bounds(Tally(), Tally(3, 4), 0.01, 0.05) is None
    with pytest.raises(ValueError):
        Tally(5, 4)


def test_the_bound_holds_at_every_look_far_more_often_than_its_level_requires() -> None:
    """Two arms at 95 %, looked at after every 10 requests up to 1000: the share of sequences
    whose bound ever excludes the true difference (0) stays below alpha."""
    rng = np.random.default_rng(7)
    alpha, runs, looks = 0.05, 400, range(10, 1001, 10)
    t = rng.random((runs, 1000)) < 0.95
    b = rng.random((runs, 1000)) < 0.95
    tc, bc = t.cumsum(axis=1), b.cumsum(axis=1)
    missed = 0
    for i in range(runs):
        for n in looks:
            bounds = difference_bounds(Tally(int(tc[i, n - 1]), n), Tally(int(bc[i, n - 1]), n),
                                       alpha, 0.03, SCALES)
            assert bounds is not None
            if not bounds.low <= 0 <= bounds.high:
                missed += 1
                break
    assert missed / runs < alpha
