"""Delay injection: a direct link with delay c holds one message in flight, so the sender blocks
about c per message after the first (head-of-line blocking), and the receiver sees each message
c later. Real gloo ranks, real DirectTransport."""
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.runtime.transport.direct import DirectTransport
from ds_pipemorph.inject.delays import DelayInjector, DelaySchedule, DelayTraceFile, load_trace

DELAY_MS = 40.0
MESSAGES = 6


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tr = DirectTransport(rank, rank, [0, 1], timeout_s=30.0)
        if rank == 0:
            inj = DelayInjector(tr, 0, DelaySchedule([DELAY_MS]), timeout_s=30.0)
            dist.barrier()
            t0 = time.monotonic()
            for m in range(MESSAGES):
                inj.send("F", m, (torch.full((3, 5), float(m)), torch.arange(m + 1)))
            issued = time.monotonic() - t0
            inj.wait_sends()
            out.put(("sender", issued, inj.blocked_s[0], inj.sent[0]))
            inj.close()
        else:
            for m in range(MESSAGES):
                tr.post_recv("F", m)
            dist.barrier()
            t0 = time.monotonic()
            arrivals, ok = [], True
            for m in range(MESSAGES):
                a, b = tr.recv("F", m)
                arrivals.append(time.monotonic() - t0)
                ok &= bool((a == m).all()) and b.tolist() == list(range(m + 1))
            out.put(("receiver", arrivals, ok))
            tr.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_direct_link_with_delay_blocks_the_sender_per_message_and_delays_delivery():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(2):
        item = out.get(timeout=100)
        results[item[0]] = item[1:]
    for p in procs:
        p.join(timeout=30)
    issued, blocked, sent = results["sender"]
    arrivals, ok = results["receiver"]
    c = DELAY_MS / 1000
    assert ok and sent == MESSAGES
    # The sender waits for each earlier message to be delivered: (MESSAGES-1) delays, give or take.
    assert (MESSAGES - 1) * c * 0.9 <= blocked <= (MESSAGES - 1) * c + 0.5
    assert issued >= (MESSAGES - 1) * c * 0.9
    # The receiver sees the first message after one delay and then one per delay: message k no
    # sooner than k + 1 delays. (Counted from the start, not between two messages: the receiver may
    # see one late on a busy host, which shortens the gap to the next without any message being early.)
    assert all(a >= (k + 1) * c * 0.9 for k, a in enumerate(arrivals)), arrivals


def test_trace_replays_delays_in_wall_clock_time(tmp_path):
    tr = DelayTraceFile(points=[{"t": 0.0, "links_ms": [0, 0]}, {"t": 0.05, "links_ms": [0, 30]}])
    assert tr.at(0.0) == [0, 0] and tr.at(0.049) == [0, 0] and tr.at(1.0) == [0, 30]
    sched = DelaySchedule([0, 0], tr)
    assert sched.delay_ms(1) == 0
    time.sleep(0.06)
    assert sched.delay_ms(1) == 30


@pytest.mark.parametrize(
    "text,needle",
    [
        ("points: [{t: 0, links_ms: [0, 5]}]", "has 2 delays, the job has 3 links"),
        ("points: [{t: 0, links_ms: [0, -5, 0]}]", "link 1 has a delay of -5 ms"),
        ("points: [{t: 1, links_ms: [0, 0, 0]}, {t: 0.5, links_ms: [0, 0, 0]}]", "times must not decrease"),
        ("points: []", "points"),
    ],
)
def test_bad_traces_are_refused_with_one_sentence(tmp_path, text, needle):
    p = tmp_path / "trace.yaml"
    p.write_text(text)
    with pytest.raises(BadInput, match=needle):
        load_trace(str(p), 3)


def test_unreadable_trace_is_refused(tmp_path):
    with pytest.raises(BadInput, match="cannot read"):
        load_trace(str(tmp_path / "missing.yaml"), 3)
