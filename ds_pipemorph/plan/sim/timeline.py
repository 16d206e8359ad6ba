"""What a replay produces: a ``Timeline`` of ``Slot``s, or ``StuckSchedule`` naming the op an order
cannot get past.

Every replay (``simulate``: the compiled core or ``replay_py``; ``ready``: readiness-driven
dispatch) returns these types and words a stuck order with ``stuck_message``.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.ops import Kind, Op, Schedule


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


def stuck_message(schedule: Schedule, ptr: list[int], S: int) -> str:
    """Name the first stuck op (``ptr[s]``: the position each stage got to), what it waits for, and
    where that producer is stuck itself."""

    def head(s: int) -> str:
        return str(schedule[s][ptr[s]]) if ptr[s] < len(schedule[s]) else "its end"

    for s in range(S):
        if ptr[s] >= len(schedule[s]):
            continue
        op = schedule[s][ptr[s]]
        m = op.mb
        if op.kind is Kind.W or (op.kind is Kind.B and Op(Kind.F, m) in schedule[s][ptr[s]:]):
            need = Op(Kind.B if op.kind is Kind.W else Kind.F, m)
            return f"stage {s}: {op} before {need}"
        if op.kind is Kind.F:
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
