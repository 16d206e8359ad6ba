"""The fused backward (DeepSpeed's ``BackwardPass``): where a stage's order has ``B m`` directly
followed by ``W m`` and the plan runs its backward fused, the two run as one op whose input gradient
leaves the stage after the W. ``fused_at`` is that rule for the lowering (``plan.ir.lower``), the
replays (``plan.sim``) and ready dispatch (``runtime.ready_exec``).

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from typing import Sequence

from .ops import Kind, Op


def fused_at(row: Sequence[Op], i: int) -> bool:
    """Whether ``row[i]`` is a ``B m`` directly followed by ``W m``: the pair a fused backward runs as one."""
    op = row[i]
    return op.kind is Kind.B and i + 1 < len(row) and row[i + 1] == Op(Kind.W, op.mb)
