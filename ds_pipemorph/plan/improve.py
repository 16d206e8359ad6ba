"""Local improvement of a schedule, scored by the replay simulator (iterated local search).

A move shifts one op of one stage by up to two places. It is kept when the order stays valid
(per-kind micro-batch order, B after F, W after B, no cycle between stages) and within the caps, and
the replay is no slower; equal scores are accepted because schedules have long plateaus. After
``STALL`` moves without progress the search restarts from the best order kicked by ``KICK`` random
moves. (Moves aimed at idle gaps were tried and did worse than random ones on the MILP benchmark.)
"""
from __future__ import annotations

import random
import time
from typing import Callable

from .ops import Op
from .simulate import Schedule, StuckSchedule, peak_inflight

EPS = 1e-9
STALL = 400  # moves without improvement before a restart
SHIFTS = (-2, -1, 1, 2)  # how far a move shifts an op (±3 did worse on the MILP benchmark: 0.095 % vs 0.053 % mean)
KICK = 3  # random moves applied to the best order at a restart (iterated local search)


def improve(
    best: Schedule,
    caps: list[int],
    deadline: float,
    seed: int,
    stop: Callable[[], bool],
    evaluate: Callable[[Schedule], float],
    lower_bound: float,
) -> tuple[Schedule, float, bool]:
    """The best order found from ``best`` (``evaluate``: its iteration time; raises StuckSchedule)."""
    rng = random.Random(seed)
    cur = [list(r) for r in best]
    cur_t = best_t = evaluate(cur)
    moved = False
    stall = 0
    while time.perf_counter() < deadline and cur_t > lower_bound + EPS and not stop():
        cand = _moved(cur, caps, rng)
        if cand is None:
            continue
        try:
            t = evaluate(cand)
        except StuckSchedule:
            continue
        if t <= cur_t + EPS:
            stall = 0 if t < cur_t - EPS else stall + 1
            cur, cur_t = cand, t
            if t < best_t - EPS:
                best, best_t, moved = [list(r) for r in cur], t, True
        else:
            stall += 1
        if stall > STALL:  # a long plateau: restart from a perturbed copy of the best
            cur = _perturb(best, caps, rng, KICK)
            try:
                cur_t = evaluate(cur)
            except StuckSchedule:
                cur, cur_t = [list(r) for r in best], best_t
            stall = 0
    return best, best_t, moved


def _perturb(sched: Schedule, caps: list[int], rng: random.Random, k: int) -> Schedule:
    out = [list(r) for r in sched]
    done = tries = 0
    while done < k and tries < 50 * k:
        tries += 1
        cand = _moved(out, caps, rng)
        if cand is not None:
            out, done = cand, done + 1
    return out


def _moved(cur: Schedule, caps: list[int], rng: random.Random):
    """A copy of ``cur`` with one random op shifted, if that keeps its stage locally valid and
    within its cap (cross-stage cycles are caught by the caller's replay); else None."""
    move = _random_move(cur, rng)
    if move is None:
        return None
    s, i, j = move
    row = list(cur[s])
    row.insert(j, row.pop(i))
    if not _locally_valid(row) or peak_inflight([row])[0] > caps[s]:
        return None
    cand = list(cur)
    cand[s] = row
    return cand


def _random_move(cur: Schedule, rng: random.Random):
    s = rng.randrange(len(cur))
    i = rng.randrange(len(cur[s]))
    j = i + rng.choice(SHIFTS)
    return (s, i, j) if 0 <= j < len(cur[s]) else None


def _locally_valid(row: list[Op]) -> bool:
    """B m after F m, W m after B m, and per-kind micro-batch order kept (FIFO)."""
    seen_f, seen_b = set(), set()
    last = {"F": -1, "B": -1, "W": -1}
    for op in row:
        if op.mb < last[op.kind]:
            return False
        last[op.kind] = op.mb
        if op.kind == "F":
            seen_f.add(op.mb)
        elif op.kind == "B":
            if op.mb not in seen_f:
                return False
            seen_b.add(op.mb)
        elif op.mb not in seen_b:
            return False
    return True
