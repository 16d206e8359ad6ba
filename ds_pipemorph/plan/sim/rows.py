"""What every stage's row holds: each of ``F m``, ``B m``, ``W m`` exactly once for every micro-batch
m < N, and in a plan (``ordered``) each B after its F and each W after its B. ``row_problem`` names
the first op that breaks it; the validity check (``validate``) and the ready replay (``ready``, whose
hint need not respect dependencies) both ask it.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from typing import Optional

from ..ir.ops import KINDS, Kind, Op, Schedule, op_table


def row_problem(schedule: Schedule, N: int, ordered: bool) -> Optional[str]:
    """One sentence naming the first offending op (``stage 2: W5 is missing``), or None."""
    if _rows_hold_all(schedule, N, ordered):  # the slow loop below only to name what is wrong
        return None
    want = {Op(k, m) for k in KINDS for m in range(N)}
    for s, row in enumerate(schedule):
        seen: set = set()
        for op in row:
            if op not in want:
                if isinstance(op, Op) and op.kind in KINDS and op.stage is None and op.mb >= N:
                    return f"stage {s}: {op} names micro-batch {op.mb}, but there are only {N} (0..{N - 1})"
                return f"stage {s}: {op} is not a compute op of micro-batches 0..{N - 1}"
            if op in seen:
                return f"stage {s}: {op} appears twice"
            seen.add(op)
            if ordered and op.kind is Kind.B and Op(Kind.F, op.mb) not in seen:
                return f"stage {s}: {op} before F{op.mb}"
            if ordered and op.kind is Kind.W and Op(Kind.B, op.mb) not in seen:
                return f"stage {s}: {op} before B{op.mb}"
        if len(seen) != len(want):
            missing = min(want - seen, key=lambda o: (o.mb, o.kind.code))
            return f"stage {s}: {missing} is missing"
    return None


def _rows_hold_all(schedule: Schedule, N: int, ordered: bool) -> bool:
    """True if every row holds F m, B m, W m exactly once for each m < N (and, ``ordered``, each B
    after its F and each W after its B): what ``row_problem`` checks, without naming an op."""
    if N < 1:
        return False
    get = op_table(N)[1].get
    for row in schedule:
        if len(row) != 3 * N:
            return False
        try:
            pos = {c: i for i, c in enumerate(map(get, row))}  # a None (unknown op) is one key
        except TypeError:  # unhashable
            return False
        if len(pos) != 3 * N or None in pos:
            return False
        if ordered:
            for m in range(N):
                if not pos[m] < pos[N + m] < pos[2 * N + m]:
                    return False
    return True
