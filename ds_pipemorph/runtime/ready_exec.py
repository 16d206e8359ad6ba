"""The engine's readiness-driven dispatch (``dispatch: "ready"``): one iteration of one stage.

Ready dispatch runs the same lowered stream as ordered dispatch (``plan.ir.lower.LoweringPolicy``,
with every receive of the iteration up front: ``for_dispatch("ready")``) and changes one thing:
which compute op goes next. ``ReadyProgram`` cuts the stream's compiled steps
(``runtime.schedule``) into the receives posted before the first compute op and one unit per
compute op: its instructions and the sends that follow it in the stream (a fused B m takes its
W m and the gradient's send along, as the lowering placed them, when it is W m's turn: every W
before it in the hint ran; else B m runs with the send and W m alone at its turn, so that the Ws
add their gradients in the hint's order whatever order the Bs ran in). The receives are posted through
the inbox (``runtime.inbox``: each completion is a readiness event), all of them at the first
moment the stage has no op to run (or would hold one for a message): a stage with ops that need no
message, the first stage's warm-up forwards, runs them first, as every stage's first message is
still on its way then. The waits at F and B take from the inbox. The rule (``plan.ir.ready_rule.ReadyRule``, with its patience) picks the next unit; the
training thread runs it with the same handlers, op records and NVTX ranges as ordered dispatch.
Pipe buffers follow ``schedule.Buffers`` in the order the ops run (F takes the lowest free one,
B releases it), as many as the plan's peak of in-flight activations, which is also the rule's cap:
ready dispatch never holds more activations than the plan. The end of the iteration is the
stream's, run by ordered dispatch's loop: wait for the sends, then tied reductions, the
data-parallel all-reduce and the optimizer step, after every W, in the same order on every rank
(replicas of a stage may have run their ops in different orders: the sums they reduce are the
same up to floating-point order).
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional

from ..plan.ir.fused import fused_at
from ..plan.ir.ops import Kind, Op, message_op, recorded_op
from ..plan.ir.ready_rule import ReadyRule
from . import instructions as I
from .hooks import Hooks
from .schedule import Buffers, PipeMorphSchedule


def _post_f(engine, micro_batch):
    engine.inbox.post(Kind.F, micro_batch, engine.recorder)


def _post_b(engine, micro_batch):
    engine.inbox.post(Kind.B, micro_batch, engine.recorder)


def _take_f(engine, buffer_id, micro_batch):
    engine._take_activation(buffer_id, engine.inbox.take(Kind.F, micro_batch))


def _take_b(engine, buffer_id, micro_batch):
    engine._output_grads[buffer_id] = engine.inbox.take(Kind.B, micro_batch)


# Where ready dispatch's receives differ from ordered dispatch's: posted to the inbox, whose
# worker threads record each one (``RECV_F3``: waiting to arrival), and taken from it.
_INBOX = {I.PostRecvActivation: _post_f, I.PostRecvGrad: _post_b, I.RecvActivation: _take_f, I.RecvGrad: _take_b}


class Unit(NamedTuple):
    """One compute op of the stream with what rides with it, run as a whole."""
    entries: list  # (recorded?, op text, handler, kwargs, takes a buffer?)
    texts: list  # the stream's ops it runs (``2F5``, ``2SEND_F5``)
    also: list  # ops of the hint it runs besides its own (the W of a fused backward)
    takes: bool  # F: takes a pipe buffer
    releases: bool  # B: releases it, after the unit
    own: int  # how many of ``entries`` are the op's own, before the sends that follow it


class ReadyProgram:
    """A stage's stream for ready dispatch, built once per plan: ``posts`` (instruction entries),
    ``post_texts``, and ``units`` by compute op (local form, ``F3``). ``fused``: the policy's
    fused backward (B m directly followed by W m in the plan runs as one unit when it is W m's turn;
    ``split`` holds B m with the gradient's send for the other case, ``units`` W m alone); ``hooks``: the
    engine hooks in force, whose ``after_op`` follows the inbox's receive handlers as it follows
    the others (already in ``handlers``)."""

    def __init__(self, schedule: PipeMorphSchedule, handlers, fused: bool, hooks: Optional[Hooks] = None):
        stream, steps = schedule.stream, list(schedule.steps())[:-1]
        self.cap = schedule.num_pipe_buffers()
        inbox = _INBOX if hooks is None else hooks.around(_INBOX)  # engine hooks follow these handlers too

        def entries(cmds):
            return [(type(c) not in _INBOX, I.op_text(c), inbox.get(type(c)) or handlers[type(c)], c.kwargs,
                     "buffer_id" in c.kwargs) for c in cmds]

        self.posts: list = []
        self.post_texts: list[str] = []
        self.units: dict[Op, Unit] = {}
        self.split: dict[Op, Unit] = {}  # fused B m -> B m with the gradient's send, run when W m is not next
        unit = None
        for op, cmds in zip(stream, steps):
            if op.is_compute:
                own = entries(cmds)
                unit = self.units[op.local()] = Unit(own, [str(op)], [], op.kind is Kind.F, op.kind is Kind.B,
                                                     len(own))
            elif unit is None and op.kind.is_recv:
                self.posts += entries(cmds)
                self.post_texts.append(str(op))
            elif unit is not None and op.kind.is_send:
                unit.entries.extend(entries(cmds))
                unit.texts.append(str(op))
            else:
                raise ValueError(f"stage {schedule.stage_id}: ready dispatch needs every receive before the first "
                                 f"compute op and each send after its producer, not {op} there")
        if fused:  # the lowering sends B m's gradient after W m: the two run as one unit
            ops = schedule.ops
            for i, a in enumerate(ops):
                if fused_at(ops, i):
                    b, w, u = ops[i + 1], self.units[ops[i + 1]], self.units[a]
                    self.split[a] = Unit(_apart(u.entries) + w.entries[w.own:], u.texts + w.texts[1:], [], False, True,
                                         u.own)
                    self.units[b] = Unit(w.entries[:w.own], w.texts[:1], [], False, False, w.own)
                    u.entries.extend(w.entries)
                    u.texts.extend(w.texts)
                    u.also.append(b)


def _apart(entries: list) -> list:
    """``entries`` of a B m compiled to run its W m too (``whole``), made to run B m alone."""
    return [e if not e[3].get("whole") else (*e[:3], {**e[3], "whole": False}, *e[4:]) for e in entries]


def refuse_after_a_failed_iteration(engine) -> None:
    """Called before an iteration changes anything: an iteration that raised under ready dispatch
    can leave receives posted, whose messages belong to it, not to the next one."""
    inbox = engine.inbox
    if inbox is not None and inbox.outstanding:
        raise RuntimeError(f"stage {engine.stage_id}: the last iteration stopped with receives still posted "
                           f"({inbox.outstanding}), so this engine cannot run another one; start the job again")


def run_ready(engine, program: ReadyProgram) -> int:
    """Run this iteration's stream up to its end in readiness order; returns the nanoseconds spent
    choosing. ``engine.executed_stream`` gets the stream's ops in the order they ran.

    The rule's patience (``ReadyRule.hold``) takes the last iteration's arrival times and mean op
    times as its expectations: the first iteration has none and never waits."""
    s, S = engine.stage_id, engine.num_stages
    run, inbox = engine.recorder.run, engine.inbox
    executed = engine.executed_stream
    to_post = list(program.posts)

    def post_all() -> None:
        """Every receive of the iteration, in the producers' order: once, when the stage first has no
        op to run or would hold one for a message (a first stage runs its warm-up forwards first)."""
        for _, _, handler, kwargs, _ in to_post:
            handler(engine, **kwargs)
        to_post.clear()
        executed.extend(program.post_texts)

    t0 = time.monotonic_ns()
    arrived_at, op_ns = getattr(engine, "_ready_expect", None) or ({}, {})  # last iteration: arrival offsets, op ns per kind

    def expected(msg):
        at = arrived_at.get(msg)
        return None if at is None else t0 + at

    units = engine.budget.units  # the memory budget in force holds forwards back (plan.ir.memory)
    rule = ReadyRule(engine.stage_plan, program.cap, needs_input=s > 0, needs_grad=s < S - 1,
                     units=None if units is None else units[s], w_share=engine.w_share)
    buffers = Buffers(program.cap)
    choosing = 0
    while not rule.finished:
        t, settled = time.perf_counter_ns(), inbox.settled_ns
        for kind, mb in inbox.drain():  # completions become readiness events: no scan in pick
            rule.arrive(kind, mb)
        op = rule.pick()
        choosing += time.perf_counter_ns() - t - (inbox.settled_ns - settled)  # waiting is not choosing
        if op is None and to_post:
            post_all()
            continue
        if op is None:
            if not inbox.wait_any(rule.waiting_for()) and rule.pick(inbox.arrived) is None:
                raise RuntimeError(f"stage {s}: no op is ready and no message is on its way "
                                   f"(waiting for {', '.join(rule.waiting_for()) or 'nothing'})")
            continue
        now = time.monotonic_ns()
        hold = rule.hold(op, now, op_ns.get(op.kind), expected)
        if hold is not None and to_post:  # the message held for cannot come before its receive is posted
            post_all()
            continue
        if hold is not None and inbox.wait_for(*hold[0], (hold[1] - now) / 1e9):
            continue  # the message the hint's first op waits for came: pick again
        rule.started(op)
        unit = program.units[op]
        if unit.also and not rule.w_in_turn(op.mb):  # a W before W m has not run: B m and W m split
            unit = program.split[op]
        for other in unit.also:
            rule.started(other)
        m = op.mb
        buf = buffers.take(m) if unit.takes else buffers.of.get(m)
        for recorded, name, handler, kwargs, buffered in unit.entries:
            if buffered:
                kwargs = {**kwargs, "buffer_id": buf}
            if recorded:
                run(name, handler, engine, **kwargs)
            else:
                handler(engine, **kwargs)
        if unit.releases:
            buffers.release(m)
        executed.extend(unit.texts)
    recs = engine.recorder.records
    arrived_at, spans = {}, {}
    for r in recs:
        op = recorded_op(r.op)
        if op is None:
            continue
        if op.kind.is_recv:  # keyed by what the message carries: Kind.F (activation) or Kind.B (gradient)
            arrived_at[(op.kind.payload, op.mb)] = r.end_ns - t0
        elif op.kind.is_compute:
            spans.setdefault(op.kind, []).append(r.end_ns - r.start_ns)
    engine._ready_expect = (arrived_at, {k: sum(v) / len(v) for k, v in spans.items()})
    if inbox.outstanding:  # every message was consumed by the op it feeds
        raise RuntimeError(f"stage {s}: {inbox.outstanding} received messages were never used")
    late = inbox.drain()  # each op's message was drained before the op ran: nothing may be left over
    if late:
        raise RuntimeError(f"stage {s}: receives announced after their op ran: "
                           f"{', '.join(str(message_op(k, m, False)) for k, m in late)}")
    return choosing
