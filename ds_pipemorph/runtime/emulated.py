"""An emulated pipeline stage whose F, B and W take fixed times, around tiny real tensor math.

The stage computes ``y = x @ weight.T + bias`` (real values, real gradients) and, inside each op,
sleeps until the op has lasted its configured time (math included); sleeping holds no CPU, so four stages fit on two cores and
schedules can be studied at realistic op times. The matrix product is built from two autograd
nodes so that B and W are separate nodes of the graph: ``InputPath`` (its backward is the input
gradient, B's time) and ``WeightPath`` (its backward is the weight gradient, W's time). A fused
backward (stock DeepSpeed) pays both. (PipeMorphEngine loads floating-point inputs of the first
stage with ``requires_grad``, so B costs ``b_ms`` on every stage, as the plan assumes.)
"""
from __future__ import annotations

import time

import torch


def _sleep_until(start: float, ms: float) -> None:
    left = start + ms / 1000.0 - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _InputPath(torch.autograd.Function):
    """y = x @ w.T with ``w`` a constant here (sleeps ``f_ms``); backward = dx (sleeps ``b_ms``)."""

    @staticmethod
    def forward(ctx, x, w, f_ms, b_ms):
        start = time.perf_counter()
        ctx.save_for_backward(w)
        ctx.b_ms = b_ms
        y = x @ w.t()
        _sleep_until(start, f_ms)
        return y

    @staticmethod
    def backward(ctx, dy):
        start = time.perf_counter()
        (w,) = ctx.saved_tensors
        dx = dy @ w
        _sleep_until(start, ctx.b_ms)
        return dx, None, None, None


class _WeightPath(torch.autograd.Function):
    """Contributes zero to y; backward = dw = dy.T @ x (sleeps ``w_ms``)."""

    @staticmethod
    def forward(ctx, x, w, w_ms):
        ctx.save_for_backward(x)
        ctx.w_ms = w_ms
        return torch.zeros(x.shape[:-1] + (w.shape[0],), dtype=x.dtype)

    @staticmethod
    def backward(ctx, dy):
        start = time.perf_counter()
        (x,) = ctx.saved_tensors
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        _sleep_until(start, ctx.w_ms)
        return None, dw, None


class EmulatedStage(torch.nn.Module):
    """A Linear(width, width) whose forward takes ``f_ms``, input gradient ``b_ms``, weight gradient ``w_ms``."""

    def __init__(self, width: int = 8, f_ms: float = 10.0, b_ms: float = 10.0, w_ms: float = 10.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(width))
        self.f_ms, self.b_ms, self.w_ms = f_ms, b_ms, w_ms

    def forward(self, x):
        y = _InputPath.apply(x, self.weight.detach(), self.f_ms, self.b_ms)
        return y + _WeightPath.apply(x.detach(), self.weight, self.w_ms) + self.bias
