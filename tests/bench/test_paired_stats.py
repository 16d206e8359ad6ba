"""The statistics of paired comparisons: the alternation, the pairs, the bootstrap interval, the verdict."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipemorph.paired import (MIN_PAIRS, Interval, bootstrap_median, compare, cycles_for, form_pairs,
                                       sequence, verdict)


def test_the_alternation_is_a_b_a_prime_b_with_the_measured_part_starting_at_a():
    assert sequence(8) == ["A", "B", "A'", "B", "A", "B", "A'", "B"]
    # Three warm-up iterations alternate too, so that iteration 3 (the first measured) is an A.
    assert sequence(7, warmup=3) == ["B", "A'", "B", "A", "B", "A'", "B"]
    assert [cycles_for(p) for p in (1, 2, 3, 20)] == [1, 1, 2, 10]


def test_pairs_are_adjacent_iterations_after_the_warm_up():
    sides = sequence(10, warmup=2)  # B A' | A B A' B A B A' B
    times = [100.0 + i for i in range(10)]  # iteration i took 100 + i ms
    p = form_pairs(sides, times, warmup=2)
    # Each B with the iteration right before it; the warm-up (0, 1) pairs with nothing, even the
    # B at index 3 is not paired with the warm-up's A' at index 1.
    assert p.ba == [(102.0, 103.0), (104.0, 105.0), (106.0, 107.0), (108.0, 109.0)]
    # Each A' with the A two before it, inside the measured part.
    assert p.aa == [(102.0, 104.0), (106.0, 108.0)]


def test_a_pair_straddling_the_warm_up_is_dropped():
    sides = ["A", "B", "A'", "B", "A", "B"]
    p = form_pairs(sides, [1, 2, 3, 4, 5, 6], warmup=3)  # measured: B(4), A(5), B(6)
    assert p.ba == [(5.0, 6.0)]  # the B at index 3 follows a warm-up iteration
    assert p.aa == []


def test_a_constant_ratio_gives_a_zero_width_interval_at_that_value():
    iv = bootstrap_median([1.25] * 15, seed=3)
    assert iv == Interval(1.25, 1.25, 1.25, 15)


def test_the_interval_is_deterministic_with_a_seed():
    r = list(np.random.default_rng(7).lognormal(0.1, 0.2, size=25))
    assert bootstrap_median(r, seed=11) == bootstrap_median(r, seed=11)
    assert bootstrap_median(r, seed=11, resamples=300) == bootstrap_median(r, seed=11, resamples=300)


def test_the_interval_holds_the_true_median_ratio_in_most_seeds():
    # A iterations take 400 ms x e^(0.15 z1), B 1.1 x 400 ms x e^(0.15 z2) (z normal): log B/A is
    # symmetric about log 1.1, so the true median of the per-pair ratio is exactly 1.1.
    hits, runs = 0, 200
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        a = 400.0 * np.exp(0.15 * rng.standard_normal(30))
        b = 1.1 * 400.0 * np.exp(0.15 * rng.standard_normal(30))
        iv = bootstrap_median(b / a, seed=seed, resamples=2000)
        hits += iv.holds(1.1)
    assert hits >= 0.88 * runs, f"a 95% interval held the true ratio in {hits} of {runs} runs"


def test_two_sittings_at_different_machine_speeds_give_the_same_paired_ratio():
    # The machine's speed differs between sittings (x1 and x1.4) and within one (it halves at
    # pair 7), and B takes 5 % longer than A. Separate means would flip with the machine; the
    # paired ratio cannot.
    rng = np.random.default_rng(0)
    base = 400.0 * np.exp(0.02 * rng.standard_normal(40))
    def sitting(speed):
        s = speed * np.where(np.arange(20) < 7, 1.0, 0.5)
        sides, times = [], []
        for k in range(20):
            sides += ["A" if k % 2 == 0 else "A'", "B"]
            times += [s[k] * base[2 * k], s[k] * 1.05 * base[2 * k + 1]]
        return compare(sides, times, warmup=0, seed=0)
    one, two = sitting(1.0), sitting(1.4)
    assert one.ratio.median == pytest.approx(two.ratio.median, rel=1e-12)
    assert one.ratio.lo == pytest.approx(two.ratio.lo, rel=1e-12)
    assert one.ratio.hi == pytest.approx(two.ratio.hi, rel=1e-12)
    assert two.a_median_ms > one.a_median_ms  # the sides' own times did move with the machine


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(50, 2000), st.floats(0.5, 2.0), st.floats(0.25, 4.0)), min_size=1, max_size=30))
def test_scaling_both_members_of_any_pair_leaves_the_interval_unchanged(rows):
    # (A's ms, B/A, the machine's speed during that pair)
    plain = [b_over_a for _, b_over_a, _ in rows]
    scaled = [(speed * b_over_a * a) / (speed * a) for a, b_over_a, speed in rows]
    x, y = bootstrap_median(plain, seed=1, resamples=500), bootstrap_median(scaled, seed=1, resamples=500)
    for u, v in ((x.median, y.median), (x.lo, y.lo), (x.hi, y.hi)):
        assert math.isclose(u, v, rel_tol=1e-9)
    assert min(plain) - 1e-12 <= x.lo <= x.median <= x.hi <= max(plain) + 1e-12


def test_an_interval_holding_one_says_no_difference_measurable_here():
    noise = Interval(1.0, 0.98, 1.02, 10)
    assert "no difference measurable here" in verdict(Interval(1.01, 0.99, 1.04, 20), noise)
    v = verdict(Interval(0.8, 0.77, 0.83, 20), noise)
    assert v.startswith("B is faster than A") and "20.0% less time" in v
    assert verdict(Interval(1.1, 1.05, 1.2, 20), noise).startswith("B is slower than A")


def test_a_failed_or_missing_noise_check_and_too_few_pairs_are_said():
    assert verdict(Interval(1.1, 1.05, 1.2, 20), Interval(1.1, 1.05, 1.15, 10)).startswith("noise check failed")
    assert "noise unchecked" in verdict(Interval(1.1, 1.05, 1.2, 20), None)
    assert "too few pairs to judge" in verdict(Interval(1.1, 1.05, 1.2, MIN_PAIRS - 1), Interval(1, 0.9, 1.1, 10))


def test_bad_samples_are_refused():
    with pytest.raises(ValueError, match="no pairs"):
        bootstrap_median([])
    with pytest.raises(ValueError, match="positive finite"):
        bootstrap_median([1.0, float("nan")])
