"""Baseline schedules as plans: DeepSpeed's 1F1B (its exact order), ZB-H1 and GPipe."""
from __future__ import annotations

from .listsched import Policy, list_schedule
from .ops import Op
from .profile import Costs
from .simulate import Schedule


def deepspeed_1f1b(stages: int, microbatches: int) -> Schedule:
    """The order DeepSpeed's ``TrainSchedule`` runs, with its fused backward written ``B m, W m``.

    Mirrors ``TrainSchedule._step_to_micro_batch`` (2(N+S−1) steps, forwards on steps whose parity
    matches the stage's); tests compare it with the installed DeepSpeed.
    """
    S, N = stages, microbatches
    out: Schedule = []
    for s in range(S):
        row: list[Op] = []
        for step in range(2 * (N + S - 1)):
            even_step, even_stage = step % 2 == 0, s % 2 == 0
            if even_step == even_stage:
                base = step // 2 if even_step else (step - 1) // 2
                m, fwd = base - s // 2, True
            elif even_step:
                m, fwd = step // 2 - S + (s + 1) // 2, False
            else:
                m, fwd = ((step - 1) // 2) - S + 1 + s // 2, False
            if 0 <= m < N:
                row += [Op("F", m)] if fwd else [Op("B", m), Op("W", m)]
        out.append(row)
    return out


def zb_h1_warmup(stages: int, microbatches: int) -> list[int]:
    """ZB-H1 keeps 1F1B's memory: stage s warms up S − s forwards."""
    return [min(stages - s, microbatches) for s in range(stages)]


def zb_h1(costs: Costs, microbatches: int) -> Schedule:
    return list_schedule(costs, microbatches, zb_h1_warmup(costs.stages, microbatches), Policy("BFW"))


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all fused backwards in micro-batch order."""
    row = [Op("F", m) for m in range(microbatches)]
    for m in range(microbatches):
        row += [Op("B", m), Op("W", m)]
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
