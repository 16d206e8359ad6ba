"""Delegate pairs notice a silent connection by their heartbeat, well before the training process's
``timeout_s``, and never restart a healthy pair that is idle or held up by its receiving training process.

A stopped process (SIGSTOP) keeps its sockets open and sends nothing, no FIN, no RST: to its peer it
looks like a downed interface (tests/lab/test_lab_failover.py takes a real interface down).
"""
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "delegated"))

from workers import launch, payload, same  # noqa: E402

from ds_pipemorph.runtime.transport.delegated.delegate_proc import liveness_for  # noqa: E402

N = 8


def _transport(rank, world, timeout_s, **kw):
    from ds_pipemorph.runtime.transport.delegated.transport import DelegatedTransport

    return DelegatedTransport(rank, rank, list(range(world)), timeout_s=timeout_s, queues=1, **kw)


def _summary(tr):
    return dict(events=list(tr.events), duplicates=sum(d.duplicates for d in tr._dirs.values()),
                seqs={f"{d.kind}{'s' if d.sending else 'r'}": d.next_seq for d in tr._dirs.values()})


def silent_receiver(rank, world, timeout_s, liveness_s, stopped_s):
    """Stage 1 stops its F receiver delegate (SIGSTOP) after the second message and lets it run again
    ``stopped_s`` later; meanwhile stage 0 keeps sending. Stage 1 reports when the replacement of the
    sender delegate announced generation 1 in the store, counted from the stop."""
    import torch.distributed as dist

    tr = _transport(rank, world, timeout_s, liveness_s=liveness_s)
    out = {}
    try:
        tr.start_link(0)
        tr.wait_ready()
        dist.barrier()
        if rank == 0:
            for m in range(N):
                tr.send("F", m, payload("F", m))
                time.sleep(0.05)
            tr.wait_sends()
        else:
            out["ok"] = [same(tr.recv("F", m), payload("F", m)) for m in range(2)]
            pid = tr.delegate_pid(0, "F", False, 0)
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=timeout_s))
            key = f"{tr._rendezvous_prefix(0, 'F', 0)}/g1/up"
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            resume = threading.Timer(stopped_s, os.kill, (pid, signal.SIGCONT))
            resume.start()
            try:
                while not store.check([key]) and time.monotonic() - stopped < stopped_s:
                    time.sleep(0.05)
                out["replaced_after_s"] = time.monotonic() - stopped if store.check([key]) else None
                t0 = time.monotonic()
                out["ok"] += [same(tr.recv("F", m), payload("F", m)) for m in range(2, N)]
                out["rest_s"] = time.monotonic() - t0
            finally:
                resume.join()
        dist.barrier()  # stage 1's receiver delegate stays up until stage 0 holds every acknowledgement
        out.update(_summary(tr))
    finally:
        tr.close()
    return out


@pytest.mark.timeout(240)
def test_a_silent_receiver_delegate_is_noticed_by_its_peer_within_liveness_and_nothing_is_lost_or_duplicated():
    timeout_s, liveness_s = 30.0, 1.5
    stopped_s = 4 * liveness_s
    res = launch(2, silent_receiver, timeout_s, liveness_s, stopped_s, timeout=200.0)
    r0, r1 = res[0], res[1]
    assert r1["ok"] == [True] * N
    # The sender delegate heard nothing for liveness_s and was replaced while its peer was still stopped
    # (beats every liveness_s / 4; the rest is the restart on a loaded host), long before timeout_s.
    assert r1["replaced_after_s"] is not None, (r0["events"], r1["events"])
    # (The peer's last beat may have come up to a beat period, liveness_s / 4, before the stop.)
    assert 0.5 * liveness_s <= r1["replaced_after_s"] < stopped_s
    assert any("sender delegate of F queue 0" in e and "lost its peer" in e and "generation 1" in e
               for e in r0["events"]), r0["events"]
    # The stopped receiver delegate, once running again, found its pair gone and was replaced too.
    assert any("receiver delegate of F queue 0" in e and "generation 1" in e for e in r1["events"]), r1["events"]
    assert r1["rest_s"] < timeout_s
    # Each message reached the receiving ring once: no duplicate to drop.
    assert r0["seqs"]["Fs"] == r1["seqs"]["Fr"] == N
    assert r1["duplicates"] == 0


def idle_then_held_up(rank, world, timeout_s, idle_s, held_s):
    """Both stages start link 0 and do nothing for ``idle_s`` (several timeout_s); then stage 0 sends
    N messages into rings of 2 slots while stage 1 takes none for ``held_s`` (several liveness_s):
    its receiver delegate waits for a free slot, stage 0's sender delegate for its ack."""
    import torch.distributed as dist

    tr = _transport(rank, world, timeout_s, num_slots=2, slot_bytes=4096)
    out = {}
    try:
        tr.start_link(0)
        tr.wait_ready()
        time.sleep(idle_s)
        dist.barrier()
        if rank == 0:
            for m in range(N):
                tr.send("F", m, payload("F", m))
            tr.wait_sends()
        else:
            time.sleep(held_s)
            out["ok"] = [same(tr.recv("F", m), payload("F", m)) for m in range(N)]
        dist.barrier()
        out.update(_summary(tr))
    finally:
        tr.close()
    return out


@pytest.mark.timeout(240)
def test_healthy_pairs_that_are_idle_or_held_up_by_their_training_process_are_never_restarted():
    timeout_s = 8.0
    liveness_s = liveness_for(timeout_s)
    res = launch(2, idle_then_held_up, timeout_s, 2.5 * timeout_s, 3 * liveness_s, timeout=200.0)
    assert res[1]["ok"] == [True] * N
    for r in (0, 1):
        assert res[r]["events"] == [], res[r]["events"]
        assert res[r]["duplicates"] == 0


def test_liveness_is_well_below_the_training_processes_timeout():
    for timeout_s in (0.5, 4.0, 30.0, 300.0):
        assert 0 < liveness_for(timeout_s) <= timeout_s / 4
    assert liveness_for(300.0) == liveness_for(30.0)  # capped: a long timeout_s does not slow the failover


def test_a_liveness_not_below_timeout_is_refused():
    from ds_pipemorph.runtime.transport.delegated.transport import DelegatedTransport

    with pytest.raises(ValueError, match="liveness_s"):
        DelegatedTransport(0, 0, [0, 1], timeout_s=5.0, liveness_s=5.0, store_port=1)
