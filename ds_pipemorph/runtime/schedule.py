"""Lowering of one stage's plan (ordered ops F m / B m / W m) to DeepSpeed pipe instructions.

``PipeMorphSchedule`` has the shape of DeepSpeed's ``TrainSchedule``: a generator of small named
instructions, one step per op, printable and testable without ranks::

    F m  ->  LoadMicroBatch (first/last stage) | RecvActivation, ForwardPass, SendActivation
    B m  ->  RecvGrad (not last), BackwardInputPass, SendGrad (not first)
    W m  ->  BackwardWeightPass
    end  ->  WaitSends, ReduceTiedGrads, ReduceGrads, OptimizerStep

Buffers: F m takes the lowest free pipe buffer and B m releases it (W needs none), so the number
of buffers is the plan's peak of in-flight activations on this stage, not more.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from deepspeed.runtime.pipe.schedule import PipeSchedule

from ..plan.ops import Op
from ..plan.simulate import peak_inflight
from . import instructions as I


class PipeMorphSchedule(PipeSchedule):
    """Executes ``ops`` (this stage's plan, already validated) for one training batch."""

    def __init__(self, ops: Sequence[Op], micro_batches: int, stages: int, stage_id: int):
        super().__init__(micro_batches, stages, stage_id)
        self.ops = list(ops)

    def num_pipe_buffers(self) -> int:
        return max(1, peak_inflight([self.ops])[0])

    def steps(self) -> Iterator[list]:
        free = list(range(self.num_pipe_buffers()))
        buffer_of: dict[int, int] = {}
        first, last = self.is_first_stage, self.is_last_stage
        for op in self.ops:
            m = op.mb
            if op.kind == "F":
                buf = free.pop(0)
                buffer_of[m] = buf
                cmds = []
                if not first:
                    cmds.append(I.RecvActivation(buf, micro_batch=m))
                if first or last:
                    cmds.append(I.LoadMicroBatch(buf, micro_batch=m))
                cmds.append(I.ForwardPass(buf, micro_batch=m))
                if not last:
                    cmds.append(I.SendActivation(buf, micro_batch=m))
            elif op.kind == "B":
                buf = buffer_of.pop(m)
                cmds = []
                if not last:
                    cmds.append(I.RecvGrad(buf, micro_batch=m))
                cmds.append(I.BackwardInputPass(buf, micro_batch=m))
                if not first:
                    cmds.append(I.SendGrad(buf, micro_batch=m))
                free.append(buf)
                free.sort()
            else:
                cmds = [I.BackwardWeightPass(micro_batch=m)]
            yield cmds
        yield [I.WaitSends(), I.ReduceTiedGrads(), I.ReduceGrads(), I.OptimizerStep()]


def lowered_text(schedule: PipeMorphSchedule) -> list[str]:
    """The instruction stream as text, e.g. ``['RECV_F0', 'F0', 'SEND_F0', ...]`` (for tests and traces)."""
    return [I.op_text(c) for step in schedule.steps() for c in step]
