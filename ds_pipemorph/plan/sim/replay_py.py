"""The replay in pure Python: a fixed per-stage op order under given costs and link delays, event
by event.

This is what a runtime that follows a plan order experiences: each op starts when its stage is
free and its inputs have arrived (upstream F + link delay, downstream B + link delay, own B for W).
Event-driven over the dependency graph, so there is no time step and no discretisation error.
``plan.sim.native`` computes the same floats in C and checks itself against ``run_py``;
``plan.sim.simulate`` picks one of the two. ``run_orders`` is the core, with op times per op, link
delays that may change over time and a ``Progress`` to resume from: ordered dispatch in
``plan.sim.ready`` and the search's evaluator (``plan.sim.incremental``) run on it too.

Pure Python: no torch, no deepspeed, no numpy.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from ..ir.fused import fused_at
from ..ir.links import LinkModels, constant_curves
from ..ir.ops import KINDS, Schedule
from ..ir.profile import Costs, Durations, op_durations
from .link_queues import LinkQueues
from .timeline import Slot, StuckSchedule, stuck_message

_F, _B, _W = KINDS  # module globals: looking a member up on the enum class costs more, per op


def run_py(schedule: Schedule, costs: Costs, N: int, fused_backward: bool, slots: Optional[list],
           models: LinkModels):
    """The replay under ``costs``: (first start, last end, busy ms per stage); ``run_orders``.

    ``models``: per link its model (``plan.ir.links.per_link``), how messages queue on it
    (``link_queues.LinkQueues``).
    """
    S = len(schedule)
    if costs.stages != S:
        raise ValueError(f"costs are for {costs.stages} stages, the schedule has {S}")
    net = LinkQueues(models, S, constant_curves(costs.links))
    return run_orders(schedule, op_durations(costs, N), N, fused_backward, net, slots)


class Progress:
    """How far a replay of fixed orders got, what ``run_orders`` starts from and leaves behind.

    Per stage: the next position (``ptr``), when the stage is free, its busy ms, when each of its
    ops ended (``end[s][kind code][m]``), when the messages it sent arrive (``arr_f[s][m]``: the
    activation of F m at stage s+1; ``arr_b[s][m]``: the gradient of B m at stage s-1), and the
    fused backward holding it (``hold[s]``: (m, departure) of the gradient its W m waits for).
    With ``keep``, also per stage the start of the op at each position (``starts``) and the busy ms
    before each position and after the last (``cum``), from which a replay can be resumed.
    """

    __slots__ = ("ptr", "free", "busy", "end", "arr_f", "arr_b", "hold", "starts", "cum")

    def __init__(self, ptr, free, busy, end, arr_f, arr_b, hold, starts=None, cum=None):
        self.ptr, self.free, self.busy, self.end, self.arr_f, self.arr_b = ptr, free, busy, end, arr_f, arr_b
        self.hold, self.starts, self.cum = hold, starts, cum

    @classmethod
    def start(cls, S: int, N: int, keep: bool = False) -> "Progress":
        """Nothing run yet; ``keep``: with ``starts`` and ``cum``."""
        inf = float("inf")
        return cls([0] * S, [0.0] * S, [0.0] * S, [[[inf] * N for _ in range(3)] for _ in range(S)],
                   [[inf] * N for _ in range(S)], [[inf] * N for _ in range(S)], [None] * S,
                   [[] for _ in range(S)] if keep else None, [[0.0] for _ in range(S)] if keep else None)


def run_orders(schedule: Schedule, dur: Durations, N: int, fused_backward: bool, net: LinkQueues,
               slots: Optional[list], at: Optional[Progress] = None, bound: Optional[float] = None,
               work: Optional[list[float]] = None):
    """The replay's event-driven core: (first start, last end, busy ms per stage) of the ops it
    runs; ``slots``, if a list, gets each op's ``Slot`` in the order the replay runs them (each
    stage's in its order). ``dur[s][kind code][m]``: op times in ms; ``net``: the link queues
    messages go through. ``fused_backward``: a B whose W follows it (``plan.ir.fused``) sends its
    gradient when that W ends, and the stage waits for the send after the W.

    ``at``: the ``Progress`` to go on from (left where the replay ends); default: from the start.
    ``bound`` with ``work`` (per stage the ms of all its ops): None as soon as a stage's free time
    plus its work not run yet exceeds ``bound``.
    """
    S = len(schedule)
    send = net.send  # (arrival, sender free) of a message
    inf = float("inf")
    first, last_end = inf, 0.0
    at = at or Progress.start(S, N)
    end, arr_f, arr_b, hold, ptr, free, busy = at.end, at.arr_f, at.arr_b, at.hold, at.ptr, at.free, at.busy
    starts, cum = at.starts, at.cum
    queue = deque(range(S))
    queued = [True] * S
    last = S - 1

    while queue:
        s = queue.popleft()
        queued[s] = False
        row = schedule[s]
        es, ds = end[s], dur[s]
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
            d = ds[ki][m]
            fin = start + d
            es[ki][m] = fin
            blocked_until = fin
            if k is _F and s < last:
                arr_f[s][m], blocked_until = send(s, 0, fin)
            elif k is _B and s > 0:
                if fused_backward and fused_at(row, ptr[s]):
                    arr_b[s][m], depart = send(s, 1, fin + ds[2][m])
                    hold[s] = (m, depart)
                else:
                    arr_b[s][m], blocked_until = send(s, 1, fin)
            elif k is _W and hold[s] is not None and hold[s][0] == m:
                blocked_until = max(fin, hold[s][1])
                hold[s] = None
            free[s] = blocked_until if blocked_until > fin else fin
            busy[s] += d
            if bound is not None and free[s] + work[s] - busy[s] > bound:  # this stage alone runs past it
                return None
            if starts is not None:
                starts[s].append(start)
                cum[s].append(busy[s])
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
