"""A tensor-parallel pipeline model for the runtime tests: per stage a column-parallel Linear, GELU
and a row-parallel Linear (Megatron's MLP split), written with torch.distributed autograd functions.

``ColumnParallelLinear`` copies its input into the tensor-parallel region (forward: identity;
backward: all-reduce of the input gradient) and holds its rows of the full weight in an inner
``nn.Linear``; ``RowParallelLinear`` holds its columns of the full weight in an inner ``nn.Linear``
without bias, all-reduces its partial outputs (backward: identity) and adds a bias every rank holds
whole. On odd stages the column-parallel layer is Megatron-core's form instead: one autograd
Function whose backward computes the input gradient, all-reduces it and computes the weight and bias
gradients (``_FusedColumnLinear``), so the split backward meets both forms. Every rank of a stage draws the full weights from the same seed and keeps its shard, so the
layers compute what the dense MLP computes. ``BACKWARD_ALLREDUCES`` collects when (``time.monotonic_ns``,
the clock of the engine's op records) each input-gradient all-reduce began, for the test to tell
which op issued it. Sharded parameters carry ``model_parallel = True``
(DeepSpeed's gradient clipping counts them on every rank; the whole bias on model-parallel rank 0).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

from models import WIDTH

HIDDEN = 2 * WIDTH
BACKWARD_ALLREDUCES: list[int] = []  # start of each backward all-reduce (ns, time.monotonic_ns)


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        BACKWARD_ALLREDUCES.append(time.monotonic_ns())
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _FusedColumnLinear(torch.autograd.Function):
    """Megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` in its plain form."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = grad @ weight
        BACKWARD_ALLREDUCES.append(time.monotonic_ns())
        dist.all_reduce(grad_input, group=ctx.group)
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        return grad_input, g2.t() @ x2, g2.sum(0), None


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, d_in: int, d_out: int, grid: PipelineParallelGrid, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.group = grid.get_slice_parallel_group()
        tp, rank = grid.get_slice_parallel_world_size(), grid.get_slice_parallel_rank()
        full = torch.nn.Linear(d_in, d_out)  # the dense layer's initialisation, the same on every rank
        rows = slice(rank * d_out // tp, (rank + 1) * d_out // tp)
        self.linear = torch.nn.Linear(d_in, d_out // tp)
        with torch.no_grad():
            self.linear.weight.copy_(full.weight[rows])
            self.linear.bias.copy_(full.bias[rows])
        for p in self.linear.parameters():
            p.model_parallel = True

    def forward(self, x):
        if self.fused:
            return _FusedColumnLinear.apply(x, self.linear.weight, self.linear.bias, self.group)
        return self.linear(_CopyToTensorParallel.apply(x, self.group))


class RowParallelLinear(torch.nn.Module):
    def __init__(self, d_in: int, d_out: int, grid: PipelineParallelGrid):
        super().__init__()
        self.group = grid.get_slice_parallel_group()
        tp, rank = grid.get_slice_parallel_world_size(), grid.get_slice_parallel_rank()
        full = torch.nn.Linear(d_in, d_out)
        cols = slice(rank * d_in // tp, (rank + 1) * d_in // tp)
        self.linear = torch.nn.Linear(d_in // tp, d_out, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(full.weight[:, cols])
        self.linear.weight.model_parallel = True
        self.bias = torch.nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return _ReduceFromTensorParallel.apply(self.linear(x), self.group) + self.bias


def topology(stages: int, tp: int, dp: int) -> PipeModelDataParallelTopology:
    return PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=dp)


def build_tp_model(stages: int, tp: int, dp: int, seed: int, tied: bool = False) -> PipelineModule:
    """``stages`` stages of [column-parallel Linear, GELU, row-parallel Linear] on ``tp`` ranks each,
    ``dp`` replicas: DeepSpeed's ``PipeModelDataParallelTopology``; with ``tied`` a dense Linear (whole
    on every tensor-parallel rank) tied between the first and the last stage. Every rank calls it (it
    forms the grid's groups)."""
    topo = topology(stages, tp, dp)
    grid = PipelineParallelGrid(topology=topo)  # the layers' tensor-parallel group
    layers = [TiedLayerSpec("ends", torch.nn.Linear, WIDTH, WIDTH)] if tied else []
    for s in range(stages):
        layers += [LayerSpec(ColumnParallelLinear, WIDTH, HIDDEN, grid, fused=s % 2 == 1), torch.nn.GELU(),
                   LayerSpec(RowParallelLinear, HIDDEN, WIDTH, grid)]
    if tied:
        layers.append(TiedLayerSpec("ends", torch.nn.Linear, WIDTH, WIDTH))
    torch.manual_seed(seed)
    return PipelineModule(layers=layers, topology=topo, loss_fn=torch.nn.MSELoss(),
                          partition_method="type:ColumnParallelLinear")
