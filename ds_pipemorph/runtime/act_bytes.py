"""What the first iteration measured of activation memory, per stage, and how it is reported.

Per micro-batch (the largest over the iteration's micro-batches): ``f`` what F left for B (the
tensors its graph saved), ``w`` what W freed (what B left for it of that graph: all of it under the
generic split, the recomputed graph of a checkpointed chunk), ``grads`` the output gradients B kept
for W beside the graph, and ``peak`` the most saved bytes the stage held at once in the iteration.
Stock 1F1B holds ``(S - s) * f`` on stage ``s`` (its backward is fused: nothing waits for a W); on
a checkpointed job its backward also recomputes one chunk at a time, which that figure leaves out
and the log line names (``checkpointed``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..plan.ir.memory import MemoryBudget

MIB = 1024 * 1024


@dataclass(frozen=True)
class ActivationBytes:
    stage: int
    f: int
    w: int
    grads: int
    peak: int
    stock: int  # what stock 1F1B holds on this stage: S - s micro-batches of ``f``
    checkpointed: bool = False  # stock's backward recomputes a chunk beside ``stock`` (not measured)

    def as_dict(self) -> dict:
        return asdict(self)


def gather_activation_bytes(engine, peak: int) -> list[ActivationBytes]:
    """Every stage's measurement, on every rank (one ``all_gather_object``; the first replica's)."""
    import torch.distributed as dist

    ops = engine._mem_ops
    mine = (engine.stage_id, max(ops.get("F", {0: 0}).values()), max(ops.get("W", {0: 0}).values()),
            max(ops.get("G", {0: 0}).values()), int(peak))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    S = engine.num_stages
    by_stage: dict[int, tuple] = {}
    for got in every:  # data-parallel replicas measure the same model: the first one speaks
        by_stage.setdefault(got[0], got)
    return [ActivationBytes(s, *by_stage[s][1:], stock=(S - s) * by_stage[s][1], checkpointed=engine.checkpointing)
            for s in range(S)]


def describe_activation_bytes(measured: Sequence[ActivationBytes], share: Optional[float] = None,
                              budget: Optional[MemoryBudget] = None) -> str:
    """The log line after the first iteration; with ``budget`` (the limits in force from the next
    iteration on), each stage's budget in MiB and in micro-batches' activations."""
    def mib(xs):
        return "[" + ", ".join(f"{x / MIB:.{_digits(measured)}f}" for x in xs) + "]"

    line = (f"pipemorph: activation memory in iteration 1, MiB per stage: F keeps {mib(m.f for m in measured)} per "
            f"micro-batch for B, B keeps {mib(m.w for m in measured)} for W plus "
            f"{mib(m.grads for m in measured)} of gradients; the most held at once "
            f"{mib(m.peak for m in measured)} (stock 1F1B: {mib(m.stock for m in measured)}"
            + (", plus one checkpointed chunk recomputed at a time in each backward)" if any(m.checkpointed for m in measured)
               else ")"))
    if budget is None or budget.units is None:
        return line + "; no memory budget"
    granted = (list(budget.mib) if budget.mib is not None else [u * m.f / MIB for u, m in zip(budget.units, measured)])
    what = "memory.budget_mb" if budget.mib is not None else "memory.budget"
    return (line + f"; the budget from now on ({what}): [{', '.join(f'{x:.{_digits(measured)}f}' for x in granted)}] "
            f"MiB per stage, [{', '.join(f'{u:.3g}' for u in budget.units)}] micro-batches' activations")


def _digits(measured: Sequence[ActivationBytes]) -> int:
    """Decimals that show the smallest non-zero per-micro-batch figure with about two significant digits."""
    small = min((m.f for m in measured if m.f > 0), default=MIB) / MIB
    return max(1, min(8, 1 - math.floor(math.log10(small))))
