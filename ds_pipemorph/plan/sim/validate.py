"""Plan validity (docs/design.md): every stage holds F m, B m, W m exactly once for all m, and the orders
respect the dependencies. Errors name the first offending op, e.g. ``stage 2: W5 is missing``.
"""
from __future__ import annotations

from typing import Optional

from ..ir.ops import KINDS, Kind, Op, Schedule, op_table, parse_op, peak_inflight
from ..ir.profile import Costs
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
    schedule: Schedule, stages: int, microbatches: int, caps: Optional[list[int]] = None
) -> None:
    """Raise InvalidPlan with one sentence naming the first offending op; return None if valid."""
    S, N = stages, microbatches
    if len(schedule) != S:
        raise InvalidPlan(f"schedule has {len(schedule)} stage lists, the plan says {S} stages")
    if not _valid_rows(schedule, N):  # the slow loop below only to name what is wrong
        _check_rows(schedule, N)
    if caps is not None:
        for s, (peak, cap) in enumerate(zip(peak_inflight(schedule), caps)):
            if peak > cap:
                raise InvalidPlan(f"stage {s}: holds {peak} activations at once, above its cap of {cap}")
    try:
        replay(schedule, Costs.uniform(S, 1.0), N)
    except StuckSchedule as e:
        raise InvalidPlan(str(e)) from None


def _valid_rows(schedule: Schedule, N: int) -> bool:
    """True if every row holds F m, B m, W m exactly once for each m < N, each B after its F and
    each W after its B (what ``_check_rows`` checks, without naming an op)."""
    if N < 1:
        return False
    idx = op_table(N)[1]
    get = idx.get
    for row in schedule:
        if len(row) != 3 * N:
            return False
        try:
            pos = {c: i for i, c in enumerate(map(get, row))}  # a None (unknown op) is one key
        except TypeError:  # unhashable
            return False
        if len(pos) != 3 * N or None in pos:
            return False
        for m in range(N):
            if not pos[m] < pos[N + m] < pos[2 * N + m]:
                return False
    return True


def _check_rows(schedule: Schedule, N: int) -> None:
    for s, row in enumerate(schedule):
        seen: set[Op] = set()
        for op in row:
            if op.mb >= N:
                raise InvalidPlan(f"stage {s}: {op} names micro-batch {op.mb}, but there are only {N} (0..{N - 1})")
            if op in seen:
                raise InvalidPlan(f"stage {s}: {op} appears twice")
            seen.add(op)
            if op.kind is Kind.B and Op(Kind.F, op.mb) not in seen:
                raise InvalidPlan(f"stage {s}: {op} before F{op.mb}")
            if op.kind is Kind.W and Op(Kind.B, op.mb) not in seen:
                raise InvalidPlan(f"stage {s}: {op} before B{op.mb}")
        for m in range(N):
            for k in KINDS:
                if Op(k, m) not in seen:
                    raise InvalidPlan(f"stage {s}: {k}{m} is missing")
