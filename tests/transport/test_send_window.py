"""The direct path's send window (``DirectTransport.send_window``), on a point-to-point layer whose
sends report completion only once waited for, as gloo's do: which sends wait, for which earlier
message, and what the window leaves alone; and the plan rule that says which kinds it may bound
(``runtime.plans.sent_in_order``)."""
from __future__ import annotations

import pytest
import torch

from ds_pipemorph.plan.ir.lower import Dispatch, window_deadlock
from ds_pipemorph.plan.ir.ops import Kind
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
from ds_pipemorph.plan.sim.validate import validate_schedule
from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.runtime.plans import build_plan, lowering_for, sent_in_order, window_kinds
from ds_pipemorph.runtime.transport.direct import DirectTransport, EarlierSendFailed, bound_sends
from ds_pipemorph.runtime.transport.protocol import TransportError
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
    for kind in (Kind.B, Kind.W):  # each backward with its W: still a valid plan
        at = [i for i, op in enumerate(swapped[2]) if op.kind is kind and op.mb in (0, 1)]
        swapped[2][at[0]], swapped[2][at[1]] = swapped[2][at[1]], swapped[2][at[0]]
    validate_schedule(swapped, 4, 6)
    assert sent_in_order(swapped, 2) == {"F"}  # its activations still go in stage 3's order
    assert sent_in_order(swapped, 3) == set()  # stage 2 now takes stage 3's gradients out of order
    assert sent_in_order(swapped, 1) == {"F", "B"}  # stages 1 and 0 still run B in one order


def _plan(section: dict, stages: int, microbatches: int):
    cfg = parse_config(section)
    plan = build_plan(cfg, stages, microbatches)
    return plan, lowering_for(cfg), lowering_for(cfg).for_dispatch(Dispatch.ORDERED).lower(plan)


def test_the_engine_bounds_only_kinds_whose_plan_passes_the_dry_run():
    # A grant of 3x stock's on 2 stages x 6: stage 0 warms up with all six forwards. With both
    # directions bounded the dry run finds stage 0 waiting after an activation send for stage 1 and
    # stage 1 after a gradient send for stage 0 (on gloo, two ranks running this plan's first
    # iteration that way timed out at those two sends); the engine then bounds activations alone.
    plan, lowering, streams = _plan({"schedule": "adaptive", "memory": {"budget": 3.0}}, 2, 6)
    found = window_deadlock(streams, [sent_in_order(plan, s) for s in range(2)], 2)
    assert found is not None and "stage 0 waits for stage 1" in found and "stage 1 waits for stage 0" in found
    chosen = window_kinds(plan, lowering, 2)
    assert chosen == [{Kind.F}, set()] and window_deadlock(streams, chosen, 2) is None
    default_plan, default_lowering, _ = _plan({}, 4, 12)  # the default: both directions, every stage
    assert window_kinds(default_plan, default_lowering, 2) == [sent_in_order(default_plan, s) for s in range(4)]
    assert window_kinds(default_plan, default_lowering, None) == [set()] * 4


def test_a_window_wait_that_would_starve_is_found_by_the_dry_run():
    # Window 1. Stage 0 warms up with F0..F3; stage 1 runs 1F1B. Stage 0 sends F1 and waits until
    # stage 1 takes F0; sends F2, waits for F1; sends F3 and waits for stage 1 to take F2. Stage 1
    # took F0, sent B0, took F1 and sent B1: two gradients not taken, so it waits for stage 0 to take
    # B0 before its F2. Stage 0 takes B0 only after its F3's wait: each waits for the other.
    from ds_pipemorph.plan.ir.lower import lower
    from ds_pipemorph.plan.ir.ops import Op

    f, b, w = Kind.F, Kind.B, Kind.W
    plan = [[Op(f, 0), Op(f, 1), Op(f, 2), Op(f, 3)] + [Op(k, m) for m in range(4) for k in (b, w)],
            [Op(k, m) for m in range(4) for k in (f, b, w)]]
    validate_schedule(plan, 2, 4)
    streams = lower(plan, fused_backward=False, recv_window=2)
    found = window_deadlock(streams, [{f}, {b}], 1)
    assert found is not None and "stage 0 waits for stage 1 to receive" in found and "stage 1 waits for stage 0" in found
    assert window_deadlock(streams, [{f}, set()], 1) is None  # one direction alone: no cycle of waits
    assert window_deadlock(streams, [set(), {b}], 1) is None
    assert window_deadlock(streams, [{f}, {b}], 3) is None  # a window as deep as the warm-up never waits


def test_a_send_waits_for_older_messages_outside_the_lock_and_a_failed_one_is_not_failed_over():
    import threading

    class Slow(Gloo):
        def __init__(self):
            super().__init__()
            self.release = threading.Event()

        def isend(self, t, dst, tag):
            work = super().isend(t, dst, tag)
            if dst == 2:  # sends to stage 2 complete only once released
                release, wait = self.release, work.wait

                def slow_wait(timeout=None):
                    release.wait(5)
                    return wait(timeout)
                work.wait = slow_wait
            return work

    p2p = Slow()
    t = _stage1(p2p, 1)
    t.bound_sends({Kind.F, Kind.B})
    t.send("F", 0, torch.ones(2))
    waiting = threading.Thread(target=t.send, args=("F", 1, torch.ones(2)))  # waits for F0
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive()
    t.send("B", 0, torch.ones(2))  # another peer: not held by the waiting send's lock
    p2p.release.set()
    waiting.join(5)
    assert not waiting.is_alive()

    class Failing(Gloo):
        def isend(self, t, dst, tag):
            work = super().isend(t, dst, tag)

            def fail(timeout=None):
                raise TransportError("the peer went away")
            work.wait = fail
            return work

    t = _stage1(Failing(), 1)
    t.bound_sends({Kind.F})
    t.send("F", 0, torch.ones(2))
    with pytest.raises(EarlierSendFailed, match="SEND_F0.*SEND_F1"):
        t.send("F", 1, torch.ones(2))
