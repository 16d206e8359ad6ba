"""The planner's reference, for the tests: the list scheduler and the replay simulator in their
plainest form, against which the event-driven versions (``plan.sim.listsched_py``, ``plan.sim.replay_py``)
and the compiled core (``plan.sim.native``) are checked.

test_native.py asserts that every faster version gives the same schedules, the same timelines (times
equal to 1e-9) and the same errors as these, on many random cases. Slow: the list scheduler scans
every stage at every event time.
"""
from __future__ import annotations

import bisect
import heapq
from collections import deque
from typing import Optional, Sequence, Union

from ds_pipemorph.plan.ir.links import LATENCY, Delegated, Direct, LinkModel, per_link
from ds_pipemorph.plan.ir.ops import Op, Schedule, peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sim.listsched_py import Policy
from ds_pipemorph.plan.sim.timeline import Slot, StuckSchedule, Timeline, stuck_message


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




_KIDX = {"F": 0, "B": 1, "W": 2}


def replay(schedule: Schedule, costs: Costs, microbatches: int, fused_backward: bool = False,
           link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY) -> Timeline:
    """Run the orders as fast as dependencies allow; raise StuckSchedule naming the stuck op.

    ``fused_backward`` models DeepSpeed's ``BackwardPass``: where ``W m`` directly follows ``B m``,
    the input gradient leaves the stage only when that W ends (stock DeepSpeed sends after the
    whole backward). ``link_model`` (one for all links, or one per link) says how messages queue
    on a link (``plan.ir.links``).
    """
    S, N = len(schedule), microbatches
    slots: list[Slot] = []
    t0, t1, busy = _run(schedule, costs, N, fused_backward, slots, link_model)
    work = [N * (costs.f[s] + costs.b[s] + costs.w[s]) for s in range(S)]
    return Timeline(S, N, slots, t1 - t0, busy, peak_inflight(schedule), work)


def makespan(schedule: Schedule, costs: Costs, microbatches: int, fused_backward: bool = False,
             link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY) -> float:
    """``replay(...).iteration_ms`` without building the timeline (the search's inner loop)."""
    t0, t1, _ = _run(schedule, costs, microbatches, fused_backward, None, link_model)
    return t1 - t0


def _run(schedule: Schedule, costs: Costs, N: int, fused_backward: bool, slots: Optional[list],
         link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY):
    """Event-driven core of ``replay``: (first start, last end, busy ms per stage).

    ``link_model`` (one, or one per link; ``plan.ir.links``): ``Direct()`` is one FIFO holding one
    message in flight: a message departs when the previous one has arrived, and its sender is
    blocked until then. ``Delegated(k)`` is k independent FIFOs (message n of a direction travels
    in FIFO n % k, as the delegated transport sends them), and the sender never waits.
    ``Latency()``: a message arrives c after it was sent.
    """
    S = len(schedule)
    if costs.stages != S:
        raise ValueError(f"costs are for {costs.stages} stages, the schedule has {S}")
    model = per_link(link_model, S - 1)
    fifo = [isinstance(h, Direct) for h in model]  # direct: one message in flight, the sender blocks
    queues = [h.queues if isinstance(h, Delegated) else 0 for h in model]  # delegated: k FIFOs
    qfree = [[[0.0] * max(q, 1) for q in queues] for _ in range(2)]  # [direction][link][fifo]
    qnext = [[0] * (S - 1) for _ in range(2)]  # [direction][link]: the next message's number
    inf = float("inf")
    first, last_end = inf, 0.0
    end = [[[inf] * N for _ in range(3)] for _ in range(S)]  # end[s][kind][m]
    arr_f = [[inf] * N for _ in range(S)]  # arrival at stage s+1 of the activation of F m on s
    arr_b = [[inf] * N for _ in range(S)]  # arrival at stage s-1 of the gradient of B m on s
    link_free = [[0.0, 0.0] for _ in range(S)]  # per stage: [downstream, upstream] FIFO free at
    hold = [None] * S  # fused backward: (m, departure) blocking the stage after its W m
    times = [(costs.f[s], costs.b[s], costs.w[s]) for s in range(S)]
    links = costs.links
    ptr = [0] * S
    free = [0.0] * S
    busy = [0.0] * S
    queue = deque(range(S))
    queued = [True] * S
    last = S - 1

    def send(s: int, d: int, t_send: float, c: float) -> tuple[float, float]:
        """(arrival, departure) of a message stage s sends at t_send in direction d (0 down, 1 up)."""
        link = s - d
        if c > 0 and fifo[link]:
            depart = t_send if t_send > link_free[s][d] else link_free[s][d]
            link_free[s][d] = depart + c
            return depart + c, depart
        if c > 0 and queues[link]:
            n = qnext[d][link]
            qnext[d][link] = n + 1
            lane = qfree[d][link]
            i = n % queues[link]
            depart = t_send if t_send > lane[i] else lane[i]
            lane[i] = depart + c
            return depart + c, t_send
        return t_send + c, t_send

    while queue:
        s = queue.popleft()
        queued[s] = False
        row = schedule[s]
        es = end[s]
        progressed = False
        while ptr[s] < len(row):
            op = row[ptr[s]]
            k, m = op.kind, op.mb
            if k == "F":
                if s > 0:
                    ready = arr_f[s - 1][m]
                    if ready == inf:
                        break
                else:
                    ready = 0.0
            elif k == "B":
                ready = es[0][m]
                if ready == inf:
                    break
                if s < last:
                    r = arr_b[s + 1][m]
                    if r == inf:
                        break
                    if r > ready:
                        ready = r
            else:
                ready = es[1][m]
                if ready == inf:
                    break
            start = free[s] if free[s] > ready else ready
            dur = times[s][_KIDX[k]]
            fin = start + dur
            es[_KIDX[k]][m] = fin
            blocked_until = fin
            if k == "F" and s < last:
                arr_f[s][m], blocked_until = send(s, 0, fin, links[s])
            elif k == "B" and s > 0:
                nxt = ptr[s] + 1
                if fused_backward and nxt < len(row) and row[nxt] == Op("W", m):
                    arr_b[s][m], depart = send(s, 1, fin + times[s][2], links[s - 1])
                    hold[s] = (m, depart)
                else:
                    arr_b[s][m], blocked_until = send(s, 1, fin, links[s - 1])
            elif k == "W" and hold[s] is not None and hold[s][0] == m:
                blocked_until = max(fin, hold[s][1])
                hold[s] = None
            free[s] = blocked_until if blocked_until > fin else fin
            busy[s] += dur
            if start < first:
                first = start
            if fin > last_end:
                last_end = fin
            if slots is not None:
                slots.append(Slot(s, op, start, fin))
            ptr[s] += 1
            progressed = True
        if progressed:
            for nb in (s - 1, s + 1):
                if 0 <= nb < S and not queued[nb] and ptr[nb] < len(schedule[nb]):
                    queued[nb] = True
                    queue.append(nb)
    for s in range(S):
        if ptr[s] < len(schedule[s]):
            raise StuckSchedule(stuck_message(schedule, ptr, S))
    return (0.0 if first == inf else first), last_end, busy


