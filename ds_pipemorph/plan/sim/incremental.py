"""Replays for the local search: only what a move can change is run again.

A move reorders one stage from position ``lo`` on; let T0 be when the op at ``lo`` started. Every op
that started before T0 keeps its start: it waited only for ops that ended before it started, and
none of the reordered ops did (they all start at T0 or later), by induction over start times as
long as op times are positive. So ``delta`` keeps the replay up to T0, runs the rest, and gives up
as soon as some stage cannot finish within ``limit`` (its free time plus its remaining work).

Same arithmetic as ``simulate.replay`` with pure-latency links (``links.Latency``), so the same
times. Link models that queue messages (``Direct``, ``Delegated``) or zero op times fall back to
full replays.

With the compiled core (``plan.sim.native``) every replay is a full one in C, faster than the Python
resumption: the same times, starts and verdicts (above ``limit`` or not). Rows are encoded for it
once and reused while they stay equal (the search changes one row per move).
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque
from typing import Optional, Sequence, Union

from ..ir.links import LATENCY, Latency, LinkModel, per_link
from ..ir.ops import KINDS, Schedule, op_table
from ..ir.profile import Costs
from . import native
from .simulate import makespan, replay
from .timeline import StuckSchedule, stuck_message

_F, _B, _W = KINDS  # module globals: looking a member up on the enum class costs more, per op

INF = float("inf")
SLACK = 1e-6  # ms: the early stop's sum of remaining work may round above the replay's own sum


class State:
    """A replayed order: iteration time ``t`` and, per stage, the start of the op at each position
    (``Evaluator.starts``), plus what ``delta`` resumes from."""

    __slots__ = ("t", "starts", "cum", "end_f", "end_b")

    def __init__(self, t: float, starts, cum=None, end_f=None, end_b=None):
        self.t, self.starts, self.cum, self.end_f, self.end_b = t, starts, cum, end_f, end_b


class Evaluator:
    """Replays orders for one profile and counts them (``evals``): the search's only cost model."""

    def __init__(self, costs: Costs, microbatches: int,
                 link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY):
        S, N = costs.stages, microbatches
        self.costs, self.S, self.N = costs, S, N
        self.link_model = per_link(link_model, S - 1)
        self.dur = [{_F: costs.f[s], _B: costs.b[s], _W: costs.w[s]} for s in range(S)]
        self.links = list(costs.links)
        self.total = [N * (costs.f[s] + costs.b[s] + costs.w[s]) for s in range(S)]
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
        return self._run(sched, [[] for _ in range(S)], [[0.0] for _ in range(S)], [[INF] * N for _ in range(S)],
                         [[INF] * N for _ in range(S)], [0] * S, [0.0] * S, limit)

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
        if not self.incremental or state.cum is None:  # full replays (in C when state came from there)
            return self.full(sched, limit)
        t0 = state.starts[s][lo]
        ptr, starts, cum, end_f, end_b, free = [], [], [], [], [], []
        for x, st in enumerate(state.starts):
            p, row = bisect_left(st, t0), old[x]
            ptr.append(p)
            starts.append(st[:p])
            cum.append(state.cum[x][: p + 1])
            ef, eb = state.end_f[x][:], state.end_b[x][:]
            end_f.append(ef)
            end_b.append(eb)
            free.append(st[p - 1] + self.dur[x][row[p - 1][0]] if p else 0.0)
            for k, m, _ in row[p:]:  # to be run again
                if k is _F:
                    ef[m] = INF
                elif k is _B:
                    eb[m] = INF
        return self._run(sched, starts, cum, end_f, end_b, ptr, free, limit)

    def _run(self, sched, starts, cum, end_f, end_b, ptr, free, limit) -> Optional[State]:
        """``replay_py.run_py`` for pure-latency links, resumed from ``ptr`` with the given state."""
        self.evals += 1
        S, dur, links, total = self.S, self.dur, self.links, self.total
        last = S - 1
        queue = deque(range(S))
        queued = [True] * S
        while queue:
            s = queue.popleft()
            queued[s] = False
            row, p = sched[s], ptr[s]
            n, p0, fr = len(row), p, free[s]
            ds, st, cs, ef, eb = dur[s], starts[s], cum[s], end_f[s], end_b[s]
            while p < n:
                k, m, _ = row[p]
                if k is _F:
                    ready = end_f[s - 1][m] + links[s - 1] if s else 0.0
                elif k is _B:
                    ready = ef[m]
                    if s < last:
                        r = end_b[s + 1][m] + links[s]
                        if r > ready:
                            ready = r
                else:
                    ready = eb[m]
                if ready == INF:
                    break
                start = fr if fr > ready else ready
                fr = start + ds[k]
                c = cs[-1] + ds[k]
                if fr + total[s] - c > limit + SLACK:  # this stage alone already runs past the limit
                    return None
                st.append(start)
                cs.append(c)
                if k is _F:
                    ef[m] = fr
                elif k is _B:
                    eb[m] = fr
                p += 1
            if p > p0:
                ptr[s], free[s] = p, fr
                for nb in (s - 1, s + 1):
                    if 0 <= nb < S and not queued[nb] and ptr[nb] < len(sched[nb]):
                        queued[nb] = True
                        queue.append(nb)
        if any(ptr[s] < len(sched[s]) for s in range(S)):
            raise StuckSchedule("the stage orders wait on each other in a cycle")
        t = max(free)
        return State(t, starts, cum, end_f, end_b) if t <= limit else None
