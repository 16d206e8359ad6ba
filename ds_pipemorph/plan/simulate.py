"""Replay simulator: a fixed per-stage op order under given costs and link delays -> timeline.

This is what a runtime that follows a plan order experiences: each op starts when its stage is
free and its inputs have arrived (upstream F + link delay, downstream B + link delay, own B for W).
Event-driven over the dependency graph, so there is no time step and no discretisation error.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from . import native
from .links import LATENCY, Delegated, Direct, LinkModel, per_link
from .ops import Op
from .profile import Costs

Schedule = list[list[Op]]


class StuckSchedule(ValueError):
    """The order cannot run: some stage waits on an op that can never happen first."""


@dataclass(frozen=True)
class Slot:
    stage: int
    op: Op
    start: float
    end: float


@dataclass
class Timeline:
    stages: int
    microbatches: int
    slots: list[Slot]
    iteration_ms: float
    busy_ms: list[float]
    peak_inflight: list[int]
    work_ms: list[float] = field(default_factory=list)  # N*(tF+tB+tW) per stage

    @property
    def stage_bubble_rate(self) -> list[float]:
        t = self.iteration_ms
        return [0.0 if t <= 0 else (t - b) / t for b in self.busy_ms]

    @property
    def bubble_rate(self) -> float:
        """Pipeline bubble rate as in the ZB paper: (T - work of the slowest stage) / T."""
        t = self.iteration_ms
        return 0.0 if t <= 0 else (t - max(self.work_ms)) / t


_KIDX = {"F": 0, "B": 1, "W": 2}


def replay(schedule: Schedule, costs: Costs, microbatches: int, fused_backward: bool = False,
           link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY) -> Timeline:
    """Run the orders as fast as dependencies allow; raise StuckSchedule naming the stuck op.

    ``fused_backward`` models DeepSpeed's ``BackwardPass``: where ``W m`` directly follows ``B m``,
    the input gradient leaves the stage only when that W ends (stock DeepSpeed sends after the
    whole backward). ``link_model`` (one for all links, or one per link) says how messages queue
    on a link (``plan.links``).
    """
    S, N = len(schedule), microbatches
    work = [N * (costs.f[s] + costs.b[s] + costs.w[s]) for s in range(S)]
    enc = native.encode(schedule, N) if native.lib() is not None else None
    got = _run_native(schedule, costs, N, fused_backward, link_model, slots=True, enc=enc) if enc else None
    if got is not None:
        t0, t1, busy, raw = got
        return _LazyTimeline(S, N, raw, schedule, t1 - t0, busy, native.peaks_and_warmups(enc, N)[0], work)
    slots: list[Slot] = []
    t0, t1, busy = _run_py(schedule, costs, N, fused_backward, slots, link_model)
    return Timeline(S, N, slots, t1 - t0, busy, peak_inflight(schedule), work)


class _LazyTimeline(Timeline):
    """A ``Timeline`` from the compiled core: its ``Slot`` objects are made on first use."""

    def __init__(self, stages, microbatches, raw, schedule, iteration_ms, busy_ms, peak, work_ms):
        self.stages, self.microbatches, self._raw, self._schedule = stages, microbatches, raw, schedule
        self._slots = None
        self.iteration_ms, self.busy_ms, self.peak_inflight, self.work_ms = iteration_ms, busy_ms, peak, work_ms

    @property
    def slots(self) -> list[Slot]:
        if self._slots is None:
            ss, sp, st, se = (a.tolist() for a in self._raw)
            rows = self._schedule
            out = []
            add, new = out.append, object.__new__
            for s, p, a, b in zip(ss, sp, st, se):  # Slot(s, op, a, b) without the frozen __init__
                x = new(Slot)
                d = x.__dict__
                d["stage"] = s
                d["op"] = rows[s][p]
                d["start"] = a
                d["end"] = b
                add(x)
            self._slots = out
            self._raw = self._schedule = None
        return self._slots

    @slots.setter
    def slots(self, value: list[Slot]) -> None:
        self._slots, self._raw, self._schedule = value, None, None


def makespan(schedule: Schedule, costs: Costs, microbatches: int, fused_backward: bool = False,
             link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY) -> float:
    """``replay(...).iteration_ms`` without building the timeline (the search's inner loop)."""
    t0, t1, _ = _run(schedule, costs, microbatches, fused_backward, None, link_model)
    return t1 - t0


def _run(schedule: Schedule, costs: Costs, N: int, fused_backward: bool, slots: Optional[list],
         link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY):
    """(first start, last end, busy ms per stage): the compiled core when it is available (and no
    slots are asked for), else ``_run_py``; the same floats either way."""
    if slots is None:
        got = _run_native(schedule, costs, N, fused_backward, link_model)
        if got is not None:
            return got[:3]
    return _run_py(schedule, costs, N, fused_backward, slots, link_model)


def _run_native(schedule: Schedule, costs: Costs, N: int, fused_backward: bool,
                link_model: Union[LinkModel, Sequence[LinkModel]], slots: bool = False, enc=None):
    """``_run`` in C: (first, last, busy, raw slots or None); None where the compiled core is
    missing or cannot take the input (the Python code then runs, and raises what it raises)."""
    S = len(schedule)
    if native.lib() is None or costs.stages != S or S < 1:
        return None
    model = per_link(link_model, S - 1)
    enc = enc or native.encode(schedule, N)
    if enc is None:
        return None
    got = native.replay(enc, costs, N, fused_backward, model, slots=slots)
    if got is None:
        return None
    rc, first, last, busy, ptr, raw, _ = got
    if rc == 1:
        raise StuckSchedule(_stuck_message(schedule, ptr, S))
    return first, last, busy, raw


def _run_py(schedule: Schedule, costs: Costs, N: int, fused_backward: bool, slots: Optional[list],
         link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY):
    """Event-driven core of ``replay``: (first start, last end, busy ms per stage).

    ``link_model`` (one, or one per link; ``plan.links``): ``Direct()`` is one FIFO holding one
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
            raise StuckSchedule(_stuck_message(schedule, ptr, S))
    return (0.0 if first == inf else first), last_end, busy


def _stuck_message(schedule: Schedule, ptr: list[int], S: int) -> str:
    """Name the first stuck op, what it waits for, and where that producer is stuck itself."""

    def head(s: int) -> str:
        return str(schedule[s][ptr[s]]) if ptr[s] < len(schedule[s]) else "its end"

    for s in range(S):
        if ptr[s] >= len(schedule[s]):
            continue
        op = schedule[s][ptr[s]]
        m = op.mb
        if op.kind == "W" or (op.kind == "B" and Op("F", m) in schedule[s][ptr[s]:]):
            need = "B" if op.kind == "W" else "F"
            return f"stage {s}: {op} before {need}{m}"
        if op.kind == "F":
            src, what = s - 1, f"F{m} from stage {s - 1}"
        elif s == S - 1:  # pragma: no cover - covered by the local check above
            return f"stage {s}: {op} before F{m}"
        else:
            src, what = s + 1, f"its input gradient B{m} from stage {s + 1}"
        return (
            f"stage {s}: {op} cannot run: it waits for {what}, which is stuck at {head(src)}"
            " (the stage orders wait on each other in a cycle)"
        )
    return "schedule is stuck"  # pragma: no cover


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per stage, the most activations held at once (F done, B not yet done), from the order."""
    out = []
    for row in schedule:
        cur = peak = 0
        for op in row:
            k = op.kind
            if k == "F":
                cur += 1
                if cur > peak:
                    peak = cur
            elif k == "B":
                cur -= 1
        out.append(peak)
    return out


def warmup_counts(schedule: Schedule) -> list[int]:
    """Forwards each stage runs before its first B (x_s)."""
    out = []
    for row in schedule:
        n = 0
        for op in row:
            if op.kind == "B":
                break
            n += op.kind == "F"
        out.append(n)
    return out
