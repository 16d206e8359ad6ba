"""Plan validity (docs/design.md): every stage holds F m, B m, W m exactly once for all m, and the orders
respect the dependencies. Errors name the first offending op, e.g. ``stage 2: W5 is missing``.
"""
from __future__ import annotations

from typing import Optional

from ..ir.ops import Op, Schedule, parse_op, peak_inflight
from ..ir.profile import Costs
from .rows import row_problem
from .simulate import replay
from .timeline import StuckSchedule


class InvalidPlan(ValueError):
    pass


_PLAN_OPS: dict[str, Op] = {}  # text -> op, for texts that parsed as compute ops of a plan


def parse_schedule(rows: list[list[str]]) -> Schedule:
    out = []
    get = _PLAN_OPS.get
    for s, row in enumerate(rows):
        try:
            ops = [get(t) for t in row] if isinstance(row, list) else [None]
        except TypeError:  # an unhashable entry: the loop below says what is wrong
            ops = [None]
        if None not in ops:  # every text seen before as a compute op of a plan
            out.append(ops)
            continue
        ops = []
        for text in row:
            try:
                op = parse_op(text)
            except ValueError as e:
                raise InvalidPlan(f"stage {s}: {e}") from None
            if not op.is_compute or op.stage is not None:
                raise InvalidPlan(f"stage {s}: '{text}' is not a compute op of a plan: write F<m>, B<m> or W<m>, e.g. F3")
            if type(text) is str:
                if len(_PLAN_OPS) > 1 << 20:
                    _PLAN_OPS.clear()
                _PLAN_OPS[text] = op
            ops.append(op)
        out.append(ops)
    return out


def validate_schedule(
    schedule: Schedule, stages: int, microbatches: int, *, caps: Optional[list[int]] = None
) -> None:
    """Raise InvalidPlan with one sentence naming the first offending op; return None if valid."""
    S, N = stages, microbatches
    if len(schedule) != S:
        raise InvalidPlan(f"schedule has {len(schedule)} stage lists, the plan says {S} stages")
    problem = row_problem(schedule, N, ordered=True)
    if problem is not None:
        raise InvalidPlan(problem)
    if caps is not None:
        for s, (peak, cap) in enumerate(zip(peak_inflight(schedule), caps)):
            if peak > cap:
                raise InvalidPlan(f"stage {s}: holds {peak} activations at once, above its cap of {cap}")
    try:
        replay(schedule, Costs.uniform(S, 1.0), N)
    except StuckSchedule as e:
        raise InvalidPlan(str(e)) from None
