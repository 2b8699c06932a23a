"""Confidence intervals for learning claims: a two-level bootstrap over seeds and the tasks within each seed.

    by_seed = {0: [units of seed 0's tasks...], 1: [...], ...}      # a unit: whatever one task contributed
    estimate = bootstrap(by_seed, mean_success)                      # Estimate(value, low, high), 95% percentile
    estimate.low > 0

Why two levels: episodes of one task are not independent draws (the same layout, the same policy), and neither are
the tasks of one run (the same training). Resampling runs (seeds) with replacement, then tasks within each drawn
run with replacement, carries both sources of variation into the interval; resampling episodes alone would make it
too narrow. A unit is one task of one run, so a paired comparison (guided against free on the same task, one arm
against another on the same seed and task) passes both sides in one unit and the pairing survives the resampling.

`bootstrap_independent` is the unpaired counterpart for two arms: each arm's runs and tasks are resampled on their
own, as if the arms had drawn nothing in common. Set beside the paired interval of the same runs, it shows what the
pairing (common random numbers: the same tasks and the same draws for both arms of a seed) takes out of the interval.

Percentile intervals from `resamples` draws of a seeded generator: the same data and seed give the same interval.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from pipeline.errors import InvalidArgumentError

T = TypeVar("T")


@dataclass(frozen=True)
class Estimate:
    """A statistic on the data as observed, and its bootstrap interval."""

    value: float
    low: float
    high: float
    level: float = 0.95

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap(by_seed: Mapping[Any, Sequence[T]], statistic: Callable[[list[T]], float], *,
              resamples: int = 2000, level: float = 0.95, seed: int = 0) -> Estimate:
    """`statistic` of every unit, with the percentile interval of `statistic` over `resamples` two-level resamples:
    seeds with replacement, then within each drawn seed its units with replacement. A resample whose statistic is
    not finite or divides by zero (a ratio over a zero) is skipped; if none is left the interval is (nan, nan)."""
    groups = [list(units) for units in by_seed.values() if units]
    if not groups:
        raise InvalidArgumentError("bootstrap needs at least one unit")
    return _percentile_interval([groups], lambda samples: statistic(samples[0]), resamples, level, seed)


def bootstrap_independent(a: Mapping[Any, Sequence[T]], b: Mapping[Any, Sequence[T]],
                          statistic: Callable[[list[T], list[T]], float], *, resamples: int = 2000,
                          level: float = 0.95, seed: int = 0) -> Estimate:
    """`statistic(units of a, units of b)` with the percentile interval over `resamples` draws in which `a` and `b` are
    resampled independently, each on two levels (its seeds, then the units within each drawn seed)."""
    groups_a = [list(units) for units in a.values() if units]
    groups_b = [list(units) for units in b.values() if units]
    if not groups_a or not groups_b:
        raise InvalidArgumentError("bootstrap_independent needs at least one unit on each side")
    return _percentile_interval([groups_a, groups_b], lambda samples: statistic(samples[0], samples[1]), resamples,
                                level, seed)


def _percentile_interval(sides: list[list[list[T]]], statistic: Callable[[list[list[T]]], float], resamples: int,
                         level: float, seed: int) -> Estimate:
    """The statistic of every side's units, and its percentile interval over resamples that draw each side on two
    levels, side after side from one seeded generator."""
    if not 0 < level < 1:
        raise InvalidArgumentError(f"level must lie in (0, 1), got {level}")
    value = float(statistic([[unit for units in groups for unit in units] for groups in sides]))
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        samples: list[list[T]] = []
        for groups in sides:
            sample: list[T] = []
            for g in rng.integers(0, len(groups), size=len(groups)):
                units = groups[int(g)]
                sample += [units[int(i)] for i in rng.integers(0, len(units), size=len(units))]
            samples.append(sample)
        try:
            result = float(statistic(samples))
        except ZeroDivisionError:  # e.g. a ratio whose denominator this resample drew only zeros of
            continue
        if np.isfinite(result):
            draws.append(result)
    if not draws:
        return Estimate(value, float("nan"), float("nan"), level)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return Estimate(value, float(low), float(high), level)


def success_rate(outcomes: Sequence[Sequence[bool]]) -> float:
    """Pooled success over units that are each a task's episode outcomes."""
    episodes = sum(len(unit) for unit in outcomes)
    return sum(sum(unit) for unit in outcomes) / episodes if episodes else float("nan")


def wilson(successes: int, trials: int, z: float = 1.959964) -> Estimate:
    """The success rate of `trials` independent trials and its Wilson score interval (95% for the default z): unlike
    the normal approximation it stays inside [0, 1] and is not empty at 0 or `trials` successes. A per-step curve of
    one run draws it around each point; the runs and tasks behind a claim get `bootstrap` instead."""
    if trials <= 0:
        raise InvalidArgumentError(f"a rate needs at least one trial, got {trials}")
    rate = successes / trials
    spread = z * ((rate * (1 - rate) + z * z / (4 * trials)) / trials) ** 0.5
    centre = rate + z * z / (2 * trials)
    scale = 1 + z * z / trials
    return Estimate(rate, max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale))
