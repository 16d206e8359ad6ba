"""Local improvement of a schedule, scored by the replay simulator (iterated local search).

A move takes one op of one stage to another place. Three kinds (weights ``MOVES``):

* critical: the critical path (read off the replay: each op started when its stage freed up or when
  its input arrived) holds runs of ops back to back on one stage; such a run only gets shorter if an
  op leaves it, so the last op of a run goes before an earlier one, an earlier one goes after the
  last, or a W of the run goes into an idle gap of its stage before the run. Each is tried once per
  current order; most improvements come from these (the gap moves took seed 1, case 28 of
  benchmarks/planner/planner_vs_milp.py from 1 to 19-20 of 20 one-second runs optimal);
* a W anywhere between its B and its neighbouring Ws (a W feeds nothing: it can fill any gap);
* any op by up to two places (random; the plateau walk needs them).

A move is kept when the order stays valid (per-kind micro-batch order, B after F, W after B, within
the caps; a cycle between stages shows in the replay) and the replay is at most a random threshold
slower (Metropolis at ``TEMP`` times the best time: equal scores walk the plateaus, small uphill
steps cross between basins). After ``STALL`` moves without a new best the search restarts from the
best order kicked by ``KICK`` random moves. Replays are incremental (``incremental.Evaluator``).
"""
from __future__ import annotations

import random
import time
from bisect import bisect_right
from typing import Callable, Optional

from ..ir.ops import KINDS, Op, Schedule
from ..sim.incremental import Evaluator, State
from ..sim.timeline import StuckSchedule

_F, _B, _W = KINDS  # module globals: looking a member up on the enum class costs more, per op

EPS = 1e-9
STALL = 400  # moves without a new best before a restart
SHIFTS = (-2, -1, 1, 2)  # how far a random move shifts an op
KICK = 3  # random moves applied to the best order at a restart (iterated local search)
# Critical, W-anywhere and random moves; temperature as a fraction of the best time. Chosen on the
# MILP benchmark's hardest cases (1 CPU-s each): 0.5/0.2/0.3 and 0.004 beat 0.3-0.7 critical,
# no W moves, no random moves, and temperatures 0, 0.0005, 0.002 and 0.008.
MOVES = (0.5, 0.2, 0.3)
TEMP = 0.004
TOL = 1e-7  # ms: an op started when its predecessor ended
IDLE = 10_000  # invalid proposals in a row after which the order counts as having no move


def improve(
    best: Schedule,
    caps: list[int],
    deadline: float,
    seed: int,
    stop: Callable[[], bool],
    ev: Evaluator,
    lower_bound: float,
) -> tuple[Schedule, float, bool]:
    """The best order found from ``best`` (raises StuckSchedule if ``best`` cannot run)."""
    rng = random.Random(seed)
    cur = [list(r) for r in best]
    state = ev.full(cur)
    cur_t = best_t = state.t
    temp = TEMP * best_t
    total = sum(MOVES)
    moved = False
    stall = 0
    critical: Optional[list] = None  # untried critical moves of ``cur``
    idle = 0  # proposals in a row that were not valid (a forced order has no valid move at all)
    while time.perf_counter() < deadline and cur_t > lower_bound + EPS and not stop() and idle < IDLE:
        idle += 1
        u = rng.random() * total
        kind = 0 if u < MOVES[0] else 1 if u < MOVES[0] + MOVES[1] else 2
        if kind == 0:
            if critical is None:
                critical = [mv for mv in sorted(set(_critical_moves(cur, state, ev))) if _allowed(cur, caps, mv)]
                rng.shuffle(critical)
            if critical:
                move = critical.pop()
            else:
                kind = 1 if rng.random() * (total - MOVES[0]) < MOVES[1] else 2
        if kind:
            move = _w_move(cur, rng) if kind == 1 else _shift(cur, rng)
            if move is None or not _allowed(cur, caps, move):
                continue
        s, i, j = move
        row = list(cur[s])
        row.insert(j, row.pop(i))
        cand = list(cur)
        cand[s] = row
        try:
            nxt = ev.delta(state, cur, cand, s, min(i, j), cur_t + rng.expovariate(1.0) * temp + EPS)
        except StuckSchedule:
            continue
        stall, idle = stall + 1, 0
        if nxt is not None:
            cur, cur_t, state, critical = cand, nxt.t, nxt, None
            if cur_t < best_t - EPS:
                best, best_t, moved, stall = [list(r) for r in cur], cur_t, True, 0
        if stall > STALL:  # restart from a perturbed copy of the best
            cur = _perturb(best, caps, rng, KICK)
            try:
                state = ev.full(cur)
            except StuckSchedule:
                cur = [list(r) for r in best]
                state = ev.full(cur)
            cur_t, critical, stall = state.t, None, 0
    return best, best_t, moved


def _critical_moves(cur: Schedule, state: State, ev: Evaluator) -> list[tuple[int, int, int]]:
    """Moves (stage, from, to) that take an op out of a back-to-back run on the critical path."""
    S, st, dur, links = len(cur), ev.starts(state, cur), ev.dur, ev.links
    s = max(range(S), key=lambda x: st[x][-1] + dur[x][cur[x][-1].kind])
    i = q = len(cur[s]) - 1
    moves = []
    gaps: dict[int, list[int]] = {}  # per stage, the places that follow an idle gap
    while True:
        row = cur[s]
        t = st[s][i]
        if i > 0 and abs(st[s][i - 1] + dur[s][row[i - 1].kind] - t) < TOL:
            i -= 1  # the run goes on: this op waited for its stage
            continue
        for j in range(i, q):
            moves.append((s, q, j))
            moves.append((s, j, q))
        for j in range(i, q + 1):
            if row[j].kind is _W:  # into an idle gap before the run (after its B): it may fit there
                if s not in gaps:
                    gaps[s] = [g for g in range(1, len(row)) if st[s][g] > st[s][g - 1] + dur[s][row[g - 1].kind] + TOL]
                g = gaps[s]
                lo = bisect_right(g, row.index(Op(_B, row[j].mb)))
                moves.extend((s, j, h) for h in g[lo : bisect_right(g, i)])
        k, m, _ = row[i]
        if k is _F:
            sources = [(s - 1, _F, links[s - 1])] if s > 0 else []
        elif k is _B:
            sources = [(s, _F, 0.0)] + ([(s + 1, _B, links[s])] if s < S - 1 else [])
        else:
            sources = [(s, _B, 0.0)]
        for s2, k2, c in sources:  # the input this op waited for
            j = cur[s2].index(Op(k2, m))
            if abs(st[s2][j] + dur[s2][k2] + c - t) < TOL:
                s, i = s2, j
                q = i
                break
        else:
            return moves


def _allowed(cur: Schedule, caps: list[int], move: tuple[int, int, int]) -> bool:
    """Moving op i to place j keeps per-kind FIFO, F m < B m < W m and the stage's cap."""
    s, i, j = move
    row = cur[s]
    k, m, _ = row[i]
    if j > i:
        for k2, m2, _ in row[i + 1 : j + 1]:
            if k2 == k or (m2 == m and (k is _F or (k is _B and k2 is _W))):
                return False
    else:
        for k2, m2, _ in row[j:i]:
            if k2 == k or (m2 == m and (k is _W or (k is _B and k2 is _F))):
                return False
    if not ((k is _F and j < i) or (k is _B and j > i)):
        return True  # only an earlier F or a later B holds more activations
    r = list(row)
    r.insert(j, r.pop(i))
    held = 0
    for k2, _, _ in r:
        held += (k2 is _F) - (k2 is _B)
        if held > caps[s]:
            return False
    return True


def _shift(cur: Schedule, rng: random.Random):
    s = rng.randrange(len(cur))
    i = rng.randrange(len(cur[s]))
    j = i + rng.choice(SHIFTS)
    return (s, i, j) if 0 <= j < len(cur[s]) else None


def _w_move(cur: Schedule, rng: random.Random):
    """A random W to a random place after its B, between its neighbouring Ws."""
    s = rng.randrange(len(cur))
    row = cur[s]
    n = len(row) // 3
    m = rng.randrange(n)
    i = row.index(Op(_W, m))
    lo = max(row.index(Op(_B, m)), row.index(Op(_W, m - 1)) if m else -1) + 1
    hi = row.index(Op(_W, m + 1)) - 1 if m + 1 < n else len(row) - 1  # places in the row without op i
    j = rng.randint(lo, hi)
    return (s, i, j) if j != i else None


def _perturb(sched: Schedule, caps: list[int], rng: random.Random, k: int) -> Schedule:
    out = [list(r) for r in sched]
    done = tries = 0
    while done < k and tries < 50 * k:
        tries += 1
        move = _shift(out, rng)
        if move is not None and _allowed(out, caps, move):
            s, i, j = move
            out[s].insert(j, out[s].pop(i))
            done += 1
    return out
