"""Errors of the delegated path are one sentence naming rank, op, link and queue."""
import os

import pytest
import torch.distributed as dist
from workers import free_port

from ds_pipemorph.runtime.transport.delegated.transport import DelegatedTransport
from ds_pipemorph.runtime.transport.protocol import TransportTimeout


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rank 3: delegated transport needs at least 1 queue"):
        DelegatedTransport(3, 0, [0, 1], queues=0, store_port=1)
    with pytest.raises(ValueError, match="rank 3: staging slots must hold at least 4096 bytes"):
        DelegatedTransport(3, 0, [0, 1], slot_bytes=100, store_port=1)


@pytest.mark.timeout(60)
def test_receive_with_no_peer_times_out_naming_rank_op_link_and_queue():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True)  # the job's store; no peer ever joins
    tr = DelegatedTransport(0, 0, [0, 1], timeout_s=1.5, queues=2, store_addr="127.0.0.1", store_port=port)
    try:
        with pytest.raises(TransportTimeout, match=r"^rank 0: timed out after 1.5 s waiting for RECV_B0 on link 0 "
                                                   r"from stage 1 \(next message 0 is due in queue 0\)$"):
            tr.recv("B", 0)
    finally:
        tr.close()
        del store
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"pm_{os.getpid()}_")]  # rings unlinked


@pytest.mark.timeout(330)
@pytest.mark.parametrize("close", [True, False], ids=["closed", "parent-died"])
def test_delegates_exit_when_the_transport_closes_or_the_training_process_dies(close):
    import time

    import bodies
    import torch.multiprocessing as mp

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=bodies.orphan_delegates, args=(port, out, close))
    p.start()
    # Starting the delegates imports torch in three processes and may load the staging op: on a busy
    # host (or one whose extension cache another checkout just rebuilt) that takes minutes, not seconds.
    pids, alive_after_close = out.get(timeout=240)
    p.join(timeout=30)
    assert len(pids) == 2  # F sender and B receiver (1 queue each)
    if close:
        assert alive_after_close == []
    deadline = time.monotonic() + 10
    while any(bodies._running(q) for q in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(bodies._running(q) for q in pids)
    time.sleep(0.5)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"pm_{p.pid}_")]  # no ring left behind
    del store
