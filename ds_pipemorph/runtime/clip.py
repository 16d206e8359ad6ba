"""Gradient clipping that moving layers (``runtime.migrate``) or ranks (``runtime.remap``) leaves alone.

DeepSpeed clips fp32 gradients (``gradient_clipping``, 1.0 unless the config says otherwise) in
``clip_grad_norm_`` with the pipeline grid as ``mpu``: a parameter's gradient counts towards the norm
only on the rank whose model-parallel rank is 0 (the lowest global rank of the pipeline, stage 0 on
DeepSpeed's own topologies), and the clip coefficient that norm gives scales every stage's
gradients. The norm is therefore that of the parameters *that rank holds*: once layers move to or
from it, or another stage takes its rank, it is the norm of other parameters, and whenever it is
above the limit on one side of the comparison and not on the other, every gradient of the step
is scaled differently from a run that never moved (the losses part a few iterations later).

So from the first migration or re-mapping on, the engine clips by the parameters DeepSpeed's rule
counted before it (``freeze_clip_set``: their names and that rank's stage), with the same numbers in
the same order: every rank puts the norms of those it holds in their slots, a sum over the pipeline
fills the vector, and the sum of squares is taken over the same list DeepSpeed stacks. A layer's
parameters count wherever the layer runs now; a parameter outside the layers (a tied module's:
every stage sharing it holds a copy, and DeepSpeed reduces only the tied attribute, so a tied
module's bias differs between copies) counts on that stage only, which keeps its tied modules
(they never move). A run that never moves keeps DeepSpeed's own function. What is not kept: a checkpoint does not store the set, so a
run resumed from one clips by the partition its engine was built on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def freeze_clip_set(engine, group) -> None:
    """Record, on every rank, what DeepSpeed's clipping counts now: the stage of the pipeline's
    model-parallel rank 0 and the names of its parameters (``engine.clip_set``), unless already
    recorded. Every rank calls it together, in ``group`` (all ranks), before anything moves."""
    if getattr(engine, "clip_set", None) is not None:
        return
    mine = None
    if engine.mpu.get_model_parallel_rank() == 0:
        mine = (engine.stage_id, [n for n, _ in engine.module.named_parameters()])
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    # Every replica holds the same partition: any model-parallel rank 0's set is every replica's.
    engine.clip_set = next(s for s in every if s is not None)


def clip_as_built(engine, clip_set: tuple, max_norm: float) -> torch.Tensor:
    """DeepSpeed's ``clip_grad_norm_`` (norm type 2, no tensor-parallel parameters: pipemorph refuses
    them) with the norm over the parameters of ``clip_set`` (stage, names) wherever they are now;
    the total norm."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups

    stage, names = clip_set
    on_stage = engine.stage_id == stage
    slot = {n: i for i, n in enumerate(names) if on_stage or n.split(".", 1)[0].isdigit()}
    L = len(names)
    table = torch.zeros(2 * L, dtype=torch.float32, device=get_accelerator().current_device_name())
    params = []
    for n, p in engine.module.named_parameters():
        if p.grad is None:
            continue
        params.append(p)
        i = slot.get(n)
        if i is not None:
            table[i] = p.grad.data.detach().float().norm(2.0)
            table[L + i] = 1.0  # held (with a gradient): DeepSpeed's list has it
    dist.all_reduce(table, group=engine.mpu.get_model_parallel_group())  # one holder per slot: exact
    norms = table[:L][table[L:] > 0]
    total = norms.pow(2.0).sum().float() if norms.numel() else torch.zeros((), device=table.device)
    total = total.pow(1.0 / 2.0)
    # As DeepSpeed: the norm averaged over the data-parallel group, then one coefficient for all.
    pg = groups._get_data_parallel_group()
    total = total * 1.0 / float(dist.get_world_size(group=pg))
    dist.all_reduce(total, group=pg)
    if not params:
        return total
    total = total.to(params[0].device)
    coef = torch.min(torch.tensor([1.0], device=total.device),
                     torch.tensor([float(max_norm)], device=total.device) / (total + 1e-6))
    for p in params:
        p.grad.data.mul_(coef)
    return total
