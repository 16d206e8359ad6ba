"""The floor of this machine: a plan run by plain torch.distributed, without DeepSpeed or our engine.

``BareRunner`` executes one stage's plan (the same ``zb`` plan, the same emulated stage module and
the same B/W split as ``PipeMorphEngine``) with the least a runtime can do: all receives of the
iteration posted up front into preallocated buffers, non-blocking sends, no op records, no NVTX,
no pipe buffers, no data iterator, no DeepSpeed. Emulated ops anchor their time at the start of
each op, as the engines publish the start of an instruction. Whatever this takes above the plan's
prediction is the cost of Python, autograd and gloo on this machine, which no engine can remove;
the engine benchmark prints it next to the engines, measured in the same run.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ds_pipemorph.runtime.bw_split import backward_input
from ds_pipemorph.inject.emulated import EmulatedStage
from ds_pipemorph.runtime.oprecords import as_instruction

_TAG_F, _TAG_B = 1 << 20, 2 << 20


class BareRunner:
    """``train_batch(iter(data))`` runs one iteration of ``plan[stage]``; ``compute_spans`` collects
    (start, end) monotonic ns of every F, B and W (the benchmark clears it per iteration)."""

    def __init__(self, plan, stage: int, stages: int, width: int, op_ms: float, lr: float = 1e-3):
        self.ops = list(plan[stage])
        self.s, self.S, self.width = stage, stages, width
        torch.manual_seed(0)
        self.module = EmulatedStage(width, op_ms, op_ms, op_ms)
        self.params = list(self.module.parameters())
        self.opt = torch.optim.SGD(self.params, lr=lr)
        self.compute_spans: list[tuple[int, int]] = []
        self.n = max(op.mb for op in self.ops) + 1
        self._compute = as_instruction(self._compute_op)  # publishes the op's start, as the engines do

    def train_batch(self, data) -> None:
        batches = list(data)
        first, last = self.s == 0, self.s == self.S - 1
        self.recv_f = [torch.empty(1, self.width) for _ in range(self.n)]
        self.recv_b = [torch.empty(1, self.width) for _ in range(self.n)]
        rf = [] if first else [dist.irecv(self.recv_f[m], self.s - 1, tag=_TAG_F + m) for m in range(self.n)]
        rb = [] if last else [dist.irecv(self.recv_b[m], self.s + 1, tag=_TAG_B + m) for m in range(self.n)]
        self._state = {"batches": batches, "rf": rf, "rb": rb, "x": {}, "out": {}, "work": {}, "sends": []}
        for op in self.ops:
            self._op(op)
        for h in self._state["sends"]:
            h.wait()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _op(self, op) -> None:
        """Wait for the op's message (if any), then compute it as one published instruction."""
        st, m = self._state, op.mb
        if op.kind == "F" and self.s > 0:
            st["rf"][m].wait()
        elif op.kind == "B" and self.s < self.S - 1:
            st["rb"][m].wait()
        t0 = time.monotonic_ns()
        self._compute(op)
        self.compute_spans.append((t0, time.monotonic_ns()))

    def _compute_op(self, op) -> None:
        st, m = self._state, op.mb
        first, last = self.s == 0, self.s == self.S - 1
        if op.kind == "F":
            x = st["batches"][m][0].clone() if first else self.recv_f[m]
            x.requires_grad_(True)
            y = self.module(x)
            if last:
                y = torch.nn.functional.mse_loss(y, st["batches"][m][1]) / self.n
            else:
                st["sends"].append(dist.isend(y.detach(), self.s + 1, tag=_TAG_F + m))
            st["x"][m], st["out"][m] = x, y
        elif op.kind == "B":
            grads = [None] if last else [self.recv_b[m]]
            dins, st["work"][m] = backward_input([st["out"].pop(m)], grads, [st["x"].pop(m)], self.params)
            if not first:
                st["sends"].append(dist.isend(dins[0], self.s - 1, tag=_TAG_B + m))
        else:
            st["work"].pop(m).run()
