"""The engine's readiness rule (``plan.dispatch.ReadyRule``) makes the choices the readiness replay
(``plan.ready``) makes: replaying a hint under ready dispatch, then asking the rule at each op's
start which op to run, given the messages arrived by then, gives the op the replay started."""
import random

import pytest

from ds_pipemorph.plan.dispatch import ReadyRule
from ds_pipemorph.plan.listsched import list_schedule
from ds_pipemorph.plan.ops import Op, peak_inflight
from ds_pipemorph.plan.profile import Costs
from ds_pipemorph.plan.ready import replay_varying
from ds_pipemorph.plan.variation import jitter
from ds_pipemorph.plan.warmup import initial_warmup

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
        tl = replay_varying(hint, costs, N, "ready", caps, table)
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
        ReadyRule([], 0, True, True)
