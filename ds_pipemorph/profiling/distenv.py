"""The process group of a profiling job started like a training job (torchrun or the deepspeed launcher).

Rank r is stage r. The launchers export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; the group is initialised from them (``env://``) with NCCL when CUDA is available
(one GPU per local rank) and gloo otherwise.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..fileio import BadInput


@dataclass(frozen=True)
class JobEnv:
    rank: int
    world_size: int
    local_rank: int


def job_env() -> JobEnv:
    """The launcher's view of this process; a plain process is rank 0 of 1."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise BadInput("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun or deepspeed)") from None
    return JobEnv(rank, world, local)


def require_launcher(env: JobEnv, what: str) -> None:
    if env.world_size < 2:
        raise BadInput(
            f"{what} needs one process per stage and at least 2 stages: start it with "
            "`torchrun --nproc_per_node S` or the `deepspeed` launcher (WORLD_SIZE is "
            f"{os.environ.get('WORLD_SIZE', 'not set')})")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise BadInput(f"{what}: {', '.join(missing)} not set; start it with torchrun or the deepspeed launcher")


def init_group(env: JobEnv, timeout_s: float) -> torch.device:
    """Initialise the default group (NCCL on CUDA, else gloo) and return this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    return device


def close_group() -> None:
    """Destroy the group before exit (a 0.19.8/gloo job can otherwise abort at interpreter exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def sync(device: torch.device) -> None:
    """Wait for queued device work (NCCL receives complete on the stream, not on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
