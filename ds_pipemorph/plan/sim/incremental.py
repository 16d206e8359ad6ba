"""Replays for the local search: only what a move can change is run again.

A move reorders one stage from position ``lo`` on; let T0 be when the op at ``lo`` started. Every op
that started before T0 keeps its start: it waited only for ops that ended before it started, and
none of the reordered ops did (they all start at T0 or later), by induction over start times as
long as op times are positive. So ``delta`` keeps the replay up to T0, runs the rest, and gives up
as soon as some stage cannot finish within ``limit`` (its free time plus its remaining work).

It runs on the replay's own core (``replay_py.run_orders``), resumed from a ``Progress``, so the
same times as ``simulate.replay``. Link models that queue messages (``Direct``, ``Delegated``) or
zero op times fall back to full replays.

With the compiled core (``plan.sim.native``) every replay is a full one in C, faster than the Python
resumption: the same times, starts and verdicts (above ``limit`` or not). Rows are encoded for it
once and reused while they stay equal (the search changes one row per move).
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from typing import Optional

from ..ir.links import Latency, LinkModels, constant_curves
from ..ir.ops import KINDS, Schedule, op_table
from ..ir.profile import Costs, op_durations
from . import native
from .link_queues import LinkQueues
from .replay_py import Progress, run_orders
from .simulate import makespan, replay
from .timeline import StuckSchedule, stuck_message

_F, _B, _W = KINDS  # module globals: looking a member up on the enum class costs more, per op

INF = float("inf")
SLACK = 1e-6  # ms: the early stop's sum of remaining work may round above the replay's own sum


class State:
    """A replayed order: iteration time ``t`` and, per stage, the start of the op at each position
    (``Evaluator.starts``), plus the ``Progress`` ``delta`` resumes from (None: it replays in full)."""

    __slots__ = ("t", "starts", "progress")

    def __init__(self, t: float, starts, progress: Optional[Progress] = None):
        self.t, self.starts, self.progress = t, starts, progress


class Evaluator:
    """Replays orders for one profile and counts them (``evals``): the search's only cost model.
    ``link_model``: per link its model (``plan.ir.links.per_link``)."""

    def __init__(self, costs: Costs, microbatches: int, link_model: LinkModels):
        S, N = costs.stages, microbatches
        self.costs, self.S, self.N = costs, S, N
        self.link_model = link_model
        self.dur = [{_F: costs.f[s], _B: costs.b[s], _W: costs.w[s]} for s in range(S)]
        self.links = list(costs.links)
        self.total = [N * (costs.f[s] + costs.b[s] + costs.w[s]) for s in range(S)]
        self.times = op_durations(costs, N)  # [s][kind code][m]
        self.net = LinkQueues(self.link_model, S, constant_curves(self.links))  # keeps no state under pure latency
        latency_only = all(isinstance(h, Latency) or c <= 0 for h, c in zip(self.link_model, costs.links))
        self.incremental = latency_only and min(costs.f + costs.b + costs.w) > 0  # else full replays
        self.evals = 0
        self.native = native.lib() is not None and N >= 1
        self._rows: dict[int, tuple] = {}  # id(row) -> (row, copy, codes): encodings of recent rows

    def encode(self, sched: Schedule):
        """``native.encode(sched)``, reusing the codes of rows seen before (checked equal)."""
        get = op_table(self.N)[1].get
        codes, lens, rows = array("i"), array("i"), self._rows
        if len(rows) > 16 * self.S:
            rows.clear()
        for row in sched:
            hit = rows.get(id(row))
            if hit is not None and hit[0] is row and hit[1] == row:  # equal: same ops, mostly the same objects
                rc = hit[2]
            else:
                try:
                    rc = array("i", map(get, row))
                except (TypeError, OverflowError):
                    return None
                rows[id(row)] = (row, list(row), rc)
            codes.extend(rc)
            lens.append(len(rc))
        return lens, codes

    def _native(self, sched: Schedule, enc=None, limit: Optional[float] = None, positions: bool = False):
        """(rc, t, starts): a full replay in C; rc 2 if above ``limit``. None if it cannot run there."""
        if len(sched) != self.S:
            return None
        enc = enc or self.encode(sched)
        if enc is None:
            return None
        got = native.replay(enc, self.costs, self.N, False, self.link_model,
                            limit=None if limit is None or limit == INF else limit, positions=positions)
        if got is None:
            return None
        rc, first, last, _, ptr, _, pos = got
        if rc == 1:
            raise StuckSchedule(stuck_message(sched, ptr, self.S))
        starts = None
        if positions:
            flat, starts, o = pos.tolist(), [], 0
            for n in enc[0]:
                starts.append(flat[o:o + n])
                o += n
        return rc, last - first, starts

    def time(self, sched: Schedule, enc=None) -> float:
        """Iteration time of ``sched`` (raises StuckSchedule); ``enc``: its encoding, if known."""
        if self.native:
            got = self._native(sched, enc)
            if got is not None:
                self.evals += 1
                return got[1]
        if not self.incremental:
            self.evals += 1
            return makespan(sched, self.costs, self.N, link_model=self.link_model)
        return self.full(sched).t

    def full(self, sched: Schedule, limit: float = INF) -> Optional[State]:
        """The replay of ``sched``; None if it takes longer than ``limit``."""
        S, N = self.S, self.N
        if self.native and self.incremental:
            got = self._native(sched, limit=limit, positions=True)
            if got is not None:
                self.evals += 1
                return None if got[0] == 2 else State(got[1], got[2])
        if not self.incremental:
            t = self.time(sched)
            return State(t, None) if t <= limit else None  # starts on demand: ``starts``
        return self._run(sched, Progress.start(S, N, keep=True), limit)

    def starts(self, state: State, sched: Schedule) -> list[list[float]]:
        """Per stage, the start of the op at each position of ``sched`` (replayed as ``state``)."""
        if state.starts is None:  # a full replay with its timeline: counted as one more
            self.evals += 1
            state.starts = [[] for _ in range(self.S)]
            for sl in replay(sched, self.costs, self.N, link_model=self.link_model).slots:  # in order along each stage
                state.starts[sl.stage].append(sl.start)
        return state.starts

    def delta(self, state: State, old: Schedule, sched: Schedule, s: int, lo: int,
              limit: float = INF) -> Optional[State]:
        """The replay of ``sched``, which is ``old`` (replayed as ``state``) with stage ``s``
        reordered from position ``lo`` on; None if it takes longer than ``limit``."""
        if not self.incremental or state.progress is None:  # full replays (in C when state came from there)
            return self.full(sched, limit)
        was, N = state.progress, self.N
        t0 = state.starts[s][lo]
        ptr, free, busy, end, arr_f, arr_b, starts, cum = [], [], [], [], [], [], [], []
        for x, st in enumerate(state.starts):
            p, row = bisect_left(st, t0), old[x]
            ptr.append(p)
            starts.append(st[:p])
            cum.append(was.cum[x][: p + 1])
            busy.append(cum[x][p])
            free.append(st[p - 1] + self.dur[x][row[p - 1][0]] if p else 0.0)
            ef, eb, af, ab = was.end[x][0][:], was.end[x][1][:], was.arr_f[x][:], was.arr_b[x][:]
            end.append([ef, eb, [INF] * N])  # W ends are never waited for
            arr_f.append(af)
            arr_b.append(ab)
            for k, m, _ in row[p:]:  # to be run again
                if k is _F:
                    ef[m] = af[m] = INF
                elif k is _B:
                    eb[m] = ab[m] = INF
        at = Progress(ptr, free, busy, end, arr_f, arr_b, [None] * self.S, starts, cum)
        return self._run(sched, at, limit)

    def _run(self, sched: Schedule, at: Progress, limit: float) -> Optional[State]:
        """``replay_py.run_orders`` for pure-latency links, resumed from ``at``; None above ``limit``."""
        self.evals += 1
        if run_orders(sched, self.times, self.N, False, self.net, None, at, limit + SLACK, self.total) is None:
            return None
        t = max(at.free)
        return State(t, at.starts, at) if t <= limit else None
