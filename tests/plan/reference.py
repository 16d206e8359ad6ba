"""The planner's reference, for the tests: the list scheduler and the replay simulator in their
plainest form, against which the event-driven versions (``plan.sim.listsched_py``, ``plan.sim.replay_py``)
and the compiled core (``plan.sim.native``) are checked.

test_native.py asserts that every faster version gives the same schedules, the same timelines (times
equal to 1e-9) and the same errors as these, on many random cases. Slow, and written apart from
the code it checks: the list scheduler scans every stage at every event time, the replay sweeps
every stage until a sweep runs nothing, with its state in dictionaries keyed by op.
"""
from __future__ import annotations

import bisect
import heapq
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
    """The replay in its plainest form: (first start, last end, busy ms per stage).

    Sweep the stages in turn, again and again: each runs the next ops of its order for as long as
    their inputs are known, and the sweeps stop when one runs nothing. An op starts when its stage
    is free and its inputs are in: ``F m`` the activation from the stage before (stage 0: at 0),
    ``B m`` its own ``F m`` and the gradient from the stage after (the last stage: none), ``W m``
    its own ``B m``. A message handed to a link (``plan.ir.links``) at ``t``:

    - ``Latency()``, or any link of cost 0: arrives at ``t`` + cost; the sender goes on.
    - ``Direct()``: the link carries one message at a time, in the order they are handed to it;
      a message leaves when the link is free and the sender waits until it has left.
    - ``Delegated(k)``: the n-th message of a direction takes lane n % k, each lane one message
      at a time; the sender goes on.

    A fused backward (``W m`` right after ``B m``) hands the gradient over when ``W m`` ends.
    ``slots`` gets each op as it runs, stage by stage in each sweep.
    """
    S = len(schedule)
    if costs.stages != S:
        raise ValueError(f"costs are for {costs.stages} stages, the schedule has {S}")
    models = per_link(link_model, S - 1)
    duration = {"F": costs.f, "B": costs.b, "W": costs.w}
    end: dict = {}  # (stage, kind, mb) -> when the op ended
    message: dict = {}  # (receiving stage, kind of the sending op, mb) -> when it arrives
    lanes: dict = {}  # (link, direction) -> when each of its lanes is free
    handed: dict = {}  # (link, direction) -> messages handed to it so far
    nxt, free, busy = [0] * S, [0.0] * S, [0.0] * S
    starts, ends = [], []

    def hand_over(link: int, direction: int, t: float) -> tuple[float, float]:
        """(arrival, until when the sender waits) of a message handed to ``link`` at ``t``."""
        model, cost = models[link], costs.links[link]
        if cost <= 0 or not isinstance(model, (Direct, Delegated)):
            return t + cost, t
        key = (link, direction)
        lane_free = lanes.setdefault(key, [0.0] * (1 if isinstance(model, Direct) else model.queues))
        n = handed.get(key, 0)
        handed[key] = n + 1
        lane = n % len(lane_free)
        leaves = max(t, lane_free[lane])
        lane_free[lane] = leaves + cost
        return leaves + cost, (leaves if isinstance(model, Direct) else t)

    def inputs(s: int, kind: str, m: int) -> list:
        if kind == "F":
            return [] if s == 0 else [message.get((s, "F", m))]
        if kind == "B":
            return [end.get((s, "F", m))] + ([] if s == S - 1 else [message.get((s, "B", m))])
        return [end.get((s, "B", m))]

    ran = True
    while ran:
        ran = False
        for s in range(S):
            row = schedule[s]
            while nxt[s] < len(row):
                op = row[nxt[s]]
                kind, m = str(op.kind), op.mb
                need = inputs(s, kind, m)
                if None in need:
                    break
                start = max([free[s]] + need)
                fin = start + duration[kind][s]
                end[(s, kind, m)] = fin
                waits_until = fin
                fused = (kind == "B" and fused_backward and nxt[s] + 1 < len(row)
                         and row[nxt[s] + 1] == Op("W", m))
                if kind == "F" and s < S - 1:
                    message[(s + 1, "F", m)], waits_until = hand_over(s, 0, fin)
                elif kind == "B" and s > 0 and not fused:
                    message[(s - 1, "B", m)], waits_until = hand_over(s - 1, 1, fin)
                elif kind == "W" and s > 0 and fused_backward and nxt[s] > 0 and row[nxt[s] - 1] == Op("B", m):
                    message[(s - 1, "B", m)], waits_until = hand_over(s - 1, 1, fin)
                free[s] = max(fin, waits_until)
                busy[s] += duration[kind][s]
                starts.append(start)
                ends.append(fin)
                if slots is not None:
                    slots.append(Slot(s, op, start, fin))
                nxt[s] += 1
                ran = True
    if any(nxt[s] < len(schedule[s]) for s in range(S)):
        raise StuckSchedule(stuck_message(schedule, nxt, S))
    return min(starts, default=0.0), max(ends, default=0.0), busy
