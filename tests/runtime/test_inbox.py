"""The inbox of readiness-driven dispatch on a stand-in transport: completions in any order become
readiness events, and nothing waits without a bound."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from ds_pipemorph.runtime.inbox import Inbox
from ds_pipemorph.runtime.oprecords import OpRecorder
from ds_pipemorph.runtime.transport.protocol import TransportTimeout

pytestmark = pytest.mark.timeout(30)


class GatedTransport:
    """``recv(kind, mb)`` returns once the test opens that message's gate (never, if it does not)."""

    def __init__(self):
        self.gates: dict[tuple[str, int], threading.Event] = {}

    def post_recv(self, kind: str, mb: int) -> None:
        self.gates.setdefault((kind, mb), threading.Event())

    def recv(self, kind: str, mb: int):
        self.gates[(kind, mb)].wait()
        return f"{kind}{mb}"

    def open(self, kind: str, mb: int) -> None:
        self.gates[(kind, mb)].set()


def _drained_until(inbox: Inbox, n: int) -> list:
    seen: list = []
    deadline = time.monotonic() + 5
    while len(seen) < n and time.monotonic() < deadline:
        if not inbox.wait_any([]):
            seen += inbox.drain()
            break
        seen += inbox.drain()
    return seen


def test_completions_arrive_in_the_order_the_messages_come_not_the_order_posted():
    t = GatedTransport()
    inbox = Inbox(t, workers=4, timeout_s=5, rank=0)
    recorder = OpRecorder(nvtx_enabled=False)
    for mb in range(3):
        inbox.post("F", mb, recorder)
    t.open("F", 2)
    assert _drained_until(inbox, 1) == [("F", 2)]
    assert inbox.arrived("F", 2) and not inbox.arrived("F", 0)
    assert inbox.take("F", 2) == "F2"
    t.open("F", 0)
    t.open("F", 1)
    assert sorted(_drained_until(inbox, 2)) == [("F", 0), ("F", 1)]
    assert [inbox.take("F", m) for m in (1, 0)] == ["F1", "F0"]
    assert inbox.outstanding == 0 and inbox.drain() == []
    assert sorted(r.op for r in recorder.records) == ["RECV_F0", "RECV_F1", "RECV_F2"]
    inbox.close()


def test_a_message_that_never_comes_is_a_timeout_naming_it_not_a_hang():
    t = GatedTransport()
    inbox = Inbox(t, workers=2, timeout_s=0.2, rank=3)
    inbox.post("B", 7, OpRecorder(nvtx_enabled=False))
    with pytest.raises(TransportTimeout, match="rank 3: timed out after 0.2 s with no op ready, waiting for RECV_B7"):
        inbox.wait_any(["RECV_B7"])
    with pytest.raises(TransportTimeout, match="rank 3: RECV_B7 was announced as in but not handed over within 0.2 s"):
        inbox.take("B", 7)  # raises rather than hangs: the module's 30 s timeout bounds the wait
    t.open("B", 7)  # lets the worker end
    inbox.close()


def test_a_message_announced_before_one_posted_earlier_waits_for_it_to_be_announced_too():
    # F1 is announced while F0, posted before it, still runs (as when the later of two messages
    # that landed together has its thread run first): the drain waits for F0, up to settle_s, and
    # returns both, so the stage sees both in, as the replay would.
    t = GatedTransport()
    inbox = Inbox(t, workers=4, timeout_s=5, rank=0, settle_s=5)
    recorder = OpRecorder(nvtx_enabled=False)
    for mb in range(3):
        inbox.post("F", mb, recorder)
    inbox.post("B", 0, recorder)
    t.open("F", 1)
    assert inbox.wait_any([])
    opener = threading.Timer(0.05, t.open, ("F", 0))
    opener.start()
    started = time.monotonic()
    assert inbox.drain() == [("F", 1), ("F", 0)]  # F2 (posted after) and B0 (another kind) not waited for
    assert 0.04 < time.monotonic() - started < 4
    assert 0.04e9 < inbox.settled_ns < 4e9
    opener.join()
    assert not inbox.arrived("F", 2) and not inbox.arrived("B", 0)
    t.open("F", 2)
    assert _drained_until(inbox, 1) == [("F", 2)]
    for key in (("F", 0), ("F", 1), ("F", 2)):
        inbox.take(*key)
    t.open("B", 0)
    assert _drained_until(inbox, 1) == [("B", 0)]
    inbox.take("B", 0)
    inbox.close()


def test_a_producer_out_of_the_posted_order_costs_at_most_the_settling_time():
    t = GatedTransport()
    inbox = Inbox(t, workers=2, timeout_s=5, rank=0, settle_s=0.05)
    recorder = OpRecorder(nvtx_enabled=False)
    inbox.post("F", 0, recorder)
    inbox.post("F", 1, recorder)
    t.open("F", 1)
    assert inbox.wait_any([])
    started = time.monotonic()
    assert inbox.drain() == [("F", 1)]  # F0 was really sent later: the drain gives up after settle_s
    assert 0.04 < time.monotonic() - started < 4
    assert inbox.drain() == []  # and nothing else is in
    t.open("F", 0)
    assert _drained_until(inbox, 1) == [("F", 0)]
    inbox.take("F", 0)
    inbox.take("F", 1)
    inbox.close()


def test_ready_dispatch_refuses_an_iteration_after_one_that_stopped_with_receives_posted():
    from types import SimpleNamespace

    from ds_pipemorph.runtime.ready_exec import refuse_after_a_failed_iteration

    t = GatedTransport()
    recorder = OpRecorder(nvtx_enabled=False)
    inbox = Inbox(t, workers=1, timeout_s=5, rank=0)
    inbox.post("F", 3, recorder)  # what an iteration that raised before its F3 leaves behind
    engine = SimpleNamespace(stage_id=1, inbox=inbox)
    with pytest.raises(RuntimeError, match=r"stage 1: the last iteration stopped with receives still posted \(1\), "
                                           "so this engine cannot run another one; start the job again"):
        refuse_after_a_failed_iteration(engine)
    t.open("F", 3)
    assert _drained_until(inbox, 1) == [("F", 3)]
    inbox.take("F", 3)
    refuse_after_a_failed_iteration(engine)  # nothing posted: an iteration may start
    inbox.close()


class TensorTransport(GatedTransport):
    """Like ``GatedTransport``, but each message is a fresh tensor the test can watch (a weak reference)."""

    def __init__(self):
        super().__init__()
        self.sent: list = []

    def recv(self, kind: str, mb: int):
        self.gates[(kind, mb)].wait()
        t = torch.ones(4)
        self.sent.append(weakref.ref(t))
        return t


def test_a_message_taken_and_dropped_is_freed_while_its_worker_waits_for_the_next():
    """A worker waiting for its next receive holds nothing of its last: once the op that consumed a
    message drops it, its tensors are freed (one message per worker would otherwise stay alive, the
    whole iteration's received tensors with one worker per receive)."""
    t = TensorTransport()
    inbox = Inbox(t, workers=4, timeout_s=5, rank=0)
    recorder = OpRecorder(nvtx_enabled=False)
    for mb in range(3):
        inbox.post("F", mb, recorder)
    for mb in range(3):
        t.open("F", mb)
    assert sorted(_drained_until(inbox, 3)) == [("F", 0), ("F", 1), ("F", 2)]
    for mb in range(3):
        got = inbox.take("F", mb)
        assert got.shape == (4,)
        del got
    gc.collect()
    assert len(t.sent) == 3 and all(ref() is None for ref in t.sent), "a received tensor outlived its consumer"
    inbox.post("F", 3, recorder)  # the workers are alive and take new receives
    t.open("F", 3)
    assert _drained_until(inbox, 1) == [("F", 3)] and inbox.take("F", 3).shape == (4,)
    inbox.close()
