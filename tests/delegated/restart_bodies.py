"""Rank bodies of test_restarts.py (run in spawned processes through workers.run).

Each case builds a fresh transport on both ranks (same order on both: the order names the
rendezvous), exchanges ``n`` F messages (stage 0 to 1) and ``n`` B messages back, one queue per
direction and 4 KiB slots (the bigger messages take several pieces), with a fault in the F direction.
"""
import time

import torch
import torch.distributed as dist
from workers import payload, same

from ds_pipemorph.runtime.transport.delegated.transport import DelegatedTransport


def big(kind: str, mb: int):
    """A message of several 4 KiB pieces, mixed with the small ones of ``payload``."""
    if mb % 2:
        return payload(kind, mb)
    g = torch.Generator().manual_seed(31 * mb + (1 if kind == "F" else 2))
    return torch.randn(2500 + mb, generator=g)


def _transport(rank, world, fault_at=None, timeout_s=60.0):
    return DelegatedTransport(rank, rank, list(range(world)), timeout_s=timeout_s, queues=1, slot_bytes=4096,
                              fault_at=fault_at)


def _summary(tr) -> dict:
    return dict(events=list(tr.events), duplicates=sum(d.duplicates for d in tr._dirs.values()),
                seqs={f"{d.kind}{'s' if d.sending else 'r'}": d.next_seq for d in tr._dirs.values()},
                born={f"{d.kind}{'s' if d.sending else 'r'}": d.queues[0].born for d in tr._dirs.values()})


def exchange(rank, tr, n) -> list:
    ok = []
    if rank == 0:
        for m in range(n):
            tr.send("F", m, big("F", m))
        ok += [same(tr.recv("B", m), big("B", m)) for m in range(n)]
    else:
        ok += [same(tr.recv("F", m), big("F", m)) for m in range(n)]
        for m in range(n):
            tr.send("B", m, big("B", m))
    tr.wait_sends()
    return ok


def forced_restarts(rank, world, cases, n):
    """Per case (role, point, message): the F delegate of that role (stage 0 sends, stage 1 receives)
    dies at that point of the exchange in generation 0. Returns per case what arrived, the restarts
    and how long the case took."""
    out = []
    for role, point, msg in cases:
        mine = (role == "send") == (rank == 0)
        tr = _transport(rank, world, {role: (point, msg)} if mine else None)
        t0 = time.monotonic()
        try:
            ok = exchange(rank, tr, n)
            took = time.monotonic() - t0
            dist.barrier()  # both ends hold every acknowledgement before either closes
            out.append(dict(case=f"{role}:{point}:{msg}", ok=ok, took=took, **_summary(tr)))
        finally:
            tr.close()
    return out


def close_races(rank, world, n, stall_s):
    """Two ways a rank closes while its peer is not done, without a barrier between them.

    1. Stage 0's B receiver delegate stalls ``stall_s`` between publishing the last B message and
       acknowledging it; stage 0 takes the message and closes at once. Stage 1's ``wait_sends`` must
       still return: the stopped delegate sends the acknowledgement it owes before it exits.
    2. Stage 0 closes before stage 1 sends the last B message: stage 1's ``wait_sends`` fails at once
       with a sentence saying the peer closed first (no restart, no wait until its timeout)."""
    out = {}
    tr = _transport(rank, world, {"recv": ("published", n - 1, stall_s)} if rank == 0 else None)
    try:
        out["ok"] = exchange(rank, tr, n) if rank == 1 else None
        if rank == 0:
            for m in range(n):
                tr.send("F", m, big("F", m))
            out["ok"] = [same(tr.recv("B", m), big("B", m)) for m in range(n)]
            tr.wait_sends()
    finally:
        tr.close()  # stage 0: right after taking the last message, its acknowledgement not yet sent
    out["first"] = _summary(tr)
    dist.barrier()
    tr = _transport(rank, world, timeout_s=60.0)
    try:
        if rank == 0:
            for m in range(n):
                tr.send("F", m, big("F", m))
            out["ok2"] = [same(tr.recv("B", m), big("B", m)) for m in range(n - 1)]
            tr.wait_sends()
            tr.close()  # before B n-1 is sent
            dist.barrier()
        else:
            out["ok2"] = [same(tr.recv("F", m), big("F", m)) for m in range(n)]
            for m in range(n - 1):
                tr.send("B", m, big("B", m))
            dist.barrier()
            tr.send("B", n - 1, big("B", n - 1))
            t0 = time.monotonic()
            try:
                tr.wait_sends()
                out["refused"] = None
            except Exception as e:  # noqa: BLE001
                out["refused"] = f"{type(e).__name__}: {e}"
            out["refused_after_s"] = time.monotonic() - t0
        out["second"] = _summary(tr)
    finally:
        tr.close()
    return out


def busy_iterations(rank, world, iterations, n):
    """``iterations`` iterations of n F and n B messages over 2 queues per direction, each iteration
    ending with ``wait_sends`` (what the engine does); on a busy host no delegate may restart."""
    tr = DelegatedTransport(rank, rank, list(range(world)), timeout_s=60.0, queues=2)
    bad = 0
    t0 = time.monotonic()
    try:
        for it in range(iterations):
            if rank == 0:
                for m in range(n):
                    tr.send("F", m, payload("F", m + it))
                bad += sum(not same(tr.recv("B", m), payload("B", m + it)) for m in range(n))
            else:
                bad += sum(not same(tr.recv("F", m), payload("F", m + it)) for m in range(n))
                for m in range(n):
                    tr.send("B", m, payload("B", m + it))
            tr.wait_sends()
        took = time.monotonic() - t0
        dist.barrier()
        return dict(bad=bad, took=took, pids=sorted(q.proc.pid for d in tr._dirs.values() for q in d.queues),
                    **_summary(tr))
    finally:
        tr.close()
