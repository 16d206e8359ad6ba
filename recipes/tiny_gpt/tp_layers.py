"""The tiny GPT with tensor parallelism inside each pipeline stage (Megatron-style layers), on
DeepSpeed's 3D topology: ``stages`` x ``tensor_parallel`` x ``data_parallel`` ranks.

Each block's attention is a column-parallel qkv (a rank computes the queries, keys and values of
its heads / T heads) and a row-parallel output projection (a rank multiplies its heads' slice of
the input; an all-reduce sums the parts); its MLP is a column-parallel first Linear (a rank holds
hidden / T rows) and a row-parallel second one. Layer norms, the embedding and the head are whole
on every rank and compute the same on all of them. The layers use the grid's slice-parallel group
(DeepSpeed's name for the tensor-parallel ranks of a stage and replica).

Every rank draws the dense block from the same seed, in the dense model's order, and keeps its
shard: the model computes what ``model.tiny_gpt`` computes with that seed, up to the order of
floating-point sums. Sharded parameters carry ``model_parallel = True``, so DeepSpeed's gradient
clipping counts them on every rank and the whole ones once. Copy this file for your own model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

from model import Block, Embedding, Head, next_token_loss


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: the input as is. Backward: the sum over the group of the input gradients (each rank's
    part of the layer saw the whole input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: the sum over the group of the partial outputs. Backward: the gradient as is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` and ``bias``, built without drawing random numbers
    (the next layer's draws stay the dense model's)."""
    out_features, in_features = weight.shape
    linear = torch.nn.utils.skip_init(torch.nn.Linear, in_features, out_features, bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


class ColumnParallelLinear(torch.nn.Module):
    """The output features ``rows`` of the dense Linear ``full``: its rows of the weight and bias."""

    def __init__(self, full: torch.nn.Linear, rows: torch.Tensor, group):
        super().__init__()
        self.group = group
        self.linear = _linear(full.weight[rows], full.bias[rows])
        for p in self.linear.parameters():
            p.model_parallel = True

    def forward(self, x):
        return self.linear(_CopyToTensorParallel.apply(x, self.group))


class RowParallelLinear(torch.nn.Module):
    """The dense Linear ``full`` on the input features ``cols``: its columns of the weight, the partial
    outputs summed over the group, then the bias (whole on every rank)."""

    def __init__(self, full: torch.nn.Linear, cols: torch.Tensor, group):
        super().__init__()
        self.group = group
        self.linear = _linear(full.weight[:, cols], None)
        self.linear.weight.model_parallel = True
        self.bias = torch.nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return _ReduceFromTensorParallel.apply(self.linear(x), self.group) + self.bias


class TensorParallelBlock(torch.nn.Module):
    """``model.Block`` split over the tensor-parallel ranks: this rank's heads / T heads and hidden / T
    MLP units."""

    def __init__(self, d_model: int, heads: int, grid: PipelineParallelGrid):
        super().__init__()
        tp, rank = grid.get_slice_parallel_world_size(), grid.get_slice_parallel_rank()
        group = grid.get_slice_parallel_group()
        dense = Block(d_model, heads)  # the dense block's weights, drawn alike on every rank

        def mine(width: int) -> torch.Tensor:  # this rank's share of ``width`` features
            return torch.arange(rank * width // tp, (rank + 1) * width // tp)

        self.heads = heads // tp
        self.ln1, self.ln2 = dense.ln1, dense.ln2
        # qkv's outputs are [q | k | v], each heads x head_dim: this rank's heads of each of the three.
        qkv_rows = torch.cat([part * d_model + mine(d_model) for part in range(3)])
        self.qkv = ColumnParallelLinear(dense.qkv, qkv_rows, group)
        self.proj = RowParallelLinear(dense.proj, mine(d_model), group)
        self.fc1 = ColumnParallelLinear(dense.mlp[0], mine(4 * d_model), group)
        self.fc2 = RowParallelLinear(dense.mlp[2], mine(4 * d_model), group)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def tiny_gpt_tensor_parallel(vocab: int, stages: int, tensor_parallel: int, data_parallel: int, d_model: int = 64,
                             heads: int = 4, blocks: int = 6, max_seq: int = 64) -> PipelineModule:
    """``model.tiny_gpt`` on ``stages`` x ``tensor_parallel`` x ``data_parallel`` ranks (DeepSpeed's
    pipe-major order: stage s holds ranks s*D*T .. (s+1)*D*T - 1). Every rank calls it."""
    if heads % tensor_parallel:
        raise ValueError(f"the tensor-parallel size ({tensor_parallel}) must divide the {heads} attention heads")
    topo = PipeModelDataParallelTopology(num_pp=stages, num_mp=tensor_parallel, num_dp=data_parallel)
    # The blocks' tensor-parallel groups, needed before the module exists; PipelineModule forms its own
    # grid (the same groups again: on NCCL one more communicator per group, made once at start-up).
    grid = PipelineParallelGrid(topology=topo)
    layers = [LayerSpec(Embedding, vocab, d_model, max_seq)]
    layers += [LayerSpec(TensorParallelBlock, d_model, heads, grid) for _ in range(blocks)]
    layers += [LayerSpec(Head, vocab, d_model)]
    return PipelineModule(layers=layers, topology=topo, loss_fn=next_token_loss, partition_method="uniform")
