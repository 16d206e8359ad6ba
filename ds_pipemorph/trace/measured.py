"""Measured pipeline timelines (from Nsight Systems or a Chrome trace) and what they say.

A measured trace is one ``RankTrace`` per process (rank): its stage, its ops with start/end in ns
on one clock shared by all ranks, and the ``ITER<k>`` marks that delimit iterations. Ops are
compute ops (``F3``, ``B3``, ``W3``), sends (``SEND_F3``: the activation of micro-batch 3 leaves the
stage, ``SEND_B3``: its input gradient leaves) and receives (``RECV_F3``, ``RECV_B3``).

Definitions (docs/design.md vocabulary):

- iteration time of a rank: its ``ITER<k>`` range when the trace has one, else first to last op of
  the rank in that iteration; idle time = iteration time - compute time; bubble rate = idle / time.
- iteration time of the pipeline: from the earliest start to the latest end of the ranks' own
  iterations k (the union of their spans, as above), so it is never shorter than any rank's: the
  pipeline's iteration ends when its last rank's does (a span of compute ops only would leave out
  receives waited for and the optimizer step inside the ``ITER`` ranges). Pipeline bubble rate (ZB
  paper) = (T - busy of the busiest rank) / T, where busy = the measured N·(t_F+t_B+t_W) of that rank.
- send/receive-blocked time: sum of the ``SEND_*`` / ``RECV_*`` range durations in an iteration;
  op counts: how many ``F``, ``B``, ``W``, ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B`` it ran.
- link i (stage i to i+1): ``SEND_F m`` on stage i pairs with ``RECV_F m`` on stage i+1 and
  ``SEND_B m`` on stage i+1 with ``RECV_B m`` on stage i, in the same iteration. With data
  parallelism the k-th rank (in rank order) of one stage pairs with the k-th rank of the other
  (the readers give each rank its global rank when the trace says it, see ``nsys.py``).
  ``RECV end - SEND start`` bounds the one-way latency plus waiting from above; a link's figure is
  the median over its pairs.
"""
from __future__ import annotations

import re
import statistics
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

from ..plan.ir.ops import Kind, Op, peak_inflight, recorded_op
from ..plan.sim.timeline import Slot, Timeline

NS_PER_MS = 1_000_000

# A range is named by its op text ("F3", "SEND_B3": ``plan.ir.ops.recorded_op``) or ITER<k>,
# optionally prefixed with the stage: "stage2/F3" (see nsys.py for the convention).
STAGE_PREFIX = re.compile(r"^(?:stage(\d+)/)?(.*)$", re.DOTALL)
ITER_NAME = re.compile(r"^ITER(\d+)$")
_WHAT = {Kind.SEND_F: "send", Kind.SEND_B: "send", Kind.RECV_F: "recv", Kind.RECV_B: "recv"}


@dataclass(frozen=True)
class ParsedName:
    stage: Optional[int]  # from a "stage<S>/" prefix, else None
    what: str  # "compute" | "send" | "recv" | "iter"
    op: Optional[Op]  # the op (for sends/receives: F m = activation, B m = input gradient)
    iteration: Optional[int]  # for ITER<k>


def parse_range_name(text: str) -> Optional[ParsedName]:
    """``"F3"`` / ``"SEND_B3"`` / ``"ITER2"`` (optionally ``"stage1/..."``) -> ParsedName; else None."""
    prefix, rest = STAGE_PREFIX.match((text or "").strip()).groups()
    stage = None if prefix is None else int(prefix)
    op = recorded_op(rest)
    if op is not None:
        what = _WHAT.get(op.kind, "compute")
        return ParsedName(stage, what, op if what == "compute" else Op(op.kind.payload, op.mb), None)
    m = ITER_NAME.match(rest)
    if m:
        return ParsedName(stage, "iter", None, int(m.group(1)))
    return None


@dataclass(frozen=True)
class MeasuredOp:
    what: str  # "compute" | "send" | "recv"
    op: Op
    start_ns: int
    end_ns: int
    iteration: int

    @property
    def kind(self) -> Kind:
        """The kind of op that ran: ``op.kind`` for compute, its send or receive otherwise."""
        if self.what == "compute":
            return self.op.kind
        return self.op.kind.send if self.what == "send" else self.op.kind.recv

    @property
    def name(self) -> str:
        return str(self.op if self.what == "compute" else Op(self.kind, self.op.mb, self.op.stage))

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class IterMark:
    start_ns: int
    end_ns: Optional[int]  # None: the range never closed (capture stopped inside the iteration)


@dataclass
class RankTrace:
    rank: int
    stage: int
    pid: Optional[int]
    ops: list[MeasuredOp]
    marks: dict[int, IterMark] = field(default_factory=dict)

    def of(self, what: str, iteration: Optional[int] = None) -> list[MeasuredOp]:
        ops = self.ops if iteration is None else self.by_iteration.get(iteration, [])
        return [o for o in ops if o.what == what]

    @cached_property
    def by_iteration(self) -> dict[int, list[MeasuredOp]]:
        out: dict[int, list[MeasuredOp]] = {}
        for o in self.ops:
            out.setdefault(o.iteration, []).append(o)
        return out


@dataclass
class MeasuredTrace:
    source: str
    ranks: list[RankTrace]
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # e.g. session start time of an nsys report

    @property
    def stages(self) -> int:
        return max(r.stage for r in self.ranks) + 1

    @property
    def has_marks(self) -> bool:
        return any(r.marks for r in self.ranks)

    def iterations(self) -> list[int]:
        return sorted({k for r in self.ranks for k in r.by_iteration})

    def complete_iterations(self) -> list[int]:
        """Iterations where every rank ran compute ops and, with ITER marks, closed its mark."""
        out = []
        for k in self.iterations():
            ok = all(r.of("compute", k) for r in self.ranks)
            if ok and self.has_marks:
                ok = all(k in r.marks and r.marks[k].end_ns is not None for r in self.ranks)
            if ok:
                out.append(k)
        return out

    def ranks_of_stage(self, stage: int) -> list[RankTrace]:
        return [r for r in self.ranks if r.stage == stage]


def assign_iterations(ops: list[tuple[str, Op, int, int]], marks: dict[int, IterMark]) -> tuple[list[MeasuredOp], int]:
    """Place (what, op, start, end) into the ITER mark holding its start; (ops, dropped outside).

    With no marks the whole trace is iteration 0.
    """
    if not marks:
        return [MeasuredOp(w, op, s, e, 0) for w, op, s, e in ops], 0
    spans = sorted((m.start_ns, m.end_ns, k) for k, m in marks.items())
    starts = [x[0] for x in spans]
    out, dropped = [], 0
    for w, op, s, e in ops:
        i = bisect_right(starts, s) - 1  # the latest mark starting at or before the op
        if i >= 0 and (spans[i][1] is None or s < spans[i][1]):
            out.append(MeasuredOp(w, op, s, e, spans[i][2]))
        else:
            dropped += 1
    return out, dropped


# ---------------------------------------------------------------------------------------------
# Analysis


@dataclass
class RankIteration:
    iteration: int
    iteration_ms: float
    busy_ms: float
    send_ms: float
    recv_ms: float
    ops: dict[str, int] = field(default_factory=dict)  # op kind -> count: "F", "B", "W", "SEND_F", "RECV_B", ...

    @property
    def idle_ms(self) -> float:
        return self.iteration_ms - self.busy_ms

    @property
    def bubble_rate(self) -> float:
        return 0.0 if self.iteration_ms <= 0 else self.idle_ms / self.iteration_ms


@dataclass
class PipelineIteration:
    iteration: int
    iteration_ms: float
    max_busy_ms: float

    @property
    def bubble_rate(self) -> float:
        return 0.0 if self.iteration_ms <= 0 else (self.iteration_ms - self.max_busy_ms) / self.iteration_ms


@dataclass
class LinkStats:
    link: int
    latencies_ms: list[float]  # RECV end - SEND start, both directions
    forward_ms: list[float]
    backward_ms: list[float]
    unmatched: int

    @property
    def messages(self) -> int:
        return len(self.latencies_ms)

    @property
    def median_ms(self) -> Optional[float]:
        return statistics.median(self.latencies_ms) if self.latencies_ms else None


@dataclass
class Analysis:
    iterations: list[int]  # the iterations the figures are over
    ranks: list[tuple[RankTrace, list[RankIteration]]]
    pipeline: list[PipelineIteration]
    links: list[LinkStats]  # slowest first

    def to_json(self) -> dict:
        def summary(vals: list[float]) -> dict:
            if not vals:
                return {"mean": None, "median": None}
            return {"mean": statistics.fmean(vals), "median": statistics.median(vals)}

        return {
            "iterations": self.iterations,
            "ranks": [
                {
                    "rank": r.rank,
                    "stage": r.stage,
                    "pid": r.pid,
                    "iterations": len(its),
                    "iteration_ms": summary([x.iteration_ms for x in its]),
                    "bubble_rate": summary([x.bubble_rate for x in its]),
                    "send_blocked_ms": summary([x.send_ms for x in its]),
                    "recv_blocked_ms": summary([x.recv_ms for x in its]),
                    "per_iteration": [
                        {"iteration": x.iteration, "iteration_ms": x.iteration_ms, "busy_ms": x.busy_ms,
                         "bubble_rate": x.bubble_rate, "send_blocked_ms": x.send_ms, "recv_blocked_ms": x.recv_ms,
                         "ops": x.ops}
                        for x in its
                    ],
                }
                for r, its in self.ranks
            ],
            "pipeline": {
                "iteration_ms": summary([p.iteration_ms for p in self.pipeline]),
                "bubble_rate": summary([p.bubble_rate for p in self.pipeline]),
                "per_iteration": [
                    {"iteration": p.iteration, "iteration_ms": p.iteration_ms, "bubble_rate": p.bubble_rate}
                    for p in self.pipeline
                ],
            },
            "links": [
                {"link": ln.link, "stages": [ln.link, ln.link + 1], "median_ms": ln.median_ms,
                 "forward_median_ms": statistics.median(ln.forward_ms) if ln.forward_ms else None,
                 "backward_median_ms": statistics.median(ln.backward_ms) if ln.backward_ms else None,
                 "max_ms": max(ln.latencies_ms) if ln.latencies_ms else None,
                 "messages": ln.messages, "unmatched": ln.unmatched}
                for ln in self.links
            ],
        }


def _ms(ns: int) -> float:
    return ns / NS_PER_MS


def rank_span(r: RankTrace, k: int) -> Optional[tuple[int, int]]:
    """(start, end) in ns of rank ``r``'s iteration k: its closed ``ITER<k>`` range, else its first to
    last op of any kind; None when the rank ran no op in it."""
    ops = r.by_iteration.get(k, [])
    if not ops:
        return None
    mark = r.marks.get(k)
    if mark is not None and mark.end_ns is not None:
        return mark.start_ns, mark.end_ns
    return min(o.start_ns for o in ops), max(o.end_ns for o in ops)


def rank_iteration(r: RankTrace, k: int) -> Optional[RankIteration]:
    bounds = rank_span(r, k)
    if bounds is None:
        return None
    ops = r.by_iteration[k]
    span = bounds[1] - bounds[0]
    busy = sum(o.dur_ns for o in ops if o.what == "compute")
    send = sum(o.dur_ns for o in ops if o.what == "send")
    recv = sum(o.dur_ns for o in ops if o.what == "recv")
    counts: dict[str, int] = {}
    for o in ops:
        kind = str(o.kind)
        counts[kind] = counts.get(kind, 0) + 1
    return RankIteration(k, _ms(span), _ms(busy), _ms(send), _ms(recv), dict(sorted(counts.items())))


def pipeline_iteration(trace: MeasuredTrace, k: int) -> Optional[PipelineIteration]:
    """Iteration k of the whole pipeline: the union of the ranks' spans (module docstring)."""
    if not any(r.of("compute", k) for r in trace.ranks):
        return None
    spans = [b for b in (rank_span(r, k) for r in trace.ranks) if b is not None]
    t = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = max(sum(o.dur_ns for o in r.of("compute", k)) for r in trace.ranks)
    return PipelineIteration(k, _ms(t), _ms(busy))


def message_pairs(trace: MeasuredTrace, iterations: Optional[list[int]] = None):
    """Matched messages as (link, send rank, send op, receive rank, receive op); and the unmatched count.

    See the module docstring for the pairing rule. ``iterations=None`` means all of them.
    """
    its = trace.iterations() if iterations is None else iterations
    its_set = set(its)
    pairs: list[tuple[int, RankTrace, MeasuredOp, RankTrace, MeasuredOp]] = []
    unmatched: dict[int, int] = {}
    for i in range(trace.stages - 1):
        up, down = trace.ranks_of_stage(i), trace.ranks_of_stage(i + 1)
        n = 0
        for a, b in zip(up, down):
            for k in its:
                for sender, receiver, kind in ((a, b, Kind.F), (b, a, Kind.B)):
                    sends = {o.op: o for o in sender.of("send", k) if o.op.kind == kind}
                    recvs = {o.op: o for o in receiver.of("recv", k) if o.op.kind == kind}
                    for op in sorted(sends.keys() & recvs.keys(), key=lambda x: x.mb):
                        pairs.append((i, sender, sends[op], receiver, recvs[op]))
                    n += len(sends.keys() ^ recvs.keys())
        for r in up[len(down):]:
            n += sum(1 for o in r.ops if o.iteration in its_set and o.kind in (Kind.SEND_F, Kind.RECV_B))
        for r in down[len(up):]:
            n += sum(1 for o in r.ops if o.iteration in its_set and o.kind in (Kind.SEND_B, Kind.RECV_F))
        unmatched[i] = n
    return pairs, unmatched


def link_stats(trace: MeasuredTrace, iterations: list[int]) -> list[LinkStats]:
    """Per link, the latencies of its matched messages; slowest median first."""
    pairs, unmatched = message_pairs(trace, iterations)
    out = []
    for i in range(trace.stages - 1):
        fwd = [_ms(rv.end_ns - sd.start_ns) for ln, _, sd, _, rv in pairs if ln == i and sd.op.kind is Kind.F]
        bwd = [_ms(rv.end_ns - sd.start_ns) for ln, _, sd, _, rv in pairs if ln == i and sd.op.kind is Kind.B]
        out.append(LinkStats(i, fwd + bwd, fwd, bwd, unmatched[i]))
    out.sort(key=lambda ln: (-(ln.median_ms if ln.median_ms is not None else -1.0), ln.link))
    return out


def analyze(trace: MeasuredTrace) -> Analysis:
    """Figures over the complete iterations (all iterations, with a warning, if none is complete)."""
    its = trace.complete_iterations()
    if not its:
        its = trace.iterations()
        msg = "no iteration is complete on every rank; figures cover the partial ones"
        if msg not in trace.warnings:
            trace.warnings.append(msg)
    ranks = []
    for r in trace.ranks:
        rows = [x for x in (rank_iteration(r, k) for k in its) if x is not None]
        ranks.append((r, rows))
    pipe = [p for p in (pipeline_iteration(trace, k) for k in its) if p is not None]
    return Analysis(its, ranks, pipe, link_stats(trace, its))


def default_iteration(trace: MeasuredTrace) -> int:
    """The last complete iteration, else the last one."""
    its = trace.complete_iterations() or trace.iterations()
    return its[-1]


def check_iteration(trace: MeasuredTrace, k: Optional[int]) -> int:
    if k is None:
        return default_iteration(trace)
    if k not in trace.iterations():
        raise ValueError(f"{trace.source}: no iteration {k}; the trace holds iterations {_ranges(trace.iterations())}")
    return k


def _ranges(vals: list[int]) -> str:
    return ", ".join(str(v) for v in vals) if len(vals) <= 8 else f"{vals[0]}..{vals[-1]}"


def iteration_timeline(trace: MeasuredTrace, k: int) -> Timeline:
    """The compute ops of iteration k as a ``Timeline`` (ms from the iteration start).

    With data parallelism a stage shows its first rank. ``work_ms`` is the measured busy time,
    so ``bubble_rate`` is the measured pipeline bubble rate.
    """
    S = trace.stages
    rows: list[list[MeasuredOp]] = []
    for s in range(S):
        rs = trace.ranks_of_stage(s)
        rows.append(sorted(rs[0].of("compute", k), key=lambda o: o.start_ns) if rs else [])
    starts = [o.start_ns for row in rows for o in row]
    if not starts:
        raise ValueError(f"{trace.source}: iteration {k} has no compute ops")
    t0 = min(starts)
    slots = [Slot(s, o.op, _ms(o.start_ns - t0), _ms(o.end_ns - t0)) for s, row in enumerate(rows) for o in row]
    t1 = max(sl.end for sl in slots)
    busy = [sum(_ms(o.dur_ns) for o in row) for row in rows]
    n = max(o.op.mb for row in rows for o in row) + 1
    return Timeline(S, n, slots, t1, busy, peak_inflight([[o.op for o in row] for row in rows]), list(busy))
