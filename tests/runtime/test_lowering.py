"""Lowering a plan to DeepSpeed instructions, checked as data (no ranks)."""
from __future__ import annotations

import random

import pytest
from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

from ds_pipemorph.plan.ir.lower import lower
from ds_pipemorph.plan.ir.ops import Op, peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, zb_h1
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.runtime import instructions as I
from ds_pipemorph.runtime.schedule import PipeMorphSchedule

from .randplans import random_plan


def lowered_text(schedule: PipeMorphSchedule) -> list[str]:
    """The instruction stream as text, e.g. ``['POST_F0', 'RECV_F0', 'F0', 'SEND_F0', ...]``."""
    return [I.op_text(c) for step in schedule.steps() for c in step]


def _lower(plan, s, n):
    return PipeMorphSchedule(lower(plan)[s], n, len(plan), s)


def test_zb_h1_stage_1_of_4_posts_every_receive_then_waits_computes_and_sends_and_ends_with_the_step():
    plan = zb_h1(Costs.uniform(4), 4)
    text = lowered_text(_lower(plan, 1, 4))
    # Every receive of the iteration is posted first, in the order the neighbours send: stage 0's
    # forwards, then stage 2's backwards.
    posts_f = [f"POST_F{op.mb}" for op in plan[0] if op.kind == "F"]
    posts_b = [f"POST_B{op.mb}" for op in plan[2] if op.kind == "B"]
    assert text[:8] == posts_f + posts_b
    rest = text[8:]
    assert not [t for t in rest if t.startswith("POST_")]
    assert rest[:9] == ["RECV_F0", "F0", "SEND_F0", "RECV_F1", "F1", "SEND_F1", "RECV_F2", "F2", "SEND_F2"]
    assert rest[9:12] == ["RECV_B0", "B0", "SEND_B0"]
    assert rest[-4:] == ["WaitSends", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]


def test_the_schedule_runs_exactly_the_lowered_stream():
    plan = list_schedule(Costs.uniform(4), 8, [4, 3, 2, 1])
    for s, stream in enumerate(lower(plan)):
        text = [t for t in lowered_text(_lower(plan, s, 8)) if not t.startswith(("RECV_", "LOAD"))]
        # the stream's RECV ops are the posts; the waits (RECV_*) and loads ride with F and B
        want = [str(op.local()).replace("RECV_", "POST_") for op in stream]
        assert text[:-4] == want


def test_first_stage_loads_and_never_receives_last_stage_loads_labels_and_never_sends_activations():
    plan = zb_h1(Costs.uniform(3), 5)
    first, last = lowered_text(_lower(plan, 0, 5)), lowered_text(_lower(plan, 2, 5))
    assert not [t for t in first if t.startswith(("RECV_F", "SEND_B"))]
    assert sorted(t for t in first if t.startswith("LOAD")) == [f"LOAD{m}" for m in range(5)]
    assert not [t for t in last if t.startswith(("SEND_F", "RECV_B"))]
    assert sorted(t for t in last if t.startswith("LOAD")) == [f"LOAD{m}" for m in range(5)]


@pytest.mark.parametrize("stages,n", [(2, 1), (3, 6), (4, 8), (4, 12)])
def test_every_op_appears_once_with_its_communication_in_plan_order(stages, n):
    plan = list_schedule(Costs.uniform(stages), n, [min(n, stages - s + 1) for s in range(stages)])
    for s in range(stages):
        text = lowered_text(_lower(plan, s, n))
        compute = [t for t in text if t[0] in "FBW" and t[1:].isdigit()]
        assert compute == [str(op) for op in plan[s]]
        sends = [t for t in text if t.startswith("SEND_")]
        assert len(sends) == (s < stages - 1) * n + (s > 0) * n


def test_buffers_equal_the_plans_peak_in_flight_and_are_never_shared_by_two_live_micro_batches():
    rng = random.Random(3)
    for _ in range(20):
        plan, _caps = random_plan(4, 7, rng)
        for s in range(4):
            sched = _lower(plan, s, 7)
            assert sched.num_pipe_buffers() == peak_inflight(plan)[s]
            live: dict[int, int] = {}
            for step in sched.steps():
                for cmd in step:
                    if isinstance(cmd, ForwardPass):
                        assert cmd.buffer_id not in live.values()
                        assert cmd.buffer_id < sched.num_pipe_buffers()
                        live[cmd.micro_batch] = cmd.buffer_id
                    elif isinstance(cmd, I.BackwardInputPass):
                        assert live.pop(cmd.micro_batch) == cmd.buffer_id
            assert not live


@pytest.mark.parametrize("stages,n", [(2, 1), (2, 8), (4, 2), (4, 12)])
def test_1f1b_plan_runs_deepspeeds_forward_backward_order_with_split_backward(stages, n):
    plan = deepspeed_1f1b(stages, n)
    for s in range(stages):
        stock = []
        for step in TrainSchedule(micro_batches=n, stages=stages, stage_id=s).steps():
            stock += ["F" if isinstance(c, ForwardPass) else "BW" for c in step if isinstance(c, (ForwardPass, BackwardPass))]
        ours = []
        for step in _lower(plan, s, n).steps():
            for c in step:
                if isinstance(c, ForwardPass):
                    ours.append("F")
                elif isinstance(c, I.BackwardInputPass):
                    ours.append("B")
                elif isinstance(c, I.BackwardWeightPass):
                    ours[-1] += "W"
        assert ours == stock


def test_op_text_names_instructions_like_the_plan():
    assert I.op_text(ForwardPass(2, micro_batch=3)) == "F3"
    assert I.op_text(I.BackwardInputPass(0, micro_batch=5)) == "B5"
    assert I.op_text(I.BackwardWeightPass(micro_batch=5)) == "W5"
    assert I.op_text(I.RecvGrad(1, micro_batch=4)) == "RECV_B4"
    assert I.op_text(I.SendActivation(1, micro_batch=0)) == "SEND_F0"
    assert I.op_text(I.PostRecvActivation(micro_batch=6)) == "POST_F6"
    assert I.op_text(I.PostRecvGrad(micro_batch=6)) == "POST_B6"
    assert I.op_text(I.OptimizerStep()) == "OptimizerStep"
    assert repr(I.BackwardInputPass(1, micro_batch=2)) == "BackwardInputPass(buffer_id=1, micro_batch=2)"


def test_one_micro_batch_on_one_stage_is_f_b_w_then_the_step():
    text = lowered_text(PipeMorphSchedule(lower([[Op("F", 0), Op("B", 0), Op("W", 0)]])[0], 1, 1, 0))
    assert text == ["LOAD0", "F0", "B0", "W0", "WaitSends", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]


def test_ready_dispatch_runs_the_streams_posts_then_units_of_a_compute_op_and_its_sends():
    from ds_pipemorph.plan.ir.lower import LoweringPolicy
    from ds_pipemorph.runtime.engine import PipeMorphEngine
    from ds_pipemorph.runtime.ready_exec import ReadyProgram

    plan = list_schedule(Costs.uniform(3, 10.0, [0.0, 20.0]), 6, [3, 2, 1])
    for fused in (False, True):
        streams = LoweringPolicy(fused=fused).for_dispatch("ready").lower(plan)
        for s in range(3):
            sched = PipeMorphSchedule(streams[s], 6, 3, s)
            prog = ReadyProgram(sched, PipeMorphEngine._INSTRUCTION_MAP, fused)
            text = [str(op) for op in streams[s]]
            posts = [t for t in text if "RECV" in t]
            assert prog.post_texts == posts == text[:len(posts)]
            # in the plan's order, the units give back the stream after its receives (a fused W runs
            # with its B's unit)
            fused_ws = {w for u in prog.units.values() for w in u.also}
            units = [prog.units[op] for op in plan[s] if op in prog.units and op not in fused_ws]
            assert [t for u in units for t in u.texts] == text[len(posts):]
            for op, u in prog.units.items():
                assert u.texts[0] == f"{s}{op}"
                if fused and op.kind == "B" and Op("W", op.mb) in u.also:  # B m W m [SEND_B m]: one unit
                    w, split = prog.units[Op("W", op.mb)], prog.split[op]
                    assert u.texts[:2] == [f"{s}B{op.mb}", f"{s}W{op.mb}"]
                    # out of W's turn: B m with the gradient's send, then W m alone, the same instructions
                    assert split.texts == [u.texts[0], *u.texts[2:]] and w.texts == [u.texts[1]]
                    assert split.releases and not w.releases and not split.also and not w.also
                    names = lambda unit: [name for _, name, *_ in unit.entries]  # noqa: E731
                    assert sorted(names(split) + names(w)) == sorted(names(u))
                    assert names(w) == names(u)[split.own:split.own + w.own]
                    assert not [t for t in w.texts if "SEND" in t]
                if op not in fused_ws:
                    assert [t for t in u.texts if "SEND" in t] == \
                        [t for t in u.texts[1:] if not t[1:].startswith(("F", "B", "W"))]
            # what the units run is what ordered dispatch runs for the same stream, buffers aside
            ran = [name for _, name, *_ in prog.posts] + [name for u in units for _, name, *_ in u.entries]
            assert ran == lowered_text(sched)[:-4]
    # fused plans merge: some stage has a B m directly followed by W m here
    assert any(a.kind == "B" and b == Op("W", a.mb) for row in plan for a, b in zip(row, row[1:]))
