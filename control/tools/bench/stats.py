"""The one percentile the benches report."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def p95(xs: Sequence[float]) -> float:
    """The 95th percentile (``statistics.quantiles``, exclusive method); the value itself for
    one sample, nan for none (no figure, not a good one)."""
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=20)[-1] if len(xs) >= 2 else xs[0]
