"""A pipeline stage whose F, B and W are a plain ``time.sleep`` each, heavy micro-batches marked in the data.

A workload for benchmarks that owes nothing to ``inject.vary`` or ``inject.emulated``: no hook
times the ops and no op makes up for a late wake-up (no ``sleep_until``). Each stage computes
``y = x @ weight.T + bias`` through two autograd functions, as a real layer's graph splits into an
input path (forward: F, backward: B) and a weight path (backward: W), and each of the three sleeps
its time with ``time.sleep`` inside the function (where the stage's input needs no gradient, as on
stock DeepSpeed's first stage, the weight path's backward sleeps B's time as well: a fused
backward lasts B + W on every stage). Whatever the engine does around an op, and a sleep's late
wake-up on a loaded machine, add to the iteration.

Which micro-batches are heavy is a property of the batch, as the images of a multimodal batch
are: each iteration draws a quarter of the micro-batches (``heavy_set``: its own seeded RNG) and
the batch carries a flag column (``FLAG``) that every stage passes on; the first ``HEAVY_STAGES``
stages run a flagged micro-batch's F, B and W ``FACTOR`` times longer. ``op_times`` gives the
replay the same per-op times.
"""
from __future__ import annotations

import random
import time

import torch

WIDTH = 8  # features; the column after them is the flag
FLAG = WIDTH
FRACTION, FACTOR, HEAVY_STAGES = 0.25, 3.0, 2
NAME = "plain-sleep"
DESCRIPTION = (f"plain time.sleep ops, a quarter of the micro-batches {FACTOR:g}x on stages "
               f"0-{HEAVY_STAGES - 1}, flagged in the data")


def heavy_set(iteration: int, microbatches: int, seed: int = 0) -> frozenset[int]:
    """The heavy micro-batches of ``iteration``: round(FRACTION x N) of them, drawn by an RNG seeded
    with the text ``plain-sleep/<seed>/<iteration>``."""
    rng = random.Random(f"{NAME}/{seed}/{iteration}")
    return frozenset(rng.sample(range(microbatches), int(FRACTION * microbatches + 0.5)))


def op_times(iteration: int, stages: int, microbatches: int, op_ms: float, seed: int = 0):
    """``(stage, kind, mb) -> ms`` of ``iteration``, for the replay (``plan.sim.ready``)."""
    heavy = heavy_set(iteration, microbatches, seed)

    def ms(stage, kind, mb):
        return op_ms * FACTOR if stage < HEAVY_STAGES and mb in heavy else op_ms
    return ms


def batch(iteration: int, microbatches: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, label) per micro-batch of ``iteration``: WIDTH features and the flag (1.0: heavy)."""
    heavy = heavy_set(iteration, microbatches, seed)
    g = torch.Generator().manual_seed(1)
    out = []
    for m in range(microbatches):
        flag = torch.tensor([[1.0 if m in heavy else 0.0]])
        out.append((torch.cat([torch.randn(1, WIDTH, generator=g), flag], 1),
                    torch.cat([torch.randn(1, WIDTH, generator=g), flag], 1)))
    return out


class _InputPath(torch.autograd.Function):
    """y = x @ w.T (``w`` a constant here), sleeping ``f_s``; backward: dx, sleeping ``b_s``."""

    @staticmethod
    def forward(ctx, x, w, f_s, b_s):
        time.sleep(f_s)
        ctx.save_for_backward(w)
        ctx.b_s = b_s
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        time.sleep(ctx.b_s)
        (w,) = ctx.saved_tensors
        return dy @ w, None, None, None


class _WeightPath(torch.autograd.Function):
    """Adds zero to y; backward: dw = dy.T @ x, sleeping ``w_s``."""

    @staticmethod
    def forward(ctx, x, w, w_s):
        ctx.save_for_backward(x)
        ctx.w_s = w_s
        return torch.zeros(x.shape[:-1] + (w.shape[0],), dtype=x.dtype)

    @staticmethod
    def backward(ctx, dy):
        time.sleep(ctx.w_s)
        (x,) = ctx.saved_tensors
        return None, dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]), None


class PlainSleepStage(torch.nn.Module):
    """Linear(WIDTH, WIDTH) on the features, the flag passed on; each op sleeps ``op_ms``, times
    FACTOR on a flagged micro-batch when ``heavy`` (the stage is one of the first HEAVY_STAGES)."""

    def __init__(self, op_ms: float = 10.0, heavy: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(WIDTH))
        self.op_s, self.heavy = op_ms / 1000.0, heavy

    def forward(self, x):
        feats, flag = x[:, :FLAG], x[:, FLAG:].detach()
        t = self.op_s * (FACTOR if self.heavy and flag.item() > 0.5 else 1.0)
        y = _InputPath.apply(feats, self.weight.detach(), t, t)
        # An input that needs no gradient (stock DeepSpeed's first stage) skips the input path's
        # backward: the weight path's then sleeps B's time too, so every stage pays B as planned.
        w = t if feats.requires_grad else 2 * t
        y = y + _WeightPath.apply(feats.detach(), self.weight, w) + self.bias
        return torch.cat([y, flag], 1)


def layers(stages: int, op_ms: float):
    """One ``LayerSpec`` per stage."""
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(PlainSleepStage, op_ms, s < HEAVY_STAGES) for s in range(stages)]
