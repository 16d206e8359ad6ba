"""Clock offsets between neighbouring stages, for one-way link delays from op records.

NTP-style ping-pong on each link in turn (the sample with the smallest round trip wins). Two ranks
of one host read one ``CLOCK_MONOTONIC`` (same kernel boot id): their offset is 0 exactly, and a
ping estimate there is only noise (on a loaded host all pings can be disturbed: an error of a few
ms that shifts every measured delay of the link). So when the boot ids agree and the estimate is
within its own uncertainty (half the best round trip) of 0, the offset is 0; otherwise (other
hosts, or a container with its own time namespace) the estimate stands.
"""
from __future__ import annotations

import hashlib
import socket
import time

import torch
import torch.distributed as dist

CLOCK_TAG = 3 << 24
PINGS = 9


def boot_key() -> int:
    """A 62-bit key that is equal for processes reading the same monotonic clock (same kernel boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            text = f.read().strip()
    except OSError:  # not Linux: only the host name (the offset must then also test ~0)
        text = ""
    digest = hashlib.sha256(f"{socket.gethostname()}|{text}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def settle(estimate_ns: int, best_rtt_ns: int, same_clock: bool) -> int:
    """The offset to use: 0 for one clock read by both when the estimate is within its uncertainty."""
    if same_clock and abs(estimate_ns) <= best_rtt_ns // 2 + 1:
        return 0
    return estimate_ns


def estimate_clock_offsets(grid, stage_id: int, stages: int) -> dict[int, int]:
    """Clock offset in ns (this rank's monotonic clock minus the neighbour's) per neighbouring stage."""
    out: dict[int, int] = {}
    key = boot_key()
    for link in range(stages - 1):
        if stage_id not in (link, link + 1):
            continue
        peer_stage = link + 1 if stage_id == link else link
        peer = grid.stage_to_global(peer_stage)
        buf = torch.zeros(2, dtype=torch.int64)
        best = None
        if stage_id == link:  # initiator
            for _ in range(PINGS):
                t0 = time.monotonic_ns()
                dist.send(torch.tensor([t0, 0], dtype=torch.int64), peer, tag=CLOCK_TAG)
                dist.recv(buf, peer, tag=CLOCK_TAG)
                t3 = time.monotonic_ns()
                t1, t2 = buf.tolist()
                rtt = (t3 - t0) - (t2 - t1)
                offset = ((t1 - t0) + (t2 - t3)) // 2  # peer clock minus mine
                if best is None or rtt < best[0]:
                    best = (rtt, offset)
            dist.recv(buf, peer, tag=CLOCK_TAG)  # the responder's boot key; the initiator decides
            same = int(buf[0].item()) == key
            peer_minus_mine = settle(best[1], best[0], same)
            out[peer_stage] = -peer_minus_mine
            dist.send(torch.tensor([peer_minus_mine, 0], dtype=torch.int64), peer, tag=CLOCK_TAG)
        else:
            for _ in range(PINGS):
                dist.recv(buf, peer, tag=CLOCK_TAG)
                t1 = time.monotonic_ns()
                dist.send(torch.tensor([t1, time.monotonic_ns()], dtype=torch.int64), peer, tag=CLOCK_TAG)
            dist.send(torch.tensor([key, 0], dtype=torch.int64), peer, tag=CLOCK_TAG)
            dist.recv(buf, peer, tag=CLOCK_TAG)
            out[peer_stage] = int(buf[0].item())
    return out
