"""RouteLLM's evaluation of a strong/weak router, and its threshold calibration.

Route the prompts with the highest strong win rates to the strong model, the rest to the weak one,
and sweep the share routed to strong from 0 to 1. Quality at each share is the mean correctness of
the model each prompt went to. PGR (performance gap recovered) rescales quality so that all-weak is
0 and all-strong is 1; APGR is the area under PGR over the strong share; CPT(x) is the smallest
strong share whose PGR reaches x. A random router's APGR is 0.5 in expectation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingCurve:
    """Quality against the share of calls sent to the strong model, one point per routed prompt count."""

    strong_fractions: np.ndarray  # [n + 1], 0 .. 1
    quality: np.ndarray  # [n + 1]
    weak_quality: float
    strong_quality: float

    @property
    def pgr(self) -> np.ndarray:
        gap = self.strong_quality - self.weak_quality
        if gap <= 0:
            raise ValueError(f"the strong model ({self.strong_quality:.3f}) must beat the weak one "
                             f"({self.weak_quality:.3f}) on this data for PGR to be defined")
        return (self.quality - self.weak_quality) / gap

    def apgr(self) -> float:
        """Area under PGR over the strong-call share (trapezoid rule)."""
        pgr, x = self.pgr, self.strong_fractions
        return float(np.sum((pgr[1:] + pgr[:-1]) * np.diff(x)) / 2)

    def cpt(self, target: float) -> float:
        """Smallest strong-call share whose PGR reaches ``target`` (1.0 if it never does)."""
        reached = np.flatnonzero(self.pgr >= target - 1e-12)
        return float(self.strong_fractions[reached[0]]) if len(reached) else 1.0


def routing_curve(win_rates: np.ndarray, weak_correct: np.ndarray, strong_correct: np.ndarray) -> RoutingCurve:
    """The curve for routing prompts to strong in descending order of win rate.

    Prompts with equal win rates cannot be split by any threshold; their correctness is averaged
    within each tie so the curve does not depend on how a sort orders them.
    """
    n = len(win_rates)
    order = np.argsort(-np.asarray(win_rates), kind="stable")
    rates = np.asarray(win_rates)[order]
    gain = (strong_correct.astype(np.float64) - weak_correct.astype(np.float64))[order]
    # Average the gain within runs of equal rates.
    starts = np.flatnonzero(np.r_[True, rates[1:] != rates[:-1]])
    sums = np.add.reduceat(gain, starts)
    lengths = np.diff(np.r_[starts, n])
    gain = np.repeat(sums / lengths, lengths)
    weak_quality = float(weak_correct.mean())
    quality = weak_quality + np.r_[0.0, np.cumsum(gain)] / n
    return RoutingCurve(np.arange(n + 1) / n, quality, weak_quality, float(strong_correct.mean()))


@dataclass(frozen=True)
class Estimate:
    """A point estimate with a bootstrap confidence interval."""

    value: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


@dataclass(frozen=True)
class RouterEvaluation:
    """One router's figures on a held-out set, with 95% bootstrap intervals."""

    router: str
    num_prompts: int
    apgr: Estimate
    cpt50: Estimate
    cpt80: Estimate
    # APGR minus the random router's on the same resamples (None for random itself).
    apgr_over_random: Estimate | None
    curve: RoutingCurve
    # Bootstrap resamples the intervals come from (those where the strong model beat the weak one).
    num_resamples: int = 0


def _interval(values: np.ndarray, point: float, confidence: float) -> Estimate:
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return Estimate(point, float(low), float(high))


def bootstrap_samples(num_prompts: int, num_bootstrap: int, seed: int = 0,
                      groups: list[str] | None = None) -> list[np.ndarray]:
    """Index resamples of the prompts; with ``groups``, whole groups are drawn (a cluster bootstrap).

    Prompts of one group share a subject and a difficulty, so on a group-held-out split a resample
    of prompts understates how much the figures depend on which groups were held out.
    """
    rng = np.random.default_rng(seed)
    if groups is None:
        return [rng.integers(0, num_prompts, num_prompts) for _ in range(num_bootstrap)]
    names = sorted(set(groups))
    members = {name: [] for name in names}
    for index, group in enumerate(groups):
        members[group].append(index)
    rows = [np.asarray(members[name]) for name in names]
    return [np.concatenate([rows[i] for i in rng.integers(0, len(names), len(names))]) for _ in range(num_bootstrap)]


def evaluate_routers(win_rates: dict[str, np.ndarray], weak_correct: np.ndarray, strong_correct: np.ndarray,
                     num_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0,
                     baseline: str = "random", groups: list[str] | None = None) -> list[RouterEvaluation]:
    """APGR, CPT(50%) and CPT(80%) for each router, and each router's APGR gain over ``baseline``.

    Every router is scored on the same bootstrap resamples of the prompts, so the gain's interval
    accounts for the prompts they share.

    Args:
        groups: each prompt's group; when given, the bootstrap resamples whole groups.
    """
    samples = bootstrap_samples(len(weak_correct), num_bootstrap, seed, groups)
    # PGR needs a gap to recover: a resample of a few groups can draw only groups where the weak
    # model does as well, and is dropped (RouterEvaluation.num_resamples says how many were kept).
    samples = [s for s in samples if strong_correct[s].mean() > weak_correct[s].mean()]
    if not samples:
        raise ValueError("no bootstrap resample has the strong model ahead of the weak one")
    curves = {name: routing_curve(rates, weak_correct, strong_correct) for name, rates in win_rates.items()}
    points = {name: _figures(curve) for name, curve in curves.items()}
    resampled = {name: np.array([_figures(routing_curve(rates[s], weak_correct[s], strong_correct[s])) for s in samples])
                 for name, rates in win_rates.items()}
    n = len(weak_correct)
    evaluations = []
    for name, curve in curves.items():
        point, stats = points[name], resampled[name]
        gain = None
        if baseline in resampled and name != baseline:
            gain = _interval(stats[:, 0] - resampled[baseline][:, 0], point[0] - points[baseline][0], confidence)
        evaluations.append(RouterEvaluation(
            name, n, _interval(stats[:, 0], point[0], confidence), _interval(stats[:, 1], point[1], confidence),
            _interval(stats[:, 2], point[2], confidence), gain, curve, len(samples)))
    return evaluations


def _figures(curve: RoutingCurve) -> tuple[float, float, float]:
    return curve.apgr(), curve.cpt(0.5), curve.cpt(0.8)


def threshold_for_strong_fraction(win_rates: np.ndarray, strong_fraction: float) -> float:
    """The threshold that routes ``strong_fraction`` of these prompts to the strong model.

    As RouteLLM: the (1 - fraction) quantile of the win rates, since prompts at or above the
    threshold go to strong.
    """
    if not 0.0 <= strong_fraction <= 1.0:
        raise ValueError(f"strong fraction must be in [0, 1], got {strong_fraction}")
    if strong_fraction == 0.0:
        return 1.0
    return float(np.quantile(np.asarray(win_rates, dtype=np.float64), 1.0 - strong_fraction, method="higher"))


def strong_fraction_at(win_rates: np.ndarray, threshold: float) -> float:
    """Share of these prompts a threshold sends to the strong model."""
    return float(np.mean(np.asarray(win_rates) >= threshold))
