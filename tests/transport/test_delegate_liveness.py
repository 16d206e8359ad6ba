"""Delegate pairs are judged by their kernels, not by their speed: a pair is never restarted because
a delegate is slow, stopped, idle or held up by its receiving training process; its heartbeat
connection carries the kernel's keep-alive and user timeout of ``liveness_s``, which end it when
the peer's host stops acknowledging (tests/lab/test_lab_failover.py takes a real interface down).

A stopped process (SIGSTOP) keeps its sockets open and sends nothing, but its kernel still
acknowledges what it is sent: the extreme of a process starved of CPU.
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


def stopped_receiver(rank, world, timeout_s, liveness_s, stopped_s):
    """Stage 1 stops its F receiver delegate (SIGSTOP) after the second message and lets it run again
    ``stopped_s`` later (several liveness_s); meanwhile stage 0 keeps sending. Stage 1 reports whether
    a generation 1 of the pair was ever announced in the store."""
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
                t0 = time.monotonic()
                out["ok"] += [same(tr.recv("F", m), payload("F", m)) for m in range(2, N)]
                out["rest_s"] = time.monotonic() - t0
                out["stopped_s"] = time.monotonic() - stopped
            finally:
                resume.join()
            out["replaced"] = store.check([key])
        dist.barrier()  # stage 1's receiver delegate stays up until stage 0 holds every acknowledgement
        out.update(_summary(tr))
    finally:
        tr.close()
    return out


@pytest.mark.timeout(240)
def test_a_stopped_delegate_is_not_taken_for_a_lost_one_and_its_messages_arrive_once_it_runs_again():
    timeout_s, liveness_s = 30.0, 1.5
    stopped_s = 4 * liveness_s
    res = launch(2, stopped_receiver, timeout_s, liveness_s, stopped_s, timeout=200.0)
    r0, r1 = res[0], res[1]
    assert r1["ok"] == [True] * N
    # Stopped for 4 liveness_s, and still the same pair: no end restarted, no generation 1 announced.
    assert r1["stopped_s"] >= stopped_s - 0.5
    assert r0["events"] == [] and r1["events"] == [], (r0["events"], r1["events"])
    assert r1["replaced"] is False
    assert r1["rest_s"] < timeout_s
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


def test_the_heartbeat_connection_is_judged_by_the_kernel_within_liveness():
    import socket

    from ds_pipemorph.runtime.transport.delegated.delegate_proc import DelegateSpec, _Heartbeat

    spec = DelegateSpec(role="send", rank=0, link=0, kind="F", queue=0, ring_name="x", op_name="x", op_path="x",
                        store_addr="127.0.0.1", store_port=1, prefix="p", parent_pid=0, timeout_s=30.0, liveness_s=2.5)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        with socket.create_connection(srv.getsockname()) as sock:
            _Heartbeat(spec, sock, None, None, 0, "", None)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500
            # Probes start after 1 s of quiet, every second: the user timeout, not the count, decides.
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1


def test_liveness_is_well_below_the_training_processes_timeout():
    for timeout_s in (0.5, 4.0, 30.0, 300.0):
        assert 0 < liveness_for(timeout_s) <= timeout_s / 4
    assert liveness_for(300.0) == liveness_for(30.0)  # capped: a long timeout_s does not slow the failover


def test_a_liveness_not_below_timeout_is_refused():
    from ds_pipemorph.runtime.transport.delegated.transport import DelegatedTransport

    with pytest.raises(ValueError, match="liveness_s"):
        DelegatedTransport(0, 0, [0, 1], timeout_s=5.0, liveness_s=5.0, store_port=1)
