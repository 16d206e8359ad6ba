"""Hand-written NVTX rows for the reader's unit tests, in the schema of an nsys SQLite export.

These are parsing tests with round numbers, not stand-ins for the engine: the rows follow the NVTX
contract documented in ``ds_pipemorph/trace/nsys.py`` (``ITER<k>`` with the rank as payload, op
ranges with category ``stage<S>`` and the micro-batch as payload, registered messages), which
``tests/nvtx`` checks against a real job. Times are given in ms and stored in ns.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvtx"))
from nsys_schema import INT64, PUSH_POP, START_END, NsysExport, gtid  # noqa: E402,F401

MS = 1_000_000
SESSION_UTC_NS = 1_700_000_000_000_000_000

# Two stages, two micro-batches; one iteration (ms from its start). Iteration 1 = the same + 100 ms.
STAGE0 = [("F0", 0, 10), ("SEND_F0", 10, 12), ("F1", 12, 22), ("SEND_F1", 22, 24), ("RECV_B0", 24, 40),
          ("B0", 40, 50), ("W0", 50, 60), ("RECV_B1", 60, 62), ("B1", 62, 72), ("W1", 72, 82)]
STAGE1 = [("RECV_F0", 0, 13), ("F0", 13, 23), ("B0", 23, 33), ("SEND_B0", 33, 38), ("RECV_F1", 38, 39),
          ("F1", 39, 49), ("B1", 49, 59), ("SEND_B1", 59, 61), ("W0", 61, 71), ("W1", 71, 81)]
ITERS = [(0, 0, 85), (1, 100, 190)]

# Three stages, one micro-batch, no ITER ranges, no categories.
THREE = [
    [("F0", 0, 10), ("SEND_F0", 10, 11), ("RECV_B0", 11, 53), ("B0", 53, 63), ("W0", 63, 73)],
    [("RECV_F0", 0, 12), ("F0", 12, 22), ("SEND_F0", 22, 24), ("RECV_B0", 24, 40), ("B0", 40, 50),
     ("SEND_B0", 50, 52), ("W0", 52, 62)],
    [("RECV_F0", 0, 30), ("F0", 30, 34), ("B0", 34, 36), ("SEND_B0", 36, 38), ("W0", 38, 42)],
]


def ns(ms: float | None) -> int | None:
    return None if ms is None else round(ms * MS)


class Rows:
    """An export under construction; ``registered`` puts messages in StringIds (as the nvtx package does)."""

    def __init__(self, path: Path, registered: bool = True):
        self.db = NsysExport(path, session_start_utc_ns=SESSION_UTC_NS)
        self.registered = registered

    def domain(self, pid: int, domain_id: int, name: str = "pipemorph", g: int | None = None) -> None:
        self.db.domain(gtid(pid) if g is None else g, 0, domain_id, name)

    def category(self, pid: int, domain_id: int, cid: int, name: str) -> None:
        self.db.category(gtid(pid), 0, domain_id, cid, name)

    def range(self, pid: int, domain_id: int, name: str, start_ms: float, end_ms: float | None, category: int | None = None,
              payload: int | None = None, event_type: int = PUSH_POP, g: int | None = None) -> None:
        g = gtid(pid) if g is None else g
        msg = {"registered": name} if self.registered else {"text": name}
        self.db.range(g, domain_id, ns(start_ms), ns(end_ms), category=category, color=0xFF0000FF,
                      payload_type=INT64 if payload is not None else 0, payload=payload, event_type=event_type,
                      end_g=g if event_type == START_END and end_ms is not None else None, **msg)

    def close(self) -> Path:
        return self.db.close()


def _mb(name: str) -> int:
    return int(name.lstrip("SENDRCV_FBW"))


def two_stage(path: Path, registered: bool = True, replicas: int = 1, open_last_iter: bool = False,
              shift_replica_ms: float = 0.0) -> Path:
    """2 stages x ``replicas``, 2 iterations, as the engine emits them (see the module docstring).

    Replica d of stage s is global rank s * replicas + d (DeepSpeed's numbering). Process ids are
    handed out so that pid order is not rank order with replicas: stage 0 replica 1 gets the lowest
    pid. Replica d runs ``d * shift_replica_ms`` later. Each process numbers the pipemorph domain
    differently (ids 1, 2, ...); with replicas, pid 102 also creates a domain 'other' under id 1
    with look-alike ranges that must be ignored.
    """
    db = Rows(path, registered)
    procs = [(s, d) for d in range(replicas) for s in range(2)]  # (stage, replica) in pid order
    if replicas > 1:
        procs = [(0, 1), (1, 0), (0, 0), (1, 1)] + [(s, d) for d in range(2, replicas) for s in range(2)]
    for p, (stage, replica) in enumerate(procs):
        pid, did, rank, shift = 100 + p, p + 1, stage * replicas + replica, replica * shift_replica_ms
        db.domain(pid, did)
        db.category(pid, did, 7, f"stage{stage}")
        if pid == 102:
            db.domain(pid, 1, "other")
            db.range(pid, 1, "F0", 0, 500)
        for k, t0, t1 in ITERS:
            end = None if (open_last_iter and k == 1) else t1 + shift
            db.range(pid, did, f"ITER{k}", t0 + shift, end, category=7, payload=rank)
            for name, s, e in (STAGE0 if stage == 0 else STAGE1):
                db.range(pid, did, name, t0 + shift + s, t0 + shift + e, category=7, payload=_mb(name))
            db.range(pid, did, "OptimizerStep", t0 + shift + 83, t0 + shift + 84, category=7)
    return db.close()


def three_stage(path: Path, registered: bool = False) -> Path:
    """3 stages, inline text, no categories, no ITER ranges; globalTid with hardware and VM ids."""
    db = Rows(path, registered)
    for s, rows in enumerate(THREE):
        g = gtid(100 + s, tid=100 + s + 7, hw=3, vm=1)
        db.domain(0, 1, g=g)
        for name, a, b in rows:
            db.range(0, 1, name, a, b, g=g)
    return db.close()
