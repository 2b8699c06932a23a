"""The two-level bootstrap: its point value, determinism, degenerate data, pairing, and coverage on simulated runs."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.audit.stats import bootstrap, bootstrap_independent, success_rate, wilson
from pipeline.errors import InvalidArgumentError


def test_the_value_is_the_statistic_of_all_units_and_the_interval_is_seeded():
    by_seed = {0: [[True, False], [True, True]], 1: [[False, False, True]]}
    estimate = bootstrap(by_seed, success_rate, resamples=500, seed=3)
    assert estimate.value == pytest.approx(4 / 7)  # pooled: 4 successes in 7 episodes
    assert estimate.low <= estimate.value <= estimate.high
    assert bootstrap(by_seed, success_rate, resamples=500, seed=3) == estimate
    assert str(estimate).startswith("0.571 [")


def test_data_without_variation_gives_a_point_interval():
    by_seed = {s: [[True, False]] * 4 for s in range(3)}
    estimate = bootstrap(by_seed, success_rate, resamples=200)
    assert (estimate.value, estimate.low, estimate.high) == (0.5, 0.5, 0.5)


def test_a_paired_difference_keeps_its_pairs():
    # every task: guided 1, free 0 -> the difference is 1 in every resample, whatever is drawn
    by_seed = {s: [(1.0, 0.0), (1.0, 0.0), (1.0, 0.0)] for s in range(4)}

    def guided_minus_free(units):
        return float(np.mean([g for g, _ in units]) - np.mean([f for _, f in units]))

    estimate = bootstrap(by_seed, guided_minus_free, resamples=300)
    assert (estimate.value, estimate.low, estimate.high) == (1.0, 1.0, 1.0)


def test_the_interval_covers_a_known_rate_with_the_width_sampling_allows():
    rng = np.random.default_rng(0)
    by_seed = {s: [[bool(x) for x in rng.random(4) < 0.3] for _ in range(50)] for s in range(5)}  # 1,000 episodes
    estimate = bootstrap(by_seed, success_rate, resamples=1000)
    assert estimate.low < 0.3 < estimate.high
    # a binomial 95% interval of 1,000 episodes is +-0.028; tasks and seeds carry no extra variation here
    assert 0.04 < estimate.high - estimate.low < 0.08


def test_seed_level_variation_widens_the_interval():
    rng = np.random.default_rng(1)
    rates = {s: 0.1 + 0.15 * s for s in range(5)}  # runs that differ: 0.1 ... 0.7
    by_seed = {s: [[bool(x) for x in rng.random(4) < rate] for _ in range(50)] for s, rate in rates.items()}
    pooled = [unit for units in by_seed.values() for unit in units]
    one_level = bootstrap({0: pooled}, success_rate, resamples=1000)
    two_level = bootstrap(by_seed, success_rate, resamples=1000)
    assert two_level.high - two_level.low > 3 * (one_level.high - one_level.low)


def test_bad_input_is_refused_and_non_finite_resamples_are_skipped():
    with pytest.raises(InvalidArgumentError, match="at least one unit"):
        bootstrap({0: []}, success_rate)
    with pytest.raises(InvalidArgumentError, match="level"):
        bootstrap({0: [[True]]}, success_rate, level=1.0)
    # a ratio over units whose denominator is sometimes zero in a resample: those resamples are skipped
    by_seed = {0: [(1.0, 0.0), (1.0, 2.0)]}
    estimate = bootstrap(by_seed, lambda units: sum(a for a, _ in units) / sum(b for _, b in units), resamples=200)
    assert estimate.value == 1.0 and np.isfinite(estimate.low) and np.isfinite(estimate.high)


def test_the_independent_bootstrap_resamples_each_side_apart():
    a = {0: [1.0, 1.0], 1: [1.0, 1.0]}
    b = {0: [0.0, 1.0], 1: [0.0, 1.0]}
    estimate = bootstrap_independent(a, b, lambda xs, ys: sum(xs) / len(xs) - sum(ys) / len(ys), resamples=500)
    assert estimate.value == pytest.approx(0.5)
    # a has no variation; b's resampled mean runs from 0 to 1, so the difference from 0 to 1
    assert 0.0 <= estimate.low < 0.5 < estimate.high <= 1.0
    assert estimate == bootstrap_independent(a, b, lambda xs, ys: sum(xs) / len(xs) - sum(ys) / len(ys),
                                             resamples=500), "seeded"
    with pytest.raises(InvalidArgumentError, match="each side"):
        bootstrap_independent(a, {}, lambda xs, ys: 0.0)


def test_the_wilson_interval_by_hand():
    # z = 1.959964, z^2 = 3.841459. 5 of 10: centre (0.5 + 0.192073) / 1.384146, half-width
    # 1.959964 * sqrt((0.25 + 0.096036) / 10) / 1.384146 -> [0.236593, 0.763407]. 0 of 10: [0, 0.277533], not empty.
    half = wilson(5, 10)
    assert (half.value, half.low, half.high) == (0.5, pytest.approx(0.236593, abs=1e-6),
                                                 pytest.approx(0.763407, abs=1e-6))
    none = wilson(0, 10)
    assert (none.value, none.low, none.high) == (0.0, 0.0, pytest.approx(0.277533, abs=1e-6))
    every = wilson(10, 10)
    assert (every.low, every.high) == (pytest.approx(1 - 0.277533, abs=1e-6), pytest.approx(1.0))
    with pytest.raises(InvalidArgumentError, match="at least one trial"):
        wilson(0, 0)
