"""One stage's lowered stream (``plan.ir.lower``) as DeepSpeed pipe instructions, compiled once per plan.

``PipeMorphSchedule`` has the shape of DeepSpeed's ``TrainSchedule`` (a generator of small named
instructions, printable and testable without ranks) and executes exactly the stream ``lower`` made
for this stage, op by op::

    RECV_F m  ->  PostRecvActivation          (the receive is posted; nothing waits)
    RECV_B m  ->  PostRecvGrad
    F m       ->  RecvActivation (not first: waits for the posted receive),
                  LoadMicroBatch (first/last stage), ForwardPass
    SEND_F m  ->  SendActivation              (non-blocking)
    B m       ->  RecvGrad (not last: waits), BackwardInputPass (``whole``: B m and the W m that
                  directly follows it as one backward pass, and W m finds nothing left to do)
    SEND_B m  ->  SendGrad                    (non-blocking)
    W m       ->  BackwardWeightPass
    end       ->  WaitSends, ReduceTiedGrads, ReduceGrads, OptimizerStep

With ``groups`` (index ranges of the stream, ``plan.ir.nccl.nccl_groups``: under NCCL's rules)
the first op of a range starts with ``BeginP2PGroup`` and the last ends with ``EndP2PGroup``.

Step i holds the instructions of ``stream[i]``; one last step ends the iteration. Buffers
(``Buffers``): F m takes the lowest free pipe buffer and B m releases it (W needs none), so the
number of buffers is the plan's peak of in-flight activations on this stage, not more; ready
dispatch applies the same rule in the order it runs the ops. The instructions are built once per
stream (``steps`` hands out the same objects every iteration).
"""
from __future__ import annotations

import heapq
from typing import Iterator, Sequence

from deepspeed.runtime.pipe.schedule import PipeSchedule

from ..plan.ir.fused import fused_at
from ..plan.ir.ops import Kind, Op, peak_inflight
from . import instructions as I


class Buffers:
    """This stage's pipe buffers: F m takes the lowest free one, B m releases it (W needs none)."""

    def __init__(self, count: int):
        self._free = list(range(count))  # a heap
        self.of: dict[int, int] = {}  # micro-batch -> the buffer its F took

    def take(self, mb: int) -> int:
        buf = self.of[mb] = heapq.heappop(self._free)
        return buf

    def release(self, mb: int) -> int:
        buf = self.of.pop(mb)
        heapq.heappush(self._free, buf)
        return buf


class PipeMorphSchedule(PipeSchedule):
    """Executes ``stream`` (this stage's lowered ops, already dry-run) for one training batch.

    ``whole``: each B m directly followed by its W m in the order (``plan.ir.fused``) runs both as
    one backward pass (``BackwardInputPass(..., whole=True)``)."""

    def __init__(self, stream: Sequence[Op], micro_batches: int, stages: int, stage_id: int,
                 groups: Sequence[range] = (), whole: bool = False):
        super().__init__(micro_batches, stages, stage_id)
        self.stream = list(stream)
        self.groups = list(groups)
        self.ops = [op.local() for op in self.stream if op.is_compute]  # the plan's F/B/W order
        self.whole = {op.mb for i, op in enumerate(self.ops) if fused_at(self.ops, i)} if whole else set()
        self._buffers = max(1, peak_inflight([self.ops])[0])
        self._steps = self._compile()

    def num_pipe_buffers(self) -> int:
        return self._buffers

    def steps(self) -> Iterator[list]:
        return iter(self._steps)

    def _compile(self) -> list[list]:
        buffers = Buffers(self._buffers)
        released: dict[int, int] = {}  # micro-batch -> the buffer its B released (SendGrad names it)
        first, last = self.is_first_stage, self.is_last_stage
        steps: list[list] = []
        opens = {g.start for g in self.groups}
        closes = {g.stop - 1 for g in self.groups}
        for i, op in enumerate(self.stream):
            k, m = op.kind, op.mb
            if k is Kind.RECV_F:
                cmds = [I.PostRecvActivation(micro_batch=m)]
            elif k is Kind.RECV_B:
                cmds = [I.PostRecvGrad(micro_batch=m)]
            elif k is Kind.F:
                buf = buffers.take(m)
                cmds = [] if first else [I.RecvActivation(buf, micro_batch=m)]
                if first or last:
                    cmds.append(I.LoadMicroBatch(buf, micro_batch=m))
                cmds.append(I.ForwardPass(buf, micro_batch=m))
            elif k is Kind.SEND_F:
                cmds = [I.SendActivation(buffers.of[m], micro_batch=m)]
            elif k is Kind.B:
                buf = released[m] = buffers.release(m)
                cmds = [] if last else [I.RecvGrad(buf, micro_batch=m)]
                whole = {"whole": True} if m in self.whole else {}  # (stock's repr for the others)
                cmds.append(I.BackwardInputPass(buf, micro_batch=m, **whole))
            elif k is Kind.SEND_B:
                cmds = [I.SendGrad(released.pop(m), micro_batch=m)]
            else:
                cmds = [I.BackwardWeightPass(micro_batch=m)]
            if i in opens:
                cmds.insert(0, I.BeginP2PGroup())
            if i in closes:
                cmds.append(I.EndP2PGroup())
            steps.append(cmds)
        steps.append([I.WaitSends(), I.ReduceTiedGrads(), I.ReduceGrads(), I.OptimizerStep()])
        return steps
