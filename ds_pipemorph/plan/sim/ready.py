"""Readiness-driven dispatch (RRFP): a plan's order taken as a hint, replayed under varying times.

Two dispatch rules, each event-driven (no time step):

- ``ordered``: each stage runs its order as written; the next op waits until it is ready. This is
  the replay's own core (``replay_py.run_orders``), so with constant times it is ``simulate.replay``.
- ``ready``: the order is a non-binding hint. Whenever a stage is idle it starts, among its ops
  that are ready at that moment, the one listed first in its hint. ``F m`` is ready once its
  activation has arrived (stage 0: at once) and the stage holds fewer activations than its cap
  (F done, B not done: what ``ops.peak_inflight`` counts); ``B m`` once its own ``F m`` is
  done and its output gradient has arrived (the last stage needs no gradient); ``W m`` once its
  own ``B m`` is done. With ``patience`` (the default, as the engine runs it) a stage waits for
  the message of its hint's first op instead when that message is on its way and lands before
  the other op would end. The rule is the engine's own, ``plan.ir.ready_rule.ReadyRule``. Under caps
  >= 1 this never deadlocks, whatever the hint (``docs/ready_dispatch.md`` gives the argument).

Op times may differ per (stage, kind, micro-batch) (``op_times``, see ``plan.sim.variation``) and
link delays may change over time (``link_delays``: per link a constant or ``(time_ms, delay_ms)``
breakpoints; a message takes the delay in force when it departs; ``plan.sim.variation`` reads both
from files).

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Optional, Sequence, Union

from ..ir.fused import fused_at
from ..ir.links import LATENCY, Breakpoints, LinkModel, delay_curves, per_link
from ..ir.lower import Dispatch
from ..ir.ops import Kind, Op, Schedule, peak_inflight
from ..ir.profile import Costs, OpTimes, op_durations
from ..ir.ready_rule import ReadyRule
from .link_queues import LinkQueues
from .replay_py import run_orders
from .rows import row_problem
from .timeline import Slot, StuckSchedule, Timeline

LinkDelays = Sequence[Union[float, Breakpoints]]  # one entry per link


def replay_ready(hint: Schedule, costs: Costs, microbatches: int, *, caps: Optional[Sequence[int]] = None,
                 op_times: Union[OpTimes, Mapping, None] = None, link_delays: Optional[LinkDelays] = None,
                 fused_backward: bool = False,
                 link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY, patience: bool = True,
                 units: Optional[Sequence[float]] = None, w_share: float = 1.0) -> Timeline:
    """Ready dispatch with ``hint`` ranking the ready ops; ``caps`` per stage (default: no cap)."""
    return replay_varying(hint, costs, microbatches, dispatch=Dispatch.READY, caps=caps, op_times=op_times,
                          link_delays=link_delays, fused_backward=fused_backward, link_model=link_model,
                          patience=patience, units=units, w_share=w_share)


def replay_varying(schedule: Schedule, costs: Costs, microbatches: int, *,
                   dispatch: Union[Dispatch, str] = Dispatch.ORDERED, caps: Optional[Sequence[int]] = None,
                   op_times: Union[OpTimes, Mapping, None] = None, link_delays: Optional[LinkDelays] = None,
                   fused_backward: bool = False, link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY,
                   patience: bool = True, units: Optional[Sequence[float]] = None, w_share: float = 1.0) -> Timeline:
    """Replay ``schedule`` under ``dispatch`` ("ordered" or "ready"); raise StuckSchedule if it cannot run.

    ``op_times``: a callable ``(stage, kind, mb) -> ms`` or a mapping ``{(stage, kind, mb): ms}``
    (missing keys take the time of ``costs``); default ``costs``. ``link_delays``: per link a
    delay in ms or ``(time_ms, delay_ms)`` breakpoints; default ``costs.links``. ``caps`` bound
    the activations a stage holds under ready dispatch (an ordered replay follows its order, which
    sets its own peak). ``fused_backward`` and ``link_model`` are as in ``simulate.replay``; under
    ready dispatch a ``B m`` whose hint is followed by ``W m`` runs fused with it when it is that W's
    turn (``ReadyRule.w_in_turn``), else split from it. ``patience``:
    ready dispatch's patience (``ReadyRule.hold``), on as in the engine; off, the bare rule.
    ``units`` and ``w_share``: the memory budget per stage under ready dispatch (``plan.ir.memory``).
    Each of these is put in the one form the replay takes here, once: ``profile.op_durations``,
    ``links.delay_curves`` and ``links.per_link``.
    """
    S, N = len(schedule), microbatches
    dispatch = Dispatch.parse(dispatch)
    if costs.stages != S:
        raise ValueError(f"costs are for {costs.stages} stages, the schedule has {S}")
    problem = row_problem(schedule, N, ordered=False)  # a hint need not respect dependencies
    if problem is not None:
        raise ValueError(problem)
    cap = _caps(caps, S, N)
    dur = op_durations(costs, N, op_times)
    # N*(tF+tB+tW) per stage, the same floats as simulate.replay when the times are the costs'
    work = ([N * (costs.f[s] + costs.b[s] + costs.w[s]) for s in range(S)] if op_times is None
            else [sum(map(sum, dur[s])) for s in range(S)])
    models = per_link(link_model, S - 1)
    net = LinkQueues(models, S, delay_curves(costs.links if link_delays is None else link_delays, S - 1))
    if dispatch is Dispatch.ORDERED:
        slots: list[Slot] = []
        first, last, busy = run_orders(schedule, dur, N, fused_backward, net, slots)
        return Timeline(S, N, slots, last - first, busy, peak_inflight(schedule), work)
    return _Run(schedule, N, cap, dur, net, fused_backward, work, patience, units, w_share).run()


def _caps(caps: Optional[Sequence[int]], S: int, N: int) -> list[int]:
    if caps is None:
        return [N] * S
    out = list(caps)
    if len(out) != S:
        raise ValueError(f"caps: expected {S} values (one per stage), got {len(out)}")
    for s, c in enumerate(out):
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"caps: stage {s} must hold at least 1 activation, got {c!r}")
    return out


class _Run:
    """One replay under ready dispatch: per-stage state, the link queues, and a heap of (time,
    stage) wake-ups.

    A stage is looked at only when something of its own happens: it becomes free, or a message
    for it arrives (its own op ends never come later than it becomes free). At each wake-up an
    idle stage starts what its rule allows; an op's end, its messages' arrivals and the stage's
    next free time are known when it starts, and are pushed as wake-ups.
    """

    def __init__(self, schedule, N, cap, dur, net, fused, work, patience=True, units=None, w_share=1.0):
        S = len(schedule)
        self.rows, self.S, self.N, self.cap, self.dur, self.net = schedule, S, N, cap, dur, net
        self.pos = [{(op.kind.code, op.mb): i for i, op in enumerate(row)} for row in schedule]
        # fused[s][m]: B m runs fused with W m (the W right after it in the order / hint)
        self.fused = [[False] * N for _ in range(S)]
        if fused:
            for s, row in enumerate(schedule):
                for i, op in enumerate(row):
                    if fused_at(row, i):
                        self.fused[s][op.mb] = True
        self.free = [0.0] * S
        self.started = [[False] * (3 * N) for _ in range(S)]  # by hint position
        self.ptr = [0] * S  # the first position not started
        self.inflight = [0] * S
        self.peak = [0] * S
        self.busy = [0.0] * S
        self.slots: list[Slot] = []
        self.left = 3 * N * S
        self.wake: list[tuple[float, int]] = []
        # per stage the engine's rule, a heap of (arrival, kind, mb) of the messages on their way
        # to it and their arrival times by (kind, mb)
        self.rules = [ReadyRule(row, cap[s], needs_input=s > 0, needs_grad=s < S - 1,
                                units=None if units is None else units[s], w_share=w_share)
                      for s, row in enumerate(schedule)]
        self.patience = patience
        self.on_way = [[] for _ in range(S)]
        self.lands = [{} for _ in range(S)]
        self.work = work

    def run(self) -> Timeline:
        S = self.S
        for s in range(S):
            heapq.heappush(self.wake, (0.0, s))
        while self.wake:
            t, s = heapq.heappop(self.wake)
            self._dispatch(s, t)
        if self.left:
            raise StuckSchedule(self._stuck())
        first = min((x.start for x in self.slots), default=0.0)
        last = max((x.end for x in self.slots), default=0.0)
        return Timeline(S, self.N, self.slots, last - first, self.busy, self.peak, self.work)

    # -- readiness ------------------------------------------------------------------------------

    def _deliver(self, s: int, kind: str, m: int, t: float) -> None:
        """A message (kind Kind.F or Kind.B, micro-batch m) lands on stage s at ``t``; s wakes up then."""
        heapq.heappush(self.on_way[s], (t, kind, m))
        self.lands[s][(kind, m)] = t
        heapq.heappush(self.wake, (t, s))

    # -- dispatch -------------------------------------------------------------------------------

    def _dispatch(self, s: int, t: float) -> None:
        """Start what stage s may start at ``t`` (more than one op only when an op takes 0 ms)."""
        row = self.rows[s]
        while self.free[s] <= t and self.ptr[s] < len(row):
            i = self._pick(s, t)
            if i is None:
                return
            self._start(s, i, t)

    def _pick(self, s: int, t: float) -> Optional[int]:
        """The hint position of the op the rule starts at ``t`` (None: none, or it waits for a
        message that lands before that op would end, and the landing wakes the stage)."""
        rule, way, lands = self.rules[s], self.on_way[s], self.lands[s]
        while way and way[0][0] <= t:
            _, kind, m = heapq.heappop(way)
            del lands[(kind, m)]
            rule.arrive(kind, m)
        op = rule.pick()
        if op is None:
            return None
        k = op.kind.code
        if self.patience and rule.hold(op, t, self.dur[s][k][op.mb], lands.get) is not None:
            return None
        rule.started(op)
        if k == 1 and self.fused[s][op.mb]:
            if rule.w_in_turn(op.mb):  # W m runs with it (``_start``)
                rule.started(Op(Kind.W, op.mb))
            else:  # a W before it has not run: split, W m at its turn, the gradient leaves after B m
                self.fused[s][op.mb] = False
        return self.pos[s][(k, op.mb)]

    def _start(self, s: int, i: int, t: float) -> None:
        op = self.rows[s][i]
        k, m = op.kind.code, op.mb
        fin = self._slot(s, i, t)
        blocked = fin
        last = self.S - 1
        if k == 0:
            self.inflight[s] += 1
            if self.inflight[s] > self.peak[s]:
                self.peak[s] = self.inflight[s]
            if s < last:
                arr, blocked = self.net.send(s, 0, fin)
                self._deliver(s + 1, Kind.F, m, arr)
        elif k == 1:
            self.inflight[s] -= 1
            if self.fused[s][m]:  # W m runs right after, the gradient leaves when it ends
                j = self.pos[s][(2, m)]
                fin = self._slot(s, j, fin)
                blocked = fin
                if s > 0:
                    arr, depart = self.net.send(s, 1, fin)
                    blocked = depart if depart > fin else fin
            elif s > 0:
                arr, blocked = self.net.send(s, 1, fin)
            if s > 0:
                self._deliver(s - 1, Kind.B, m, arr)
        self.free[s] = blocked if blocked > fin else fin
        heapq.heappush(self.wake, (self.free[s], s))

    def _slot(self, s: int, i: int, start: float) -> float:
        """Run the op at hint position i of stage s from ``start``; its end."""
        op = self.rows[s][i]
        k = op.kind.code
        d = self.dur[s][k][op.mb]
        fin = start + d
        self.busy[s] += d
        self.slots.append(Slot(s, op, start, fin))
        self.started[s][i] = True
        self.left -= 1
        row_started = self.started[s]
        while self.ptr[s] < len(row_started) and row_started[self.ptr[s]]:
            self.ptr[s] += 1
        return fin

    def _stuck(self) -> str:
        for s in range(self.S):  # pragma: no cover - docs/ready_dispatch.md: cannot happen
            if self.ptr[s] < len(self.rows[s]):
                return (f"stage {s}: no op is ready and nothing is in flight "
                        f"({self.inflight[s]} activations held, cap {self.cap[s]})")
        return "schedule is stuck"  # pragma: no cover
