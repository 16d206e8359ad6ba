"""The iteration's loss: summed once the last forward has run, and sent to the other stages while
they still work.

Stock DeepSpeed adds each micro-batch's loss to ``total_loss`` inside the forward and, after the
last instruction, broadcasts the mean from the last stage over the pipeline: every stage waits in
that broadcast at the end of the iteration, behind the slowest. Here the last stage keeps each
detached loss and, at its last forward, adds them up in micro-batch order (stock's, whatever order
ready dispatch ran the forwards in) with the same operations (the same bits as stock's running
sum; ``fwd_outputs`` then holds them in that order, as stock's does), scales by the accumulation
steps and, where it can, starts the broadcast right away; the other stages post their side of it
when their iteration starts. ``train_batch`` then only collects a value that has long arrived. (A
``train_batch`` that failed before it collected its loss leaves the broadcast pending: the next one
refuses to start; collecting waits at most the engine's ``timeout_s``.)

The broadcast starts early where every rank of the pipeline can tell so without talking: a gloo
pipeline group (host tensors; an NCCL broadcast posted early would hold a kernel on the GPU for the
whole iteration), one data-parallel replica (with several, stock averages over the replicas first),
a module class that does not add losses of its own (``get_additional_losses`` not overridden:
their number sizes the message), and no ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which makes every
collective wait for its peers before it starts. Otherwise DeepSpeed's own ``_aggregate_total_loss``
runs, on the sum made here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule

from .transport.direct import wait_work


def sum_in_order(losses: list) -> torch.Tensor:
    """The losses' sum as stock's running ``total_loss`` computes it: zeros, then each added in place."""
    total = torch.zeros_like(losses[0])
    for loss in losses:
        total += loss
    return total


def broadcasts_early(engine) -> bool:
    """Whether this pipeline's loss broadcast starts at the last forward (the same answer on every
    rank of the pipeline: see the module)."""
    module_cls = type(engine.module)
    group = engine.grid.get_pipe_parallel_group()
    return (engine.is_pipe_parallel and not engine.is_data_parallel
            and module_cls.get_additional_losses is PipelineModule.get_additional_losses
            and dist.get_backend(group) == "gloo"
            # TORCH_DISTRIBUTED_DEBUG=DETAIL checks each collective with its peers before it starts:
            # a broadcast posted early would wait there for the last stage's, which waits for them
            and dist.get_debug_level() != dist.DebugLevel.DETAIL)


class EarlyLoss:
    """One iteration's loss broadcast: ``post`` on every stage but the last when the iteration
    starts, ``send`` on the last stage at its last forward, ``collect`` at the end of ``train_batch``."""

    def __init__(self, engine):
        self._group = engine.grid.get_pipe_parallel_group()
        self._src = engine._loss_stage_global_rank()
        self._rank, self._timeout_s = engine.global_rank, engine.pipemorph.timeout_s
        self._work = None
        self._losses: Optional[torch.Tensor] = None  # what travels: [pipeline loss, its data-parallel mean]
        self._own: Optional[torch.Tensor] = None  # the last stage's loss, in its own dtype

    def _check_collected(self) -> None:
        if self._work is not None:  # every stage would meet another iteration's loss from here on
            raise RuntimeError("the previous train_batch failed before it collected its loss, which is still on "
                               "its way between the stages: restart the job")

    def post(self, device) -> None:
        self._check_collected()
        self._losses, self._own = torch.zeros(2, device=device), None
        self._work = dist.broadcast(self._losses, src=self._src, group=self._group, async_op=True)

    def send(self, scaled: torch.Tensor) -> None:
        """``scaled``: the iteration's loss, already divided by the accumulation steps."""
        self._check_collected()
        self._own = scaled.clone().detach()
        self._losses = torch.stack([self._own, self._own]).float()
        self._work = dist.broadcast(self._losses, src=self._src, group=self._group, async_op=True)

    def collect(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the pipeline's loss, its data-parallel mean) as stock DeepSpeed's ``_aggregate_total_loss``
        leaves them on this rank."""
        if self._work is None:
            raise RuntimeError("the iteration's loss broadcast was never started")
        work, self._work = self._work, None
        # Bounded like every wait of the engine: a pipeline whose link went down ends in an error.
        wait_work(work, self._timeout_s, self._rank, "the iteration's loss from the last stage")
        if self._own is not None:
            return self._own, self._own.clone().detach()
        return self._losses[0].clone().detach(), self._losses[1].clone().detach()
