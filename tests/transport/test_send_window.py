"""The direct path's send window (``DirectTransport.send_window``), on a point-to-point layer whose
sends report completion only once waited for, as gloo's do: which sends wait, for which earlier
message, and what the window leaves alone; and the plan rule that says which kinds it may bound
(``runtime.plans.sent_in_order``)."""
from __future__ import annotations

import pytest
import torch

from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
from ds_pipemorph.runtime.plans import sent_in_order
from ds_pipemorph.runtime.transport.direct import DirectTransport, bound_sends
from ds_pipemorph.runtime.transport.header import untag
from test_direct_groups import _Work  # completes only when waited for, as gloo's send work does


class Gloo:
    in_order = False

    def __init__(self):
        self.log: list[str] = []
        self.sent: list[torch.Tensor] = []

    def isend(self, t, dst, tag):
        self.log.append(f"send {untag(tag)}")
        self.sent.append(t)
        return _Work(self.log, untag(tag))

    def irecv(self, t, src, tag):
        return _Work(self.log, untag(tag))

    def close(self):
        pass


class InOrder(Gloo):
    in_order = True

    def batch(self, ops):
        return [_Work(self.log, untag(tag)) for _, _, _, tag in ops]


def _waits(log: list[str]) -> list[str]:
    return [e[len("wait "):] for e in log if e.startswith("wait ")]


def _stage1(p2p, window) -> DirectTransport:
    return DirectTransport(1, 1, [0, 1, 2], timeout_s=5.0, p2p=p2p, send_window=window)


def test_a_send_beyond_the_window_waits_for_the_oldest_message_whole_and_only_for_it():
    p2p = Gloo()
    t = _stage1(p2p, 2)
    t.bound_sends({"F", "B"})
    pair = (torch.ones(4), torch.ones(2))  # two tensors: a message is its header and two works
    t.send("F", 0, pair)
    t.send("F", 1, pair)
    assert _waits(p2p.log) == []  # two messages to stage 2 not known received: within the window
    t.send("F", 2, pair)
    # the third message waits for the first, all of it (its header and both tensors), and no more
    assert _waits(p2p.log) == ["F0 header", "F0 part 1", "F0 part 2"]
    assert p2p.log.index("wait F0 header") > p2p.log.index("send F2 part 2")  # sent first, then waited
    t.send("B", 0, torch.ones(3))  # another peer (stage 0) has a window of its own
    t.send("B", 1, torch.ones(3))
    assert len(_waits(p2p.log)) == 3
    t.send("F", 3, pair)
    assert _waits(p2p.log)[3:] == ["F1 header", "F1 part 1", "F1 part 2"]  # (each micro-batch's first
    # message carries its layout)
    assert t.sends_waited == 2


def test_unbounded_kinds_no_window_and_nccl_rules_never_wait_at_send():
    for p2p, window, kinds in ((Gloo(), 1, {"B"}), (Gloo(), None, {"F", "B"}), (InOrder(), 1, {"F", "B"})):
        t = _stage1(p2p, window)
        t.bound_sends(kinds)
        for mb in range(5):
            t.send("F", mb, torch.ones(2))
        assert _waits(p2p.log) == [], (type(p2p).__name__, window, kinds)


def test_the_window_bounds_the_tensors_kept_for_sends_not_known_received():
    p2p = Gloo()
    t = _stage1(p2p, 1)
    t.bound_sends({"F"})
    for mb in range(6):
        t.send("F", mb, torch.ones(8))
        kept = [p for p in t._sends[2] if p.last]
        assert len(kept) <= 1


def test_bound_sends_reaches_the_direct_path_through_wrappers():
    class Wrapper:
        def __init__(self, inner):
            self.inner = inner

    t = _stage1(Gloo(), 1)
    bound_sends(Wrapper(Wrapper(t)), {"B"})
    assert t._bounded == {"B"}
    bound_sends(Wrapper(None), {"F"})  # a path holding no direct transport: nothing to do


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        _stage1(Gloo(), 0)


def test_kinds_are_bounded_only_where_the_receiver_takes_them_in_the_order_sent():
    plan = deepspeed_1f1b(4, 6)
    assert sent_in_order(plan, 0) == {"F"}  # stage 0 sends no input gradient
    assert sent_in_order(plan, 1) == {"F", "B"}
    assert sent_in_order(plan, 3) == {"B"}  # the last stage sends no activation
    # Stage 2 runs the backwards of micro-batches 0 and 1 the other way round: stage 1 receives
    # stage 2's gradients out of the order sent, so stage 2's gradient sends stay unbounded, and
    # stage 1's own (to stage 0) keep their order.
    swapped = [list(r) for r in plan]
    bs = [i for i, op in enumerate(swapped[2]) if op.kind == "B"]
    swapped[2][bs[0]], swapped[2][bs[1]] = swapped[2][bs[1]], swapped[2][bs[0]]
    assert sent_in_order(swapped, 2) == {"F"}  # its activations still go in stage 3's order
    assert sent_in_order(swapped, 3) == set()  # stage 2 now takes stage 3's gradients out of order
    assert sent_in_order(swapped, 1) == {"F", "B"}  # stages 1 and 0 still run B in one order
