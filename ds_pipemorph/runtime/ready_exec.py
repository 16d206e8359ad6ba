"""The engine's readiness-driven dispatch (``dispatch: "ready"``): one iteration of one stage.

The plan's order for this stage is the hint (``plan.dispatch.ReadyRule``, refined in ``run_ready``
by the last iteration's arrival times). Every receive of the
iteration is posted up front (``runtime.inbox``: each completion is a readiness event); the
training thread repeatedly runs the first ready op of the hint, with the same handlers, op records
and NVTX ranges as ordered dispatch, each send right after the op that produced it. Pipe buffers
are taken by F (the lowest free one) and released by B, as many as the plan's peak of in-flight
activations, which is also the rule's cap: ready dispatch never holds more activations than the
plan. The end of the iteration is the same as ordered dispatch's: wait for the sends, then tied
reductions, the data-parallel all-reduce and the optimizer step, after every W, in the same order
on every rank (replicas of a stage may have run their ops in different orders: the sums they
reduce are the same up to floating-point order).
"""
from __future__ import annotations

import time

from ..plan.dispatch import ReadyRule
from . import instructions as I


def run_ready(engine) -> int:
    """Run this iteration's F/B/W ops in readiness order; returns the nanoseconds spent choosing.

    One refinement of the rule: a ready op does not jump ahead of the hint's first op when that op
    waits only for a message that, in the last iteration, came before the jumping op would end now;
    the stage waits for the message instead (at most until then, plus a tenth of the op). Without
    it, a message a little later than the plan assumed makes a stage start a later op of its hint
    (typically a W) and the op the plan wanted next waits for all of it."""
    s, S = engine.stage_id, engine.num_stages
    first, last = s == 0, s == S - 1
    h, run, records, inbox = engine._handlers, engine.recorder.run, engine.recorder.records, engine.inbox
    if not first:  # in the order the upstream stage's hint produces them
        for op in engine.plan[s - 1]:
            if op.kind == "F":
                inbox.post("F", op.mb, records)
    if not last:
        for op in engine.plan[s + 1]:
            if op.kind == "B":
                inbox.post("B", op.mb, records)
    t0 = time.monotonic_ns()
    expect = getattr(engine, "_ready_expect", None) or ({}, {})  # last iteration: arrival offsets, op ns per kind
    arrived_at, op_ns = expect
    cap = engine._schedule.num_pipe_buffers()
    rule = ReadyRule(engine.stage_plan, cap, needs_input=not first, needs_grad=not last)
    free, buffer_of = list(range(cap)), {}
    choosing = 0
    while not rule.finished:
        t = time.perf_counter_ns()
        for kind, mb in inbox.drain():  # completions become readiness events: no scan in pick
            rule.arrive(kind, mb)
        op = rule.pick()
        choosing += time.perf_counter_ns() - t
        if op is None:
            if not inbox.wait_any(rule.waiting_for()) and rule.pick(inbox.arrived) is None:
                raise RuntimeError(f"stage {s}: no op is ready and no message is on its way "
                                   f"(waiting for {', '.join(rule.waiting_for()) or 'nothing'})")
            continue
        head = rule.pending[0]
        msg = rule.message_of(head) if op != head else None
        if (msg is not None and msg in arrived_at and op.kind in op_ns and not inbox.arrived(*msg)
                and rule.is_ready(head, lambda kind, mb: True)):
            # The hint's first op waits only for its message. If that message came, last iteration,
            # before this op would end now, wait for it (up to then and a tenth of the op more).
            due = t0 + arrived_at[msg]
            now = time.monotonic_ns()
            if now + op_ns[op.kind] > due and inbox.wait_for(*msg, (max(0, due - now) + op_ns[op.kind] // 10) / 1e9):
                continue
        rule.started(op)
        m = op.mb
        if op.kind == "F":
            buf = min(free)
            free.remove(buf)
            buffer_of[m] = buf
            if not first:
                engine._take_activation(buf, inbox.take("F", m))
            if first or last:
                run(f"LOAD{m}", h[I.LoadMicroBatch], engine, buffer_id=buf, micro_batch=m)
            run(f"F{m}", h[I.ForwardPass], engine, buffer_id=buf, micro_batch=m)
            if not last:
                run(f"SEND_F{m}", h[I.SendActivation], engine, buffer_id=buf, micro_batch=m)
        elif op.kind == "B":
            buf = buffer_of.pop(m)
            if not last:
                engine._output_grads[buf] = inbox.take("B", m)
            run(f"B{m}", h[I.BackwardInputPass], engine, buffer_id=buf, micro_batch=m)
            free.append(buf)
            if not first:
                run(f"SEND_B{m}", h[I.SendGrad], engine, buffer_id=buf, micro_batch=m)
        else:
            run(f"W{m}", h[I.BackwardWeightPass], engine, micro_batch=m)
    recs = engine.recorder.records
    arrived_at = {(r.op[5], int(r.op[6:])): r.end_ns - t0 for r in recs if r.op.startswith("RECV_")}
    spans: dict = {}
    for r in recs:
        if r.op[:1] in "FBW" and r.op[1:].isdigit():
            spans.setdefault(r.op[0], []).append(r.end_ns - r.start_ns)
    engine._ready_expect = (arrived_at, {k: sum(v) / len(v) for k, v in spans.items()})
    if inbox.outstanding:  # every message was consumed by the op it feeds
        raise RuntimeError(f"stage {s}: {inbox.outstanding} received messages were never used")
    late = inbox.drain()  # each op's message was drained before the op ran: nothing may be left over
    if late:
        raise RuntimeError(f"stage {s}: receives announced after their op ran: "
                           f"{', '.join(f'RECV_{k}{m}' for k, m in late)}")
    return choosing
