"""One rank per lab node: rank 0 sends SIZE bytes to every other rank in turn and times each send
until the receiver's 1-byte acknowledgement arrives; rank 0 prints {peer: seconds} as JSON.

    python gloo_transfer.py RANK WORLD MASTER_ADDR PORT SIZE      (GLOO_SOCKET_IFNAME set)
"""
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main(rank: int, world: int, master: str, port: int, size: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    payload = torch.zeros(size, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    out = {}
    for peer in range(1, world):
        for timed in (False, True):  # the first exchange opens the connection
            n = size if timed else 1
            if rank == 0:
                t0 = time.perf_counter()
                dist.send(payload[:n], peer)
                dist.recv(ack, peer)
                if timed:
                    out[peer] = time.perf_counter() - t0
            elif rank == peer:
                dist.recv(payload[:n], 0)
                dist.send(ack, 0)
    dist.barrier()
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
