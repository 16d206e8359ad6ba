"""Plays lowered streams through the direct path under NCCL's rules (``inject.nccl_double``), no engine.

    python tests/runtime/forkrun.py S tests/runtime/stream_player.py SPEC.json OUT_DIR

SPEC: {"name", "timeout_s", "streams": per rank, its ops as [kind, mb]} (rank r is stage r), and
optionally "iterations" (default 1), "groups" (true: each run ``plan.ir.nccl.nccl_groups`` names is
issued between ``begin_group`` and ``end_group``, as the engine does) and "p2p" ("double", the
default: ``NcclRules``; "torch": torch.distributed's own ``isend``/``irecv``/``batch_isend_irecv`` on
gloo, issued in order as under NCCL). Each op does what the engine's does to the transport:
RECV_F/RECV_B m posts the receive, F m (stages > 0) and B m (stages < S-1) wait for their message,
SEND_F/SEND_B m send a tensor whose values name the message; each iteration ends with
``wait_sends``. Writes OUT_DIR/<name>.rank<r>.json: {"ok": true, "received": {...}} or
{"error": type, "text": message}.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ds_pipemorph.inject.nccl_double import NcclRules  # noqa: E402
from ds_pipemorph.plan.ir.nccl import nccl_groups  # noqa: E402
from ds_pipemorph.plan.ir.ops import Op  # noqa: E402
from ds_pipemorph.runtime.transport.direct import DirectTransport, TorchP2P  # noqa: E402
from ds_pipemorph.runtime.transport.protocol import TransportError  # noqa: E402


def payload(kind: str, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors of different shapes whose values name the message."""
    code = (1 if kind == "F" else 2) * 100 + mb
    return torch.full((3,), float(code)), torch.full((2, 2), float(-code))


class InOrderTorchP2P(TorchP2P):
    """torch.distributed's point-to-point on gloo, treated as in order (the direct path issues as for NCCL)."""

    def __init__(self):
        super().__init__()
        self.in_order = True  # over the backend's answer, which TorchP2P sets per instance


def play(spec: dict, rank: int) -> dict:
    S, stream = len(spec["streams"]), spec["streams"][rank]
    p2p = InOrderTorchP2P() if spec.get("p2p") == "torch" else NcclRules(rank, spec["timeout_s"])
    transport = DirectTransport(rank, rank, list(range(S)), timeout_s=spec["timeout_s"], p2p=p2p)
    groups = nccl_groups([[Op(kind, mb, rank) for kind, mb in stream]])[0] if spec.get("groups") else []
    opens, closes = {g.start for g in groups}, {g.stop - 1 for g in groups}
    received = {}
    try:
        for _ in range(spec.get("iterations", 1)):
            for i, (kind, mb) in enumerate(stream):
                if i in opens:
                    transport.begin_group()
                if kind in ("RECV_F", "RECV_B"):
                    transport.post_recv(kind[-1], mb)
                elif kind == "F" and rank > 0 or kind == "B" and rank < S - 1:
                    a, b = transport.recv(kind, mb)
                    received[f"{kind}{mb}"] = received.get(f"{kind}{mb}", []) + [[a.tolist(), b.tolist()]]
                elif kind in ("SEND_F", "SEND_B"):
                    transport.send(kind[-1], mb, payload(kind[-1], mb))
                if i in closes:
                    transport.end_group()
            transport.wait_sends()
    except TransportError as e:
        return {"error": type(e).__name__, "text": str(e)}
    finally:
        transport.close()
    return {"ok": True, "received": received}


def main() -> int:
    spec_path, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for spec in json.load(open(spec_path)):
        out = play(spec, rank)
        with open(os.path.join(out_dir, f"{spec['name']}.rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if "error" in out:  # the pair's queues are stuck: let the peer time out too, then leave
            time.sleep(spec["timeout_s"] + 2)
            os._exit(0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
