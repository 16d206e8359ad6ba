"""List scheduler (PipeMorph Alg. 3/4) as an event-driven simulation: no time step δ.

Each idle stage picks an op among those whose inputs have arrived: during warm-up only forwards
(x_s of them), then by priority (default B > F > W), never holding more than x_s activations.
Events are op completions and message arrivals, so times are exact.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

from .ops import Op
from .profile import Costs
from .simulate import Schedule


@dataclass(frozen=True)
class Policy:
    """Knobs of the greedy pass; the default is the paper's Alg. 3."""

    priority: str = "BFW"  # steady-phase order of kinds
    # Only start a W if it ends before the next B or F is expected to arrive (W fills gaps only).
    w_fits_gap: bool = False
    # Stages that keep their W for when they have no forward left (the rest fill gaps with W).
    late_w: frozenset = frozenset()


def list_schedule(costs: Costs, microbatches: int, warmup: list[int], policy: Policy = Policy()) -> Schedule:
    S, N = costs.stages, microbatches
    if len(warmup) != S:
        raise ValueError(f"warmup has {len(warmup)} values, expected {S}")
    times = [{"F": costs.f[s], "B": costs.b[s], "W": costs.w[s]} for s in range(S)]
    links = costs.links
    # Per stage: arrivals (ready_time, mb) for F and B; W available (ready, mb); each in mb order.
    f_arr: list[list[tuple[float, int]]] = [[] for _ in range(S)]
    b_arr: list[list[tuple[float, int]]] = [[] for _ in range(S)]
    w_arr: list[list[tuple[float, int]]] = [[] for _ in range(S)]
    arrivals = {"F": f_arr, "B": b_arr, "W": w_arr}
    for m in range(N):
        f_arr[0].append((0.0, m))
    free = [0.0] * S
    inflight = [0] * S
    f_done = [0] * S
    started = [0] * S
    out: Schedule = [[] for _ in range(S)]
    total = 3 * N
    remaining = total * S
    events: list[float] = [0.0]
    t = 0.0
    pri = policy.priority
    late_w, w_fits_gap = policy.late_w, policy.w_fits_gap
    eps = 1e-12

    while True:
        progressed = False
        now = t + eps
        for s in range(S):
            if started[s] >= total or free[s] > now:
                continue
            choice = None
            fa = f_arr[s]
            if f_done[s] < warmup[s]:
                if fa and fa[0][0] <= now:
                    choice = "F"
            else:
                ba, wa = b_arr[s], w_arr[s]
                can_b = bool(ba) and ba[0][0] <= now
                can_f = bool(fa) and fa[0][0] <= now and inflight[s] < warmup[s]
                can_w = bool(wa) and wa[0][0] <= now
                hold_w = s in late_w and f_done[s] < N
                for k in pri:
                    if k == "B":
                        if can_b:
                            choice = k
                            break
                    elif k == "F":
                        if can_f:
                            choice = k
                            break
                    elif can_w and not hold_w and not (
                            w_fits_gap and _w_blocks(s, t, times, f_arr, b_arr, inflight, warmup)):
                        choice = k
                        break
                if choice is None and can_w and not hold_w:
                    choice = "W"
            if choice is None:
                continue
            _, m = arrivals[choice][s].pop(0)
            end = t + times[s][choice]
            free[s] = end
            started[s] += 1
            remaining -= 1
            out[s].append(Op(choice, m))
            heapq.heappush(events, end)
            if choice == "F":
                inflight[s] += 1
                f_done[s] += 1
                if s < S - 1:
                    _insert(f_arr[s + 1], (end + links[s], m))
                    heapq.heappush(events, end + links[s])
                else:
                    _insert(b_arr[s], (end, m))
            elif choice == "B":
                inflight[s] -= 1
                _insert(w_arr[s], (end, m))
                if s > 0:
                    _insert(b_arr[s - 1], (end + links[s - 1], m))
                    heapq.heappush(events, end + links[s - 1])
            progressed = True
        if not remaining:
            return out
        # Advance to the next event strictly after t.
        while events and events[0] <= now:
            heapq.heappop(events)
        if not events:
            if progressed:
                continue
            raise RuntimeError(f"list scheduler stalled at t={t} with warm-up {warmup}")  # pragma: no cover
        t = heapq.heappop(events)


def _insert(lst: list[tuple[float, int]], item: tuple[float, int]) -> None:
    """Keep micro-batch (FIFO) order; ready times are non-decreasing per source in practice."""
    if not lst or lst[-1][1] < item[1]:
        lst.append(item)
    else:
        bisect.insort(lst, item, key=lambda x: x[1])


def _w_blocks(s, t, times, f_arr, b_arr, inflight, warmup) -> bool:
    """True if a W started now would still run when a pending B (or a usable F) arrives."""
    end = t + times[s]["W"]
    nxt = float("inf")
    if b_arr[s]:
        nxt = min(nxt, b_arr[s][0][0])
    if f_arr[s] and inflight[s] < warmup[s]:
        nxt = min(nxt, f_arr[s][0][0])
    return nxt < end - 1e-12
