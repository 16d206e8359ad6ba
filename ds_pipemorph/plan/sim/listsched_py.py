"""List scheduler (PipeMorph Alg. 3/4) in pure Python, as an event-driven simulation: no time step δ.

Each idle stage picks an op among those whose inputs have arrived: during warm-up only forwards
(x_s of them), then by priority (default B > F > W), never holding more than x_s activations.
Events are op completions and message arrivals, so times are exact. ``plan.sim.native`` computes the
same schedule in C and checks itself against ``list_schedule_py``; ``plan.sched.listsched`` picks one of
the two.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Optional

from ..ir.memory import EPS as MEM_EPS
from ..ir.ops import Kind, Schedule, op_table
from ..ir.profile import Costs


@dataclass(frozen=True)
class Policy:
    """Knobs of the greedy pass; the default is the paper's Alg. 3."""

    priority: str = "BFW"  # steady-phase order of kinds, as their texts (each a Kind)
    # Only start a W if it ends before the next B or F is expected to arrive (W fills gaps only).
    w_fits_gap: bool = False
    # Stages that keep their W for when they have no forward left (the rest fill gaps with W).
    late_w: frozenset = frozenset()
    # Activation memory per stage (``plan.ir.memory``), in micro-batches' activations: an F or a B
    # starts only if the micro-batches held between F and B, plus ``w_share`` for each held between
    # B and W, stay within it after it; else a pending W runs first (a B with no W pending always
    # may). None: no limit but the warm-up caps.
    units: Optional[tuple] = None
    w_share: float = 1.0


def list_schedule_py(costs: Costs, microbatches: int, warmup: list[int], policy: Policy = Policy()) -> Schedule:
    """The pure-Python list scheduler: the reference form of the greedy pass (the tests' oracle,
    ``tests/plan/reference.py``), made event-driven per stage.

    The reference visits every stage, in stage order, at every event time (a *sweep*); a stage
    acts at most once per sweep. A stage that could not act at one sweep can act at a later one
    only after something of its own changed, and every such change comes with an event of that
    stage: its op ends (it is free; its W, or on the last stage its B, is ready), or a message for
    it arrives. So here each event names its stage, and a sweep visits only the stages with an
    event up to it, still in stage order; events no later than the sweep's own time (zero op
    times or delays) are visible at once to the stages the sweep has yet to visit, as in the
    reference, and otherwise at the next sweep. Visiting a stage that cannot act changes nothing,
    so the same ops start at the same sweeps: the same schedule, the same errors.
    """
    S, N = costs.stages, microbatches
    if len(warmup) != S:
        raise ValueError(f"warmup has {len(warmup)} values, expected {S}")
    dur = [(costs.f[s], costs.b[s], costs.w[s]) for s in range(S)]
    links = costs.links
    # Per stage and kind (0 F arrived, 1 B arrived, 2 W available): ready times and micro-batches
    # in micro-batch order, from position head on.
    qt = [[[], [], []] for _ in range(S)]
    qm = [[[], [], []] for _ in range(S)]
    qh = [[0, 0, 0] for _ in range(S)]
    if S:
        qt[0][0], qm[0][0] = [0.0] * N, list(range(N))
    free = [0.0] * S
    inflight = [0] * S
    pend_w = [0] * S  # B done, W not yet
    units = policy.units
    if units is not None:
        if len(units) != S:
            raise ValueError(f"policy.units has {len(units)} values, expected {S}")
        for s in range(S):
            if warmup[s] > units[s] + MEM_EPS:
                raise ValueError(f"stage {s}: warm-up {warmup[s]} exceeds its memory of {units[s]:.6g} micro-batches")
    share = policy.w_share
    f_done = [0] * S
    started = [0] * S
    out: Schedule = [[] for _ in range(S)]
    ops = op_table(N)[0] if N > 0 else ()
    total = 3 * N
    remaining = total * S
    pri = [Kind(k).code for k in policy.priority]  # "BFW" -> [1, 0, 2]
    late = [s in policy.late_w for s in range(S)]
    w_fits_gap = policy.w_fits_gap
    default = pri == [1, 0, 2] and not w_fits_gap  # B > F > W: the loop below in one expression
    eps = 1e-12
    heap: list[tuple[float, int]] = []  # (time, stage) of events after the current sweep
    push, pop = heapq.heappush, heapq.heappop
    nxt = set(range(S))  # stages to visit at the next sweep whatever the events
    t = 0.0

    def insert(s: int, k: int, r: float, m: int) -> None:
        ts, ms = qt[s][k], qm[s][k]
        if len(ms) == qh[s][k] or ms[-1] < m:
            ts.append(r)
            ms.append(m)
        else:
            j = bisect.bisect_right(ms, m, qh[s][k])
            ts.insert(j, r)
            ms.insert(j, m)

    while True:
        now = t + eps
        while heap and heap[0][0] <= now:
            nxt.add(pop(heap)[1])
        order = sorted(nxt) if len(nxt) > 1 else list(nxt)
        nxt = set()
        progressed = False
        i = 0
        while i < len(order):
            s = order[i]
            i += 1
            if started[s] >= total or free[s] > now:
                continue
            ts, ms, hs = qt[s], qm[s], qh[s]
            h = hs[0]
            q = ts[0]
            ready_f = h < len(q) and q[h] <= now
            choice = -1
            if f_done[s] < warmup[s]:
                if ready_f:
                    choice = 0
            else:
                h = hs[1]
                q = ts[1]
                can_b = h < len(q) and q[h] <= now
                can_f = ready_f and inflight[s] < warmup[s]
                mem_full = False
                if units is not None:  # what F and B would hold: room for it, or a W first
                    held = inflight[s] + share * pend_w[s]
                    if can_f and held + 1 > units[s] + MEM_EPS:
                        can_f, mem_full = False, True
                    if can_b and pend_w[s] and held - 1 + share > units[s] + MEM_EPS:
                        can_b, mem_full = False, True
                h = hs[2]
                q = ts[2]
                can_w = h < len(q) and q[h] <= now and (mem_full or not (late[s] and f_done[s] < N))
                if default:
                    choice = 1 if can_b else 0 if can_f else 2 if can_w else -1
                else:
                    for k in pri:
                        if k == 1:
                            if can_b:
                                choice = 1
                                break
                        elif k == 0:
                            if can_f:
                                choice = 0
                                break
                        elif can_w and not (w_fits_gap and not mem_full
                                            and _w_blocks_q(s, t, dur, qt, qh, inflight, warmup)):
                            choice = 2
                            break
                    if choice < 0 and can_w:
                        choice = 2
            if choice < 0:
                continue
            h = hs[choice]
            m = ms[choice][h]
            hs[choice] = h + 1
            end = t + dur[s][choice]
            free[s] = end
            started[s] += 1
            remaining -= 1
            out[s].append(ops[choice * N + m])
            if end <= now:
                nxt.add(s)
            else:
                push(heap, (end, s))
            progressed = True
            if choice == 0:
                inflight[s] += 1
                f_done[s] += 1
                if s < S - 1:
                    r = end + links[s]
                    insert(s + 1, 0, r, m)
                    if r <= now:  # the next stage sees it in this very sweep, as in the reference
                        nxt.add(s + 1)
                        if i >= len(order) or order[i] != s + 1:
                            order.insert(i, s + 1)
                    else:
                        push(heap, (r, s + 1))
                else:
                    insert(s, 1, end, m)
            elif choice == 1:
                inflight[s] -= 1
                pend_w[s] += 1
                insert(s, 2, end, m)
                if s > 0:
                    r = end + links[s - 1]
                    insert(s - 1, 1, r, m)
                    if r <= now:
                        nxt.add(s - 1)
                    else:
                        push(heap, (r, s - 1))
            else:
                pend_w[s] -= 1
        if not remaining:
            return out
        if not heap:
            if progressed:
                continue
            raise RuntimeError(f"list scheduler stalled at t={t} with warm-up {warmup}")  # pragma: no cover
        t = heap[0][0]


def _w_blocks_q(s, t, dur, qt, qh, inflight, warmup) -> bool:
    """True if a W started now would still run when a pending B (or a usable F) arrives."""
    end = t + dur[s][2]
    nxt = float("inf")
    h = qh[s]
    if h[1] < len(qt[s][1]):
        nxt = min(nxt, qt[s][1][h[1]])
    if h[0] < len(qt[s][0]) and inflight[s] < warmup[s]:
        nxt = min(nxt, qt[s][0][h[0]])
    return nxt < end - 1e-12
