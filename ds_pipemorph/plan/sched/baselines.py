"""Baseline schedules as plans: DeepSpeed's 1F1B (its exact order), ZB-H1 and GPipe."""
from __future__ import annotations

from ..ir.ops import Kind, Op, Schedule
from ..ir.profile import Costs
from .listsched import list_schedule
from ..sim.listsched_py import Policy


def deepspeed_1f1b(stages: int, microbatches: int) -> Schedule:
    """The order DeepSpeed's ``TrainSchedule`` runs, with its fused backward written ``B m, W m``.

    Mirrors ``TrainSchedule._step_to_micro_batch`` (2(N+S−1) steps, forwards on steps whose parity
    matches the stage's); tests compare it with the installed DeepSpeed.
    """
    S, N = stages, microbatches
    # On stage s, F m runs at step 2m + s and B m (with W m) at step 2m + 2S − 1 − s (of opposite
    # parity, so they never share a step): before B m come all F m' with m' <= m + S − s − 1.
    F = [Op(Kind.F, m) for m in range(N)]
    BW = [(Op(Kind.B, m), Op(Kind.W, m)) for m in range(N)]
    out: Schedule = []
    for s in range(S):
        row: list[Op] = []
        nf = 0
        for m in range(N):
            lim = min(N, m + S - s)
            if nf < lim:
                row.extend(F[nf:lim])
                nf = lim
            row.extend(BW[m])
        out.append(row)
    return out


def zb_h1_warmup(stages: int, microbatches: int) -> list[int]:
    """ZB-H1 keeps 1F1B's memory: stage s warms up S − s forwards."""
    return [min(stages - s, microbatches) for s in range(stages)]


def zb_h1(costs: Costs, microbatches: int) -> Schedule:
    return list_schedule(costs, microbatches, zb_h1_warmup(costs.stages, microbatches), policy=Policy("BFW"))


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all fused backwards in micro-batch order."""
    row = [Op(Kind.F, m) for m in range(microbatches)]
    for m in range(microbatches):
        row += [Op(Kind.B, m), Op(Kind.W, m)]
    return [list(row) for _ in range(stages)]


BASELINES = ("1f1b", "zb-h1", "gpipe")


def baseline(name: str, costs: Costs, microbatches: int) -> Schedule:
    if name == "1f1b":
        return deepspeed_1f1b(costs.stages, microbatches)
    if name == "zb-h1":
        return zb_h1(costs, microbatches)
    if name == "gpipe":
        return gpipe(costs.stages, microbatches)
    raise ValueError(f"unknown baseline '{name}': choose from {', '.join(BASELINES)}")
