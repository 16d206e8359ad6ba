"""The one op type (compute and communication, torch's ``_Action`` spelling) and the typed link model."""
import json
import pickle

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ds_pipemorph.fileio import dump
from ds_pipemorph.plan.ir.links import DIRECT, LATENCY, Delegated, Direct, Latency, per_link
from ds_pipemorph.plan.ir.ops import ALL_KINDS, COMM_KINDS, KINDS, Kind, Op, parse_op, parse_stage, recorded_op
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.plan.sim.validate import InvalidPlan, parse_schedule


def test_global_texts_read_like_torch_actions():
    assert parse_op("2SEND_F5") == Op("SEND_F", 5, 2)
    assert parse_op("0F1") == Op("F", 1, 0)
    assert parse_op("3RECV_B12") == Op("RECV_B", 12, 3)
    assert str(Op("SEND_B", 4, 1)) == "1SEND_B4"


def test_stage_local_texts_keep_working():
    assert parse_op("F3") == Op("F", 3) and str(Op("W", 3)) == "W3"
    assert parse_op("SEND_F3") == Op("SEND_F", 3) and parse_op("SEND_F3").stage is None
    assert parse_op("RECV_B0").local() == Op("RECV_B", 0)


def test_peer_is_the_neighbour_the_message_flows_to_or_from():
    # activations flow down (s -> s+1), input gradients up (s -> s-1)
    assert Op("SEND_F", 0, 2).peer == 3 and Op("RECV_F", 0, 2).peer == 1
    assert Op("SEND_B", 0, 2).peer == 1 and Op("RECV_B", 0, 2).peer == 3
    assert Op("F", 0, 2).peer is None and Op("SEND_F", 0).peer is None


@given(st.sampled_from(ALL_KINDS), st.integers(0, 10_000), st.one_of(st.none(), st.integers(0, 512)))
def test_format_then_parse_is_the_identity(kind, mb, stage):
    op = Op(kind, mb, stage)
    assert parse_op(str(op)) == op


def test_an_ops_kind_is_a_kind_that_equals_its_text():
    for op in (parse_op("2SEND_F5"), parse_op("W3"), Op("B", 1), Op(Kind.RECV_B, 0, 1), Op._make(("F", 2, None))):
        assert type(op.kind) is Kind
    assert Kind.SEND_F == "SEND_F" and "F" == Kind.F and hash(Kind.B) == hash("B")
    assert Op("F", 3) == Op(Kind.F, 3) == ("F", 3, None) and hash(Op("F", 3)) == hash(("F", 3, None))
    assert {Op("W", 1): 1}[Op(Kind.W, 1)] == 1
    assert [k for k in Kind] == [*KINDS, *COMM_KINDS] == list(ALL_KINDS)
    assert [k.is_compute for k in ALL_KINDS] == [True] * 3 + [False] * 4
    assert [k for k in Kind if k.is_send] == [Kind.SEND_F, Kind.SEND_B]
    assert [k for k in Kind if k.is_recv] == [Kind.RECV_F, Kind.RECV_B]
    assert [k.code for k in KINDS] == [0, 1, 2]


def test_an_op_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'I' is not an op kind: one of F, B, W, SEND_F"):
        Op("I", 0)
    with pytest.raises(ValueError, match="is not an op kind"):
        Op(["F"], 0)


def test_ops_and_kinds_leave_the_process_as_their_text():
    ops = parse_stage(["F0", "B0", "W0"])
    assert [str(o) for o in ops] == ["F0", "B0", "W0"] and f"{Kind.SEND_B}" == "SEND_B"
    assert pickle.loads(pickle.dumps(ops)) == ops and type(pickle.loads(pickle.dumps(ops[0])).kind) is Kind
    assert json.dumps({Kind.F: [o.kind for o in ops]}) == '{"F": ["F", "B", "W"]}'
    assert yaml.safe_load(dump({"kinds": [o.kind for o in ops]}, as_json=False)) == {"kinds": ["F", "B", "W"]}


@pytest.mark.parametrize("text", ["X3", "F", "SEND3", "2SEND_X1", "-1F0", "F3x", ""])
def test_bad_texts_name_the_text(text):
    with pytest.raises(ValueError, match="is not an op"):
        parse_op(text)


def test_plan_files_accept_only_stage_local_compute_ops():
    with pytest.raises(InvalidPlan, match="stage 1: 'SEND_F0' is not a compute op"):
        parse_schedule([["F0"], ["SEND_F0"]])
    with pytest.raises(InvalidPlan, match="stage 0: '0F0' is not a compute op"):
        parse_schedule([["0F0"], ["F0"]])


def test_one_model_applies_to_every_link_and_a_list_needs_one_per_link():
    assert per_link(DIRECT, 3) == (Direct(),) * 3
    assert per_link([LATENCY, Delegated(3)], 2) == (Latency(), Delegated(queues=3))
    with pytest.raises(ValueError, match="2 link models given for 3 links"):
        per_link([LATENCY, DIRECT], 3)
    with pytest.raises(ValueError, match="link 1: a link model is"):
        per_link([LATENCY, True], 2)
    with pytest.raises(ValueError, match="a link model is"):
        per_link(2, 1)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="at least one queue"):
            Delegated(bad)


def test_link_models_order_the_replay_as_the_models_say():
    # Two stages, 5 ms ops, 20 ms on the link, each stage runs all forwards first. Stage 0's
    # activations are ready at 5, 10, 15. Latency: they arrive at 25, 30, 35, and stage 1's
    # forwards run on arrival. Direct: one message in flight and the sender blocked until its
    # message departs: departures 5, 25, 45 (each when the previous arrived), so stage 0's
    # forwards start at 0, 5, 25 and stage 1's at 25, 45, 65. Delegated(2): message n in FIFO
    # n % 2, departures 5, 10, 25 (FIFO 0 free again at 25), arrivals 25, 30, 45, and the sender
    # never waits (0, 5, 10).
    row = [Op(k, m) for k in "F" for m in range(3)] + [Op(k, m) for m in range(3) for k in "BW"]
    sched = [list(row), list(row)]
    costs = Costs([5.0, 5.0], [5.0, 5.0], [5.0, 5.0], [20.0])
    starts = {}
    for name, model in (("latency", LATENCY), ("direct", DIRECT), ("delegated", Delegated(2))):
        tl = replay(sched, costs, 3, link_model=model)
        starts[name] = [[sl.start for sl in tl.slots if sl.stage == s and sl.op.kind == "F"] for s in range(2)]
    assert starts["latency"] == [[0.0, 5.0, 10.0], [25.0, 30.0, 35.0]]
    assert starts["direct"] == [[0.0, 5.0, 25.0], [25.0, 45.0, 65.0]]
    assert starts["delegated"] == [[0.0, 5.0, 10.0], [25.0, 30.0, 45.0]]
    # a queueing model on a link without delay is pure latency
    free = Costs([5.0, 5.0], [5.0, 5.0], [5.0, 5.0], [0.0])
    assert {replay(sched, free, 3, link_model=m).iteration_ms for m in (LATENCY, DIRECT, Delegated(1))} == {
        replay(sched, free, 3).iteration_ms}


@pytest.mark.parametrize("text, kind, mb", [("F0", Kind.F, 0), ("W12", Kind.W, 12), ("SEND_F3", Kind.SEND_F, 3),
                                            ("RECV_B7", Kind.RECV_B, 7), ("RECV_F10", Kind.RECV_F, 10)])
def test_a_records_text_names_its_plan_op(text, kind, mb):
    op = recorded_op(text)
    assert (op.kind, op.mb, op.stage) == (kind, mb, None) and op.kind is kind


@pytest.mark.parametrize("text", ["ReduceGrads", "OptimizerStep", "WaitSends", "LoadMicroBatch", "F", "SEND_F",
                                  "2SEND_F5", "F3x", ""])
def test_other_instructions_and_stage_qualified_texts_are_no_record_op(text):
    assert recorded_op(text) is None


@pytest.mark.parametrize("field,needle", [("f", "stage 1's F takes nan ms"), ("w", "stage 1's W takes nan ms"),
                                          ("links", "link 1 takes nan ms")])
def test_costs_refuse_a_time_that_is_not_a_number(field, needle):
    # NaN never compares as later than anything: a list scheduler waiting for it would not end.
    parts = {"f": [10.0] * 3, "b": [10.0] * 3, "w": [10.0] * 3, "links": [0.0, 0.0]}
    parts[field][1] = float("nan")
    with pytest.raises(ValueError, match=needle):
        Costs(parts["f"], parts["b"], parts["w"], parts["links"])


def test_link_delays_given_as_numpy_numbers_replay_like_floats_in_every_replay():
    """A profile's link delays often come out of numpy: each replay (C, Python, the search's
    evaluator) reads a numpy number as the constant delay it is. 4 stages, 8 micro-batches, 10 ms
    per op, 20 ms on link 0: ZB-H1's plan takes the same time as with plain floats."""
    import os

    import numpy as np

    from ds_pipemorph.plan.sched.baselines import zb_h1
    from ds_pipemorph.plan.sim.incremental import Evaluator

    floats = Costs.uniform(4, 10.0, links=[20.0, 0.0, 0.0])
    numpys = Costs.uniform(4, 10.0, links=list(np.array([20, 0, 0])))
    plan = zb_h1(floats, 8)
    want = replay(plan, floats, 8).iteration_ms
    assert replay(plan, numpys, 8).iteration_ms == want
    assert Evaluator(numpys, 8, per_link(LATENCY, 3)).time(plan) == Evaluator(floats, 8, per_link(LATENCY, 3)).time(plan) == want
    old = os.environ.get("DS_PIPEMORPH_NATIVE")
    os.environ["DS_PIPEMORPH_NATIVE"] = "0"
    try:
        assert replay(plan, numpys, 8).iteration_ms == want
    finally:
        if old is None:
            del os.environ["DS_PIPEMORPH_NATIVE"]
        else:
            os.environ["DS_PIPEMORPH_NATIVE"] = old
