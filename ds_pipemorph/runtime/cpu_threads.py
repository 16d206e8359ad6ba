"""Intra-op threads of a rank on a CPU accelerator when the launcher left ``OMP_NUM_THREADS`` unset.

torch starts as many intra-op threads as the machine has cores in every process. With several ranks
on one host they oversubscribe the cores and spin against each other. The deepspeed launcher sets no
thread count (unless ``--bind_cores_to_rank``, which needs numactl and a core per rank); torchrun
sets ``OMP_NUM_THREADS=1`` for more than one process per node (``benchmarks/launch/launchers.py`` times
both).
``ds_pipemorph.initialize`` therefore gives each rank the cores this process may run on divided by
the ranks on its host, at least one. An ``OMP_NUM_THREADS`` set by the user or the launcher wins.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

# Ranks on this host, as launchers publish it: torchrun, the deepspeed launcher, Open MPI.
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cores: int
    local_ranks: int
    source: str  # the variable local_ranks came from, or "" when none was set (one rank)

    def describe(self) -> str:
        threads = f"{self.threads} intra-op thread{'s' if self.threads > 1 else ''}"
        if self.source:
            who = f"each of the {self.local_ranks} ranks on this host ({self.source}) uses {threads}"
            why = f"{self.cores} usable cores / {self.local_ranks}, at least 1"
        else:
            who, why = f"this rank, alone on its host, uses {threads}", f"{self.cores} usable cores"
        return f"OMP_NUM_THREADS is unset on a CPU accelerator: {who} ({why}); set OMP_NUM_THREADS to choose"


def local_ranks(env: Mapping[str, str]) -> tuple[int, str]:
    """(ranks on this host, the variable that said so); (1, "") when no launcher variable is set."""
    for name in LOCAL_SIZE_VARIABLES:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), name
    return 1, ""


def choose_threads(env: Mapping[str, str], cores: int) -> Optional[ThreadChoice]:
    """The thread count for a CPU rank, or None when ``OMP_NUM_THREADS`` is set."""
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    n, source = local_ranks(env)
    return ThreadChoice(threads=max(1, cores // n), cores=cores, local_ranks=n, source=source)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under numactl or taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without sched_getaffinity
        return os.cpu_count() or 1


def apply_cpu_threads(device_name: str) -> Optional[ThreadChoice]:
    """On a CPU accelerator with ``OMP_NUM_THREADS`` unset, set torch's intra-op threads to the choice.

    Returns the choice when it changed the count (to be logged), else None: a second engine in the
    same process, or a count that already matches, says nothing."""
    if device_name != "cpu":
        return None
    choice = choose_threads(os.environ, usable_cores())
    import torch

    if choice is None or torch.get_num_threads() == choice.threads:
        return None
    torch.set_num_threads(choice.threads)
    return choice
