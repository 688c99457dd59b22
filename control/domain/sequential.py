"""Anytime-valid bounds for rates: what a rollout may conclude from counts, however often it looks.

A rollout looks at its evidence after every window and stops as soon as it can. A fixed-sample
test read that way is wrong far more often than its nominal level (each look is another chance
to cross a threshold by luck). The bounds here are **confidence sequences**: intervals that hold
for every sample size at once, so a rule "stop when the interval excludes X" keeps its error rate
however many times it is applied.

Method: the normal-mixture (Robbins) boundary, which is the mixture sequential probability ratio
test (mSPRT) of Johari, Pekelis and Walsh ("Always valid inference", 2017) inverted into an
interval. For an estimate ``d`` of a rate (or a difference of two rates) with variance ``V``, and a
mixing scale ``tau``, every value ``x`` with

    (d - x)^2 <= V (V + tau^2) / tau^2 * (log((V + tau^2) / V) + 2 log(1 / alpha))

is kept. For normal data of known variance the chance that the interval *ever* misses the true
value is at most ``alpha`` (Ville's inequality on the mixture martingale). Rates are not normal and
``V`` is estimated, so the guarantee is asymptotic (Waudby-Smith et al., "Time-uniform central
limit theory", 2021); ``loraplane bench release`` measures the real error rates by simulation,
with the very functions the controller calls.

Two choices keep small samples honest:

- the variance is estimated with half a success and half a failure added to each arm
  (``(good + 0.5) / (total + 1)``), so 20 successes out of 20 do not read as a rate with no
  variance (the plain estimate would make the interval collapse to a point);
- ``tau`` is the effect the test is built to resolve (the non-inferiority margin): the boundary is
  then tightest near the sample size at which that effect becomes visible, about 1.4 times the
  width of a fixed-sample interval there. Far below that size it is wide (it grows like ``V /
  tau`` rather than ``sqrt(V)``), which would make a gross regression wait for hundreds of
  requests; so a bound may take several scales at once (:data:`SCALES`), each at ``alpha``
  divided by their number, and keep the narrowest: a union bound, so still valid at ``alpha``,
  for the price of a slightly wider interval where one scale alone would be best.

Nothing here knows about rollouts: :mod:`control.domain.rollout_judge` applies these bounds to a
rollout's metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tally:
    """Bernoulli counts of one arm: ``good`` of ``total`` trials."""

    good: int = 0
    total: int = 0

    def __post_init__(self) -> None:
        if self.total < 0 or not 0 <= self.good <= self.total:
            raise ValueError(f"a tally needs 0 <= good <= total, found {self.good}/{self.total}")

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.good + other.good, self.total + other.total)

    @property
    def rate(self) -> float | None:
        return self.good / self.total if self.total else None

    def to_json(self) -> list[int]:
        return [self.good, self.total]

    @classmethod
    def from_json(cls, data: list[int] | tuple[int, int]) -> Tally:
        return cls(int(data[0]), int(data[1]))


def _variance(t: Tally) -> float:
    """The variance of ``t.rate``, from the rate with half a trial of each kind added (see the
    module notes: never zero, so a small perfect sample is not taken for certainty)."""
    p = (t.good + 0.5) / (t.total + 1.0)
    return p * (1.0 - p) / t.total


# Multiples of a bound's scale it may also use (see the module notes): one for effects of the
# size it is built for, others for effects 4 and 16 times larger, seen that much sooner.
SCALES = (1.0, 4.0, 16.0)


def radius(variance: float, alpha: float, tau: float,
           scales: tuple[float, ...] = (1.0,)) -> float:
    """Half-width of the normal-mixture confidence sequence at level ``alpha`` for an estimate
    of ``variance``, mixing scale ``tau`` (or the narrowest over ``tau`` times each of
    ``scales``, each at ``alpha / len(scales)``; see the module notes)."""
    if not 0 < alpha < 1 or tau <= 0 or variance <= 0 or not scales:
        raise ValueError("radius needs 0 < alpha < 1, tau > 0, a positive variance and a scale")
    log_alpha = 2.0 * math.log(len(scales) / alpha)
    best = math.inf
    for k in scales:
        t2 = (tau * k) ** 2
        best = min(best, math.sqrt(variance * (variance + t2) / t2
                                   * (math.log((variance + t2) / variance) + log_alpha)))
    return best


@dataclass(frozen=True)
class Bounds:
    """A confidence sequence's interval at the sample size it was read: ``low <= x <= high``
    for the true value ``x``, except with probability ``alpha`` at any time."""

    estimate: float
    low: float
    high: float
    alpha: float

    def to_json(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high,
                "alpha": self.alpha}


def rate_bounds(t: Tally, alpha: float, tau: float,
                scales: tuple[float, ...] = (1.0,)) -> Bounds | None:
    """Bounds on the true rate of ``t`` (None without a trial)."""
    if t.total == 0:
        return None
    p = t.good / t.total
    r = radius(_variance(t), alpha, tau, scales)
    return Bounds(p, p - r, p + r, alpha)


def difference_bounds(target: Tally, baseline: Tally, alpha: float, tau: float,
                      scales: tuple[float, ...] = (1.0,)) -> Bounds | None:
    """Bounds on ``rate(target) - rate(baseline)`` (None unless both arms have a trial). The
    arms may be of any sizes: a canary at 10 % beside a stable release at 90 % is the usual
    case, and the larger arm simply contributes less variance."""
    if target.total == 0 or baseline.total == 0:
        return None
    d = target.good / target.total - baseline.good / baseline.total
    r = radius(_variance(target) + _variance(baseline), alpha, tau, scales)
    return Bounds(d, d - r, d + r, alpha)
