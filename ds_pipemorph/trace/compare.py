"""Planned vs measured: per op start offset and duration, order divergence, lateness per rank.

Planned times come from replaying the plan under its own profile (``replay``); measured times are
one iteration of a measured trace. Both are offsets from their iteration start (the first compute
op of any stage). ``late`` = measured start offset - planned start offset.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from ..fileio import BadInput
from ..plan.ir.ops import Op, Schedule
from ..plan.sim.timeline import Timeline
from .measured import NS_PER_MS, MeasuredTrace


@dataclass
class OpRow:
    rank: int
    stage: int
    op: Op
    planned_start_ms: float
    planned_ms: float
    measured_start_ms: Optional[float]  # None: the op is missing from the measured iteration
    measured_ms: Optional[float]

    @property
    def late_ms(self) -> Optional[float]:
        return None if self.measured_start_ms is None else self.measured_start_ms - self.planned_start_ms


@dataclass
class Divergence:
    rank: int
    stage: int
    index: int  # position in the stage's order
    planned: Optional[str]  # None: the plan ends here
    measured: Optional[str]  # None: the measured order ends here


@dataclass
class Lateness:
    rank: int
    stage: int
    mean_ms: float
    worst_ms: float
    worst_op: str
    missing: int


@dataclass
class TraceComparison:
    iteration: int
    planned_ms: float
    measured_ms: float
    rows: list[OpRow]
    divergences: list[Divergence]
    lateness: list[Lateness]

    def to_json(self) -> dict:
        return {
            "iteration": self.iteration,
            "planned_iteration_ms": self.planned_ms,
            "measured_iteration_ms": self.measured_ms,
            "ops": [
                {"rank": r.rank, "stage": r.stage, "op": str(r.op), "planned_start_ms": r.planned_start_ms,
                 "planned_ms": r.planned_ms, "measured_start_ms": r.measured_start_ms, "measured_ms": r.measured_ms,
                 "late_ms": r.late_ms}
                for r in self.rows
            ],
            "divergences": [
                {"rank": d.rank, "stage": d.stage, "index": d.index, "planned": d.planned, "measured": d.measured}
                for d in self.divergences
            ],
            "lateness": [
                {"rank": x.rank, "stage": x.stage, "mean_ms": x.mean_ms, "worst_ms": x.worst_ms, "worst_op": x.worst_op,
                 "missing": x.missing}
                for x in self.lateness
            ],
        }


def compare(schedule: Schedule, planned: Timeline, trace: MeasuredTrace, iteration: int,
            plan_name: str) -> TraceComparison:
    """Compare iteration ``iteration`` of ``trace`` with the replayed plan; BadInput on a shape mismatch."""
    S = len(schedule)
    if trace.stages != S:
        raise BadInput(f"{plan_name} is a plan for {S} stages but {trace.source} holds {trace.stages}")
    comp = {r.rank: sorted(r.of("compute", iteration), key=lambda o: o.start_ns) for r in trace.ranks}
    all_ops = [o for ops in comp.values() for o in ops]
    if not all_ops:
        raise BadInput(f"{trace.source}: iteration {iteration} has no compute ops")
    n = max(o.op.mb for o in all_ops) + 1
    if n != planned.microbatches:
        raise BadInput(f"{plan_name} is a plan for {planned.microbatches} micro-batches but iteration {iteration} of {trace.source} runs {n}")
    t0 = min(o.start_ns for o in all_ops)
    p0 = min(sl.start for sl in planned.slots)
    plan_at = {(sl.stage, sl.op): sl for sl in planned.slots}
    rows: list[OpRow] = []
    divergences: list[Divergence] = []
    lateness: list[Lateness] = []
    for r in trace.ranks:
        got = {o.op: o for o in comp[r.rank]}
        mine = []
        for op in schedule[r.stage]:
            sl = plan_at[(r.stage, op)]
            o = got.get(op)
            mine.append(OpRow(r.rank, r.stage, op, sl.start - p0, sl.end - sl.start,
                              None if o is None else (o.start_ns - t0) / NS_PER_MS,
                              None if o is None else o.dur_ns / NS_PER_MS))
        rows.extend(mine)
        plan_order = [str(op) for op in schedule[r.stage]]
        meas_order = [str(o.op) for o in comp[r.rank]]
        for i in range(max(len(plan_order), len(meas_order))):
            a = plan_order[i] if i < len(plan_order) else None
            b = meas_order[i] if i < len(meas_order) else None
            if a != b:
                divergences.append(Divergence(r.rank, r.stage, i, a, b))
                break
        late = [x for x in mine if x.late_ms is not None]
        if late:
            worst = max(late, key=lambda x: x.late_ms)
            lateness.append(Lateness(r.rank, r.stage, statistics.fmean(x.late_ms for x in late), worst.late_ms,
                                     str(worst.op), len(mine) - len(late)))
    measured_ms = (max(o.end_ns for o in all_ops) - t0) / NS_PER_MS
    return TraceComparison(iteration, planned.iteration_ms, measured_ms, rows, divergences, lateness)
