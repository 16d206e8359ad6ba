"""DeepSpeed's CPU all-reduce leaves its shared memory in /dev/shm; each rank removes its own at exit.

On the CPU accelerator, with every rank on one machine, DeepSpeed's collectives op
(``deepspeed/ops/csrc/cpu/comm/shm.cpp``) creates one buffer per rank, named
``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (about 66 MB), and never
removes it: each job used to leave world size x 66 MB of RAM behind. Every rank opens every other
rank's buffer while communication starts, before its ``init_distributed`` returns; ``initialize``
registers the removal after a barrier that follows it on every rank, so removing the name at a
normal exit takes nothing from a rank still running: the memory itself goes when the last rank
unmaps it. A killed rank runs no exit handler: its reaper (``runtime.reaper``) removes its buffer. A
name DeepSpeed did not create (another version's format, ranks on several machines) is simply not there.
"""
from __future__ import annotations

import atexit
import os
from pathlib import Path


def allreduce_buffer(rank: int) -> Path:
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


_registered: list[Path] = []


def remove_allreduce_buffer_at_exit(rank: int) -> None:
    _registered.append(allreduce_buffer(rank))
    atexit.register(_remove, _registered[-1])


def registered() -> bool:
    """Whether this process registered the removal of its buffer already."""
    return bool(_registered)


def remove_allreduce_buffer_now() -> None:
    """For a process being stopped (``runtime.lifeline``): its buffer goes now (a killed process's
    goes with its reaper, ``runtime.reaper``)."""
    for p in _registered:
        _remove(p)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:  # not created (no shared-memory all-reduce), or already gone
        pass
