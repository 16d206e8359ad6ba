"""What the first iteration measured of activation memory, per stage, and how it is reported.

Per micro-batch (the largest over the iteration's micro-batches): ``f`` what F left for B (the
tensors its graph saved), ``w`` what W freed (what B left for it of that graph: all of it under the
generic split, the recomputed graph of a checkpointed chunk), ``grads`` the output gradients B kept
for W beside the graph, and ``peak`` the most saved bytes the stage held at once in the iteration.
Stock 1F1B holds ``(S - s) * f`` on stage ``s`` (its backward is fused: nothing waits for a W).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

MIB = 1024 * 1024


@dataclass(frozen=True)
class ActivationBytes:
    stage: int
    f: int
    w: int
    grads: int
    peak: int
    stock: int  # what stock 1F1B holds on this stage: S - s micro-batches of ``f``

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
    return [ActivationBytes(s, *by_stage[s][1:], stock=(S - s) * by_stage[s][1]) for s in range(S)]


def describe_activation_bytes(measured: Sequence[ActivationBytes], share: Optional[float] = None) -> str:
    """The log line after the first iteration."""
    def mib(xs):
        return "[" + ", ".join(f"{x / MIB:.1f}" for x in xs) + "]"

    return (f"pipemorph: activation memory in iteration 1, MiB per stage: F keeps {mib(m.f for m in measured)} per "
            f"micro-batch for B, B keeps {mib(m.w for m in measured)} for W plus "
            f"{mib(m.grads for m in measured)} of output gradients; the most held at once "
            f"{mib(m.peak for m in measured)} (stock 1F1B: {mib(m.stock for m in measured)})")
