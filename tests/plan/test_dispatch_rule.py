"""The engine's readiness rule (``plan.ir.ready_rule.ReadyRule``) makes the choices the readiness replay
(``plan.sim.ready``) makes: replaying a hint under ready dispatch, then asking the rule at each op's
start which op to run, given the messages arrived by then, gives the op the replay started."""
import random

import pytest

from ds_pipemorph.plan.ir.ops import Op, peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.ir.ready_rule import ReadyRule
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.warmup import initial_warmup
from ds_pipemorph.plan.sim.ready import replay_varying
from ds_pipemorph.plan.sim.variation import jitter

EPS = 1e-9


def _case(rng: random.Random):
    S, N = rng.randint(2, 5), rng.randint(1, 8)
    costs = Costs.uniform(S, 10.0, [rng.choice([0.0, 0.0, rng.uniform(0, 40)]) for _ in range(S - 1)])
    hint = list_schedule(costs, N, initial_warmup([rng.randint(1, N) for _ in range(S)]))
    if rng.random() < 0.5:  # any order of a stage's ops is a hint too, even one that breaks dependencies
        hint = [rng.sample(row, len(row)) for row in hint]
    caps = [max(1, c) for c in peak_inflight(hint)] if rng.random() < 0.5 else [rng.randint(1, N) for _ in range(S)]
    return S, N, costs, hint, caps, jitter(costs, N, 0.6, seed=rng.randint(0, 10**6), kinds="FBW")


@pytest.mark.parametrize("seed", range(4))
def test_the_rule_picks_what_the_readiness_replay_started(seed):
    rng = random.Random(seed)
    for _ in range(50):
        S, N, costs, hint, caps, table = _case(rng)
        tl = replay_varying(hint, costs, N, dispatch="ready", caps=caps, op_times=table)
        end = {(x.stage, x.op.kind, x.op.mb): x.end for x in tl.slots}
        # a message arrives its link's delay after the op that produced it ends (latency links)
        arrival = {}
        for (s, k, m), t in end.items():
            if k == "F" and s < S - 1:
                arrival[(s + 1, "F", m)] = t + costs.links[s]
            elif k == "B" and s > 0:
                arrival[(s - 1, "B", m)] = t + costs.links[s - 1]
        for s in range(S):
            rule = ReadyRule(hint[s], caps[s], needs_input=s > 0, needs_grad=s < S - 1)
            ran = sorted((x for x in tl.slots if x.stage == s), key=lambda x: x.start)
            for x in ran:
                picked = rule.pick(lambda kind, mb: arrival[(s, kind, mb)] <= x.start + EPS)
                assert picked == Op(x.op.kind, x.op.mb), (s, x, hint[s])
                rule.started(picked)
                assert rule.inflight <= caps[s]
            assert rule.finished


def test_the_rule_names_what_a_stuck_stage_waits_for():
    rule = ReadyRule([Op("F", 0), Op("B", 0), Op("W", 0)], 1, needs_input=True, needs_grad=True)
    assert rule.pick(lambda kind, mb: False) is None
    assert rule.waiting_for() == ["RECV_F0", "RECV_B0"]
    assert [rule.message_of(op) for op in rule.pending] == [("F", 0), ("B", 0), None]
    edge = ReadyRule([Op("F", 0), Op("B", 0), Op("W", 0)], 1, needs_input=False, needs_grad=False)
    assert [edge.message_of(op) for op in edge.pending] == [None, None, None]  # a one-stage pipeline
    with pytest.raises(ValueError, match="at least 1"):
        ReadyRule([], 0, needs_input=True, needs_grad=True)


def test_patience_holds_for_the_hints_first_op_only_when_its_message_lands_before_the_other_op_ends():
    # the last stage: F1 waits for its activation, W0 is ready; the hint wants F1 first
    rule = ReadyRule([Op(k, m) for k, m in (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1))], 1,
                     needs_input=True, needs_grad=False)
    rule.arrive("F", 0)
    for want in (Op("F", 0), Op("B", 0)):
        assert rule.pick() == want
        rule.started(want)
    assert rule.pick() == Op("W", 0) and rule.pending[0] == Op("F", 1)
    due = {("F", 1): 6.0}.get
    assert rule.hold(Op("W", 0), 5.0, 3.0, due) == (("F", 1), 6.0 + 0.3)  # W0 would end at 8, F1 lands at 6
    assert rule.hold(Op("W", 0), 5.0, 0.5, due) is None  # W0 ends at 5.5, before F1 lands
    assert rule.hold(Op("W", 0), 5.0, 3.0, {}.get) is None  # nothing expected
    assert rule.hold(Op("W", 0), 5.0, None, due) is None  # the op's time is not known yet
    assert rule.hold(Op("W", 0), 7.0, 3.0, due) == (("F", 1), 7.0 + 0.3)  # late: a tenth of the op from now
    rule.arrive("F", 1)
    assert rule.pick() == Op("F", 1) and rule.hold(Op("F", 1), 7.0, 1.0, due) is None  # the head itself
    # a head that waits for more than its message (here: the cap) is not waited for
    full = ReadyRule([Op("F", 0), Op("F", 1), Op("B", 0), Op("W", 0), Op("B", 1), Op("W", 1)], 1,
                     needs_input=True, needs_grad=True)
    full.arrive("F", 0)
    full.started(Op("F", 0))
    full.arrive("B", 0)
    assert full.pending[0] == Op("F", 1) and full.pick() == Op("B", 0)
    assert full.hold(Op("B", 0), 0.0, 5.0, {("F", 1): 1.0}.get) is None


def test_a_fused_backward_whose_activation_came_first_runs_split_and_its_w_waits_for_the_ws_before_it():
    # The last stage of a 1F1B plan, each B fused with its W; F1's activation is in before F0's.
    rule = ReadyRule([Op(k, m) for m in (0, 1) for k in ("F", "B", "W")], 1, needs_input=True, needs_grad=False)
    rule.arrive("F", 1)
    ran = []

    def run_all():
        while (op := rule.pick()) is not None:
            rule.started(op)
            ran.append(str(op))
            if op.kind == "B" and rule.w_in_turn(op.mb):  # the fused W runs with its B
                rule.started(Op("W", op.mb))
                ran[-1] += "+W"

    run_all()
    assert ran == ["F1", "B1"]  # W0 has not run: B1 runs alone, its W waits
    assert not rule.w_in_turn(1)
    rule.arrive("F", 0)
    run_all()
    # The weight gradients are added W0 then W1, as under ordered dispatch
    assert ran == ["F1", "B1", "F0", "B0+W", "W1"] and rule.finished
