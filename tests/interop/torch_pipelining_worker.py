"""One rank of torch pipelining (``_PipelineScheduleRuntime``) running a schedule CSV exported by
``pipemorph export``: stage r = Linear + ReLU on rank r, gloo, CPU. Every rank builds the same
whole model from one seed and keeps its own layer; it writes that layer's gradients (and, on the
last rank, the micro-batch losses) to OUT/rank<r>.pt. Given several schedules, each runs in turn
on a model built anew, in the same process group (one start for all).

usage: torchrun --nproc_per_node S torch_pipelining_worker.py SCHEDULE.csv MICROBATCHES OUT [SCHEDULE.csv OUT ...]
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from model_spec import batch, build_model, loss_fn


def main(microbatches: int, runs: list[tuple[str, str]]) -> None:
    dist.init_process_group("gloo")
    for csv_path, out in runs:
        run(csv_path, microbatches, out)
        dist.barrier()
    dist.destroy_process_group()


def run(csv_path: str, microbatches: int, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = build_model(world)[rank]
    x, y = batch(microbatches)
    stage = PipelineStage(layer, rank, world, torch.device("cpu"))  # shapes inferred at the first step
    sched = _PipelineScheduleRuntime([stage], microbatches, loss_fn=loss_fn)
    sched._load_csv(csv_path, format="compute_comms")  # validates, then runs the rows as given
    losses: list = []
    if rank == 0:
        sched.step(x)
    elif rank == world - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    grads = {k: p.grad.detach().clone() for k, p in layer.named_parameters()}
    torch.save({"grads": grads, "losses": [float(v) for v in losses]}, Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[1]), [(args[0], args[2])] + list(zip(args[3::2], args[4::2])))
