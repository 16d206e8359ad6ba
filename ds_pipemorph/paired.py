"""Paired comparisons: two configurations alternated in one run, compared pair by pair.

On a shared machine the same job can land near one of two speeds from one run to the next, so the
ratio of two separate runs can flip. A paired run alternates the configurations every iteration (or
every whole job, where they cannot share one) in the cycle ``A B A' B``: ``A'`` is ``A`` again. Each
``B`` is paired with the ``A``-side iteration right before it, each ``A'`` with the ``A`` two
before it (the noise check, A/A); whatever slows the machine slows both members of a pair, and the
ratio of a pair keeps only what differs between them. A result is the median of the per-pair
ratios with a bootstrap 95 % interval (pairs resampled with replacement, percentile interval);
an interval that holds 1 means no difference is measurable here.

Pure Python and numpy: no torch, testable without ranks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

CYCLE = ("A", "B", "A'", "B")
A_SIDE = ("A", "A'")
RESAMPLES = 10_000
LEVEL = 0.95
# Fewer pairs admit no 95 % interval for a median at all: with 5, all of them fall on one side of
# it with probability 2 / 2**5 > 5 % (the bootstrap then gives an interval that is too narrow).
MIN_PAIRS = 6


def sequence(iterations: int, warmup: int = 0) -> list[str]:
    """The side of each of ``iterations`` iterations (or jobs): the cycle ``A B A' B`` repeated, the
    warm-up alternating as well and the first measured iteration (index ``warmup``) an ``A``."""
    return [CYCLE[(i - warmup) % len(CYCLE)] for i in range(iterations)]


def cycles_for(pairs: int) -> int:
    """Cycles that give at least ``pairs`` B/A pairs (two per cycle)."""
    return max(1, -(-pairs // 2))


@dataclass(frozen=True)
class Pairs:
    """Times of the measured pairs: ``ba`` (A-side, B) adjacent; ``aa`` (A, A') of one cycle."""

    ba: list[tuple[float, float]]
    aa: list[tuple[float, float]]


def form_pairs(sides: Sequence[str], times: Sequence[float], warmup: int) -> Pairs:
    """Pairs from the iterations after the first ``warmup`` (both members measured): every ``B``
    with the ``A`` or ``A'`` right before it, every ``A'`` with the ``A`` two before it."""
    if len(sides) != len(times):
        raise ValueError(f"{len(sides)} sides for {len(times)} times")
    ba, aa = [], []
    for i in range(warmup, len(sides)):
        if sides[i] == "B" and i - 1 >= warmup and sides[i - 1] in A_SIDE:
            ba.append((float(times[i - 1]), float(times[i])))
        elif sides[i] == "A'" and i - 2 >= warmup and sides[i - 2] == "A":
            aa.append((float(times[i - 2]), float(times[i])))
    return Pairs(ba, aa)


@dataclass(frozen=True)
class Interval:
    """The median of per-pair ratios (second over first) and its bootstrap interval."""

    median: float
    lo: float
    hi: float
    pairs: int

    def holds(self, value: float) -> bool:
        return self.lo <= value <= self.hi

    def text(self) -> str:
        return f"{self.median:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


def bootstrap_median(ratios: Sequence[float], seed: int = 0, resamples: int = RESAMPLES,
                     level: float = LEVEL) -> Interval:
    """Median of ``ratios`` and the percentile bootstrap interval of the median at ``level``:
    ``resamples`` resamples of the pairs with replacement, from a generator seeded with ``seed``."""
    r = np.asarray(ratios, dtype=float)
    if r.size == 0:
        raise ValueError("no pairs: run more iterations than warm-up")
    if not np.all(np.isfinite(r)) or np.any(r <= 0):
        raise ValueError("every ratio must be a positive finite number")
    rng = np.random.default_rng(seed)
    medians = np.median(r[rng.integers(0, r.size, size=(resamples, r.size))], axis=1)
    tail = (1.0 - level) / 2.0 * 100.0
    lo, hi = np.percentile(medians, [tail, 100.0 - tail])
    return Interval(float(np.median(r)), float(lo), float(hi), int(r.size))


def ratios(pairs: Sequence[tuple[float, float]]) -> list[float]:
    return [second / first for first, second in pairs]


@dataclass(frozen=True)
class Comparison:
    """B/A with its interval, the A/A noise check, each side's median time and the verdict."""

    ratio: Interval
    noise: Optional[Interval]
    a_median_ms: float
    b_median_ms: float
    verdict: str

    def as_dict(self) -> dict:
        return asdict(self)


def compare(sides: Sequence[str], times: Sequence[float], warmup: int, seed: int = 0,
            resamples: int = RESAMPLES) -> Comparison:
    """Form the pairs, bootstrap both ratios (the same ``seed``) and say what they show."""
    p = form_pairs(sides, times, warmup)
    ratio = bootstrap_median(ratios(p.ba), seed, resamples)
    noise = bootstrap_median(ratios(p.aa), seed, resamples) if p.aa else None
    a = [t for s, t in list(zip(sides, times))[warmup:] if s in A_SIDE]
    b = [t for s, t in list(zip(sides, times))[warmup:] if s == "B"]
    return Comparison(ratio, noise, float(np.median(a)), float(np.median(b)), verdict(ratio, noise))


def verdict(ratio: Interval, noise: Optional[Interval]) -> str:
    """One sentence: which side is faster and by how much, or that no difference is measurable; a
    noise check that does not hold 1 (A differs from itself) is said first."""
    warn = ""
    if noise is None or noise.pairs < MIN_PAIRS:
        warn = (f"noise unchecked ({0 if noise is None else noise.pairs} A/A pairs, fewer than {MIN_PAIRS}); ")
    elif not noise.holds(1.0):
        warn = (f"noise check failed (A'/A {noise.text()} excludes 1): the alternation itself is "
                f"biased here, distrust the ratio; ")
    if ratio.pairs < MIN_PAIRS:
        return warn + (f"too few pairs to judge ({ratio.pairs} B/A pairs, fewer than {MIN_PAIRS}): "
                       f"B/A {ratio.text()}")
    if ratio.holds(1.0):
        return warn + f"no difference measurable here (B/A {ratio.text()} holds 1)"
    pct = abs(ratio.median - 1.0) * 100.0
    who = "B is faster than A" if ratio.median < 1.0 else "B is slower than A"
    return warn + f"{who}: B/A {ratio.text()}, {pct:.1f}% {'less' if ratio.median < 1.0 else 'more'} time per iteration"
