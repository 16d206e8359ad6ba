"""One of two gloo ranks: messages through DeepSpeed's pipeline p2p with ``scripts/gpu_check/host_p2p.py``
installed, forced to stage CPU tensors (without a GPU, the only way to run its copies).

    RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python host_p2p_worker.py

What ``PipelineEngine`` does under gloo: ``p2p.send``/``p2p.recv`` (its constructor's first message, then
activations and gradients), ``p2p.send_obj``/``recv_obj``, and ``isend``/``irecv`` as ``DirectTransport``
uses them (``wait`` with a timeout, ``is_completed``). Prints ``{"rank": r, "staged": {...}}``; exits non-zero when a
message arrives wrong.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu_check"))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.pipe import p2p  # noqa: E402

import host_p2p  # noqa: E402


class Grid:
    """What ``p2p`` asks of DeepSpeed's ``PipelineParallelGrid``: two stages, stage s on rank s."""

    pipe_parallel_size = 2

    def get_stage_id(self) -> int:
        return dist.get_rank()

    def stage_to_global(self, stage_id: int) -> int:
        return stage_id


def main() -> int:
    deepspeed.init_distributed(dist_backend="gloo")
    host_p2p.install(needs_staging=lambda tensor, group: True)
    p2p.init_process_groups(Grid())
    rank = dist.get_rank()
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    if rank == 0:
        p2p.send(x + 1, 1)
        got = torch.zeros(2, 3)
        p2p.recv(got, 1)
        assert torch.equal(got, x * 2), got
        p2p.send_obj({"layout": [2, 3]}, 1)
        assert dist.isend(x + 3, 1).wait() is not False
        work = dist.isend(x + 4, 1)
        work.is_completed()  # DirectTransport prunes its sends so
        assert work.wait() is not False
    else:
        got = torch.zeros(2, 3)
        p2p.recv(got, 0)
        assert torch.equal(got, x + 1), got
        p2p.send(x * 2, 0)
        assert p2p.recv_obj(0) == {"layout": [2, 3]}
        got = torch.zeros(2, 3)
        dist.irecv(got, 0).wait()
        assert torch.equal(got, x + 3), got
        got = torch.zeros(2, 3)
        assert dist.irecv(got, 0).wait(timedelta(seconds=20)) is not False  # as DirectTransport waits
        assert torch.equal(got, x + 4), got
    print(json.dumps({"rank": rank, "staged": host_p2p.STAGED}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
