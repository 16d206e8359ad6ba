"""Search over placements for the ones with the smallest predicted iteration time.

The cost of a placement does not change when the replicas are renamed (an iteration waits for
the slowest replica; a ring depends on the set of a stage's ranks only), so placements are
searched modulo renaming:

- exact, when there are at most ``EXACT_MAX_PLACEMENTS`` of them (W!/D!: 20,160 for 8 ranks in
  2 replicas): every placement whose stage-0 ranks increase along the replicas;
- otherwise swap local search: from the default placement, the best swap of two ranks while it
  helps, then restarts from a few random swaps away from the best (seeded: deterministic
  unless the time budget cuts it short).

Ties go to the placement that moves the fewest ranks from DeepSpeed's default, so a matrix with
no slow pair gives the default. Keys compare times rounded to ``TIE_MS``.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import itertools
import math
import random
import time
from typing import Callable, Optional

from .placement import Placement

EXACT_MAX_PLACEMENTS = 100_000
TIE_MS = 1e-6
RESTARTS = 8
KICK_SWAPS = 3  # random swaps of a restart

Objective = Callable[[Placement], float]


def placements_modulo_renaming(pp: int, dp: int) -> int:
    return math.factorial(pp * dp) // math.factorial(dp)


def _rounded(t: float) -> float:
    return round(t / TIE_MS) * TIE_MS


def _key(p: Placement, t: float) -> tuple:
    return (_rounded(t), p.moved(), p.grid)


def best_placements(pp: int, dp: int, objective: Objective, top: int = 1, exact: Optional[bool] = None,
                    seed: int = 0, budget_s: float = 10.0) -> list[tuple[Placement, float]]:
    """Up to ``top`` distinct placements (modulo renaming replicas) with their objective, best
    first, each in its relabelling closest to the default. ``exact``: enumerate (default: when
    there are at most ``EXACT_MAX_PLACEMENTS``), else swap local search within ``budget_s``."""
    use_exact = placements_modulo_renaming(pp, dp) <= EXACT_MAX_PLACEMENTS if exact is None else exact
    found = _enumerate(pp, dp, objective) if use_exact else _swap_search(pp, dp, objective, seed, budget_s)
    # Only placements as fast as the top-th distinct time can be among the best: relabel just those.
    times = sorted({_rounded(t) for _, t in found.values()})
    cut = times[min(top, len(times)) - 1]
    near = [(p.closest_to_default(), t) for p, t in found.values() if _rounded(t) <= cut]
    return sorted(near, key=lambda x: _key(*x))[:top]


def _enumerate(pp: int, dp: int, objective: Objective) -> dict:
    """Every placement modulo renaming: stage 0's ranks as an increasing tuple, the rest in any order."""
    W = pp * dp
    out: dict = {}
    for first in itertools.combinations(range(W), dp):
        rest = [x for x in range(W) if x not in first]
        for perm in itertools.permutations(rest):
            grid = (first,) + tuple(tuple(perm[i * dp:(i + 1) * dp]) for i in range(pp - 1))
            p = Placement(grid)
            out[grid] = (p, objective(p))
    return out


def _canonical(p: Placement) -> tuple:
    order = tuple(sorted(range(p.dp), key=lambda r: p.grid[0][r]))
    return p.relabelled(order).grid


def _swap(p: Placement, i: int, j: int) -> Placement:
    """Exchange the ranks at flat grid positions ``i`` and ``j`` (position = stage * D + replica)."""
    D = p.dp
    flat = [x for row in p.grid for x in row]
    flat[i], flat[j] = flat[j], flat[i]
    return Placement(tuple(tuple(flat[s * D:(s + 1) * D]) for s in range(p.pp))).closest_to_default()


def _swap_search(pp: int, dp: int, objective: Objective, seed: int, budget_s: float) -> dict:
    W = pp * dp
    rng = random.Random(seed)
    out: dict = {}
    deadline = time.perf_counter() + budget_s

    def score(p: Placement) -> tuple:
        canon = _canonical(p)
        if canon not in out:
            out[canon] = (p, objective(p))
        return _key(p, out[canon][1])

    def descend(p: Placement) -> tuple[Placement, tuple]:
        k = score(p)
        while time.perf_counter() < deadline:
            best = (k, p)
            for i in range(W):
                for j in range(i + 1, W):
                    q = _swap(p, i, j)
                    kq = score(q)
                    if kq < best[0]:
                        best = (kq, q)
            if best[1] is p:
                break
            k, p = best
        return p, k

    best, best_k = descend(Placement.default(pp, dp))
    if pp == 1:
        return out  # one stage: every placement is a renaming of the default
    for _ in range(RESTARTS):
        if time.perf_counter() >= deadline:
            break
        q = best
        for _ in range(KICK_SWAPS):
            i, j = rng.sample(range(W), 2)
            q = _swap(q, i, j)
        q, kq = descend(q)
        if kq < best_k:
            best, best_k = q, kq
    return out
