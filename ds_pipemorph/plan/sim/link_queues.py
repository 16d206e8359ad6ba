"""The messages on a pipeline's links, queued as each link's model says (``plan.ir.links``): when a
message arrives and when its sender is free again. The Python replays (``replay_py``, ``ready``)
send through it; the compiled core (``plancore.c``) is its twin.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from bisect import bisect_right

from ..ir.links import Delegated, Direct, LinkCurves, LinkModels


class LinkQueues:
    """The queues of every link, both directions, of a pipeline of ``stages`` stages.

    ``models``: per link its model (``links.per_link``); ``curves``: per link its ``(time_ms,
    delay_ms)`` breakpoints (``links.delay_curves``, ``links.constant_curves``; a message takes the
    delay in force when it departs). ``Direct()``: one FIFO per direction holding one message
    in flight: a message departs when the one before it has arrived, and its sender is blocked
    until then. ``Delegated(k)``: k FIFOs per direction, message n of a direction travels in FIFO
    n % k (as the delegated transport sends them), and the sender never waits. ``Latency()``, or a
    link whose delay is a constant 0: a message arrives its delay after it was sent.
    """

    __slots__ = ("const", "times", "curves", "fifo", "queues", "fifo_free", "lane_free", "lane_next")

    def __init__(self, models: LinkModels, stages: int, curves: LinkCurves):
        # per link its constant delay, None where it changes over time
        self.const = [curve[0][1] if len(curve) == 1 else None for curve in curves]
        self.curves = curves
        self.times = [[p[0] for p in curve] for curve in curves]
        self.fifo = [isinstance(h, Direct) for h in models]
        self.queues = [h.queues if isinstance(h, Delegated) else 0 for h in models]
        self.fifo_free = [[0.0, 0.0] for _ in range(stages)]  # per sending stage: [down, up]
        self.lane_free = [[[0.0] * max(q, 1) for q in self.queues] for _ in range(2)]  # [direction][link][fifo]
        self.lane_next = [[0] * (stages - 1) for _ in range(2)]  # [direction][link]: the next message's number

    def send(self, s: int, d: int, t_send: float) -> tuple[float, float]:
        """(arrival, the time the sender is free again) of a message stage ``s`` sends at ``t_send``
        in direction ``d`` (0: activation down, 1: gradient up)."""
        link = s - d
        c = self.const[link]
        if c is None or c > 0:
            if self.fifo[link]:
                free = self.fifo_free[s]
                depart = t_send if t_send > free[d] else free[d]
                if c is None:
                    c = self.delay(link, depart)
                free[d] = depart + c
                return depart + c, depart
            q = self.queues[link]
            if q:
                n = self.lane_next[d][link]
                self.lane_next[d][link] = n + 1
                lane = self.lane_free[d][link]
                i = n % q
                depart = t_send if t_send > lane[i] else lane[i]
                if c is None:
                    c = self.delay(link, depart)
                lane[i] = depart + c
                return depart + c, t_send
            if c is None:
                c = self.delay(link, t_send)
        return t_send + c, t_send

    def delay(self, link: int, t: float) -> float:
        """The delay of ``link`` for a message departing at ``t``."""
        c = self.const[link]
        if c is not None:
            return c
        i = bisect_right(self.times[link], t) - 1
        return self.curves[link][max(i, 0)][1]
