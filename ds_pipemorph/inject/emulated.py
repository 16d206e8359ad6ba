"""An emulated pipeline stage whose F, B and W take fixed times, around tiny real tensor math.

The stage computes ``y = x @ weight.T + bias`` (real values, real gradients) and, inside each op,
sleeps until the op has lasted its configured time (math included, counted from the start of the
engine instruction that runs it unless ``PIPEMORPH_EMULATED_ANCHOR=op``: see ``anchor``); sleeping
holds no CPU, so four stages fit on two cores and schedules can be studied at realistic op times.
The matrix product is built from two autograd nodes so that B and W are separate nodes of the
graph: ``InputPath`` (its backward is the input gradient, B's time) and ``WeightPath`` (its backward
is the weight gradient, W's time). A fused backward (stock DeepSpeed) pays both. (PipeMorphEngine loads floating-point inputs of the first
stage with ``requires_grad``, so B costs ``b_ms`` on every stage, as the plan assumes.)
"""
from __future__ import annotations

import os
import time

import torch

from ..runtime.oprecords import take_instruction_start

# A plain sleep wakes 0.1-0.5 ms late on a loaded two-core machine; that is emulation error, not
# engine overhead. So an op sleeps until SPIN_S before its end and spins (holding one core for at
# most SPIN_S per op) for the rest.
SPIN_S = 3e-4
ANCHOR_ENV = "PIPEMORPH_EMULATED_ANCHOR"
ANCHORS = ("instruction", "op")


def anchor() -> str:
    """Where an op's fixed time starts, from ``PIPEMORPH_EMULATED_ANCHOR`` (read when a stage is built,
    to refuse a bad value early, and at every op, so a benchmark can switch it between measurements).

    "instruction" (the default) = when the engine began the instruction that runs it (oprecords
    publishes it; benchmarks wrap stock DeepSpeed's handlers the same way), so the engine's own Python
    inside an instruction overlaps the op, as CPU work overlaps the kernels it launched on a GPU.
    "op" = when the emulated math itself starts: every microsecond of engine work then adds to the op
    (the stricter ruler; benchmarks report both)."""
    value = os.environ.get(ANCHOR_ENV, "instruction")
    if value not in ANCHORS:
        raise ValueError(f"{ANCHOR_ENV} must be 'instruction' or 'op', not '{value}'")
    return value


def _op_start() -> float:
    now = time.perf_counter()
    if anchor() == "instruction":
        t = take_instruction_start()
        if t is not None and t <= now:
            return t
    return now


def sleep_until(start: float, ms: float) -> None:
    """Hold this thread until ``ms`` after ``start`` (a ``perf_counter`` time): a sleep, then a spin
    of at most SPIN_S. Every injected or emulated op time waits through here."""
    end = start + ms / 1000.0
    left = end - time.perf_counter()
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.perf_counter() < end:
        pass


class _InputPath(torch.autograd.Function):
    """y = x @ w.T with ``w`` a constant here; backward = dx (sleeps ``b_ms``)."""

    @staticmethod
    def forward(ctx, x, w, b_ms):
        ctx.save_for_backward(w)
        ctx.b_ms = b_ms
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        start = _op_start()
        (w,) = ctx.saved_tensors
        dx = dy @ w
        sleep_until(start, ctx.b_ms)
        return dx, None, None


class _WeightPath(torch.autograd.Function):
    """Contributes zero to y; backward = dw = dy.T @ x (sleeps ``w_ms``)."""

    @staticmethod
    def forward(ctx, x, w, w_ms):
        ctx.save_for_backward(x)
        ctx.w_ms = w_ms
        return torch.zeros(x.shape[:-1] + (w.shape[0],), dtype=x.dtype)

    @staticmethod
    def backward(ctx, dy):
        start = _op_start()
        (x,) = ctx.saved_tensors
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        sleep_until(start, ctx.w_ms)
        return None, dw, None


class EmulatedStage(torch.nn.Module):
    """A Linear(width, width) whose forward takes ``f_ms``, input gradient ``b_ms``, weight gradient ``w_ms``."""

    def __init__(self, width: int = 8, f_ms: float = 10.0, b_ms: float = 10.0, w_ms: float = 10.0):
        super().__init__()
        anchor()  # a bad PIPEMORPH_EMULATED_ANCHOR fails here, not inside the first op
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(width))
        self.f_ms, self.b_ms, self.w_ms = f_ms, b_ms, w_ms

    def forward(self, x):
        start = _op_start()
        y = _InputPath.apply(x, self.weight.detach(), self.b_ms)
        y = y + _WeightPath.apply(x.detach(), self.weight, self.w_ms) + self.bias
        sleep_until(start, self.f_ms)
        return y


def anchor_stock_engine(engine) -> None:
    """Make a stock DeepSpeed ``PipelineEngine`` publish when its F and fused-backward instructions
    start, as ``PipeMorphEngine`` does, so that emulated ops anchor their time the same way in both
    (see ``anchor``). Benchmarks that compare the two call this on the stock engine."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    from ..runtime.oprecords import as_instruction

    engine._INSTRUCTION_MAP = {k: (as_instruction(v) if k in (ForwardPass, BackwardPass) else v)
                               for k, v in engine._INSTRUCTION_MAP.items()}
