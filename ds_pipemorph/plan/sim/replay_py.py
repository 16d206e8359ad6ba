"""The replay in pure Python: a fixed per-stage op order under given costs and link delays, event
by event.

This is what a runtime that follows a plan order experiences: each op starts when its stage is
free and its inputs have arrived (upstream F + link delay, downstream B + link delay, own B for W).
Event-driven over the dependency graph, so there is no time step and no discretisation error.
``plan.sim.native`` computes the same floats in C and checks itself against ``run_py``;
``plan.sim.simulate`` picks one of the two.

Pure Python: no torch, no deepspeed, no numpy.
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence, Union

from ..ir.fused import fused_at
from ..ir.links import LATENCY, Delegated, Direct, LinkModel, per_link
from ..ir.ops import KINDS, Schedule
from ..ir.profile import Costs
from .timeline import Slot, StuckSchedule, stuck_message

_F, _B, _W = KINDS  # module globals: looking a member up on the enum class costs more, per op


def run_py(schedule: Schedule, costs: Costs, N: int, fused_backward: bool, slots: Optional[list],
           link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY):
    """The replay's event-driven core: (first start, last end, busy ms per stage).

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
            if k is _F:
                ki = 0
                if s > 0:
                    ready = arr_f[s - 1][m]
                    if ready == inf:
                        break
                else:
                    ready = 0.0
            elif k is _B:
                ki = 1
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
                ki = 2
                ready = es[1][m]
                if ready == inf:
                    break
            start = free[s] if free[s] > ready else ready
            dur = times[s][ki]
            fin = start + dur
            es[ki][m] = fin
            blocked_until = fin
            if k is _F and s < last:
                arr_f[s][m], blocked_until = send(s, 0, fin, links[s])
            elif k is _B and s > 0:
                if fused_backward and fused_at(row, ptr[s]):
                    arr_b[s][m], depart = send(s, 1, fin + times[s][2], links[s - 1])
                    hold[s] = (m, depart)
                else:
                    arr_b[s][m], blocked_until = send(s, 1, fin, links[s - 1])
            elif k is _W and hold[s] is not None and hold[s][0] == m:
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
