"""torch.distributed.pipelining's own schedules on the same emulated stage, for the engine benchmark.

``TorchRunner(kind, rank, stages, width, op_ms)`` builds this rank's stage(s) of a pipeline whose
total work per micro-batch equals the engines' (F = B = W = ``op_ms`` per rank) and runs one
iteration per ``train_batch(iter(data))`` with torch's schedule:

- ``torch_1f1b``: ``Schedule1F1B``, one stage per rank (fused backward: B and W together);
- ``torch_interleaved_zb``: ``ScheduleInterleavedZeroBubble``, two virtual stages per rank placed
  round-robin (rank r holds stages r and r + S), each half the work;
- ``torch_zbv``: ``ScheduleZBVZeroBubble``, two virtual stages per rank placed in a V (rank r holds
  stages r and 2S - 1 - r), each half the work.

Emulated ops anchor their time where torch starts the action that runs them (its
``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` publish their start,
as the engines publish the start of an instruction), and ``compute_spans`` collects every compute
action's (start, end) in monotonic ns.
"""
from __future__ import annotations

import time

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from ds_pipemorph.runtime.oprecords import as_instruction
from ds_pipemorph.inject.emulated import EmulatedStage

KINDS = {
    "torch_1f1b": (Schedule1F1B, 1),
    "torch_interleaved_zb": (ScheduleInterleavedZeroBubble, 2),
    "torch_zbv": (ScheduleZBVZeroBubble, 2),
}


def stage_indices(kind: str, rank: int, stages: int) -> list[int]:
    """The pipeline stages rank ``rank`` holds (torch numbers virtual stages 0 .. S*v - 1)."""
    if kind == "torch_1f1b":
        return [rank]
    if kind == "torch_interleaved_zb":
        return [rank, rank + stages]
    return [rank, 2 * stages - 1 - rank]


class TorchRunner:
    def __init__(self, kind: str, rank: int, stages: int, width: int, op_ms: float, microbatches: int,
                 lr: float = 1e-3):
        schedule_cls, virtual = KINDS[kind]
        torch.manual_seed(0)
        ms = op_ms / virtual  # each virtual stage does its share of the rank's work
        self.compute_spans: list[tuple[int, int]] = []
        self.stages = []
        self.modules = []
        for index in stage_indices(kind, rank, stages):
            module = EmulatedStage(width, ms, ms, ms)
            stage = PipelineStage(module, index, stages * virtual, torch.device("cpu"))  # shapes at the first step
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(as_instruction(getattr(stage, name))))
            self.stages.append(stage)
            self.modules.append(module)
        self.holds_first = any(s.is_first for s in self.stages)
        self.holds_last = any(s.is_last for s in self.stages)
        loss = torch.nn.MSELoss()
        if virtual == 1:
            self.schedule = schedule_cls(self.stages[0], microbatches, loss_fn=loss)
        else:
            self.schedule = schedule_cls(self.stages, microbatches, loss_fn=loss)
        params = [p for m in self.modules for p in m.parameters()]
        self.opt = torch.optim.SGD(params, lr=lr)

    def _timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.monotonic_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.compute_spans.append((t0, time.monotonic_ns()))
        return run

    def train_batch(self, data) -> None:
        batches = list(data)
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        kwargs = {}
        if self.holds_last:
            kwargs = {"target": y, "losses": []}
        if self.holds_first:
            self.schedule.step(x, **kwargs)
        else:
            self.schedule.step(**kwargs)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
