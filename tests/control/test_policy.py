"""The control policy on recorded per-iteration measurements: when it re-plans, for which delays, how
it routes links under each delegation mode, how many delegate queues it gives them, and when it keeps
the plan in force. Expected values follow from the rules the modules state (detector hysteresis,
plan/sched/queues.py, the 2 % keep margin), computed here, not copied from outputs."""
import math
import pickle

import pytest

from ds_pipemorph.control.detector import DetectorConfig
from ds_pipemorph.control.policy import GROW_GAIN, KEEP_WITHIN, Decision, ControlPolicy, QueueSettings
from ds_pipemorph.plan.ir.links import DIRECT, LATENCY, Delegated, Route
from ds_pipemorph.plan.ir.ops import peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.bounds import lower_bound_ms
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.queues import SLACK
from ds_pipemorph.plan.sched.tolerance import link_tolerances
from ds_pipemorph.plan.sched.warmup import initial_warmup
from ds_pipemorph.plan.sim.simulate import makespan, replay
from ds_pipemorph.plan.sim.validate import validate_schedule

S, N = 4, 8
CFG = DetectorConfig()  # floor 5 ms, 2 iterations up / down, recover below 50 %, 1 ms quantum, 5 % margin
# F, B, W per stage as measured (ms); stage 3's W was not seen (-1) in these iterations
MEASURED = ([10.3, 9.7, 10.1, 10.0], [10.2, 10.4, 9.6, 10.0], [5.1, 4.9, 5.0, -1.0])
# ... rounded to 0.5 ms (x2, round, /2); the unseen W keeps the previous estimate (10 ms, the start-up costs)
ROUNDED = ([10.5, 9.5, 10.0, 10.0], [10.0, 10.5, 9.5, 10.0], [5.0, 5.0, 5.0, 10.0])
UNIFORM = ([10.0] * S,) * 3

CALM = [0.3, 0.2, 0.4]
SLOW = [0.3, 0.2, 30.4]  # link 2 at 30.4 ms
RECOVERED = [0.2, 0.3, 0.5]


def initial_plan(caps=None):
    return list_schedule(Costs.uniform(S, 10.0), N, initial_warmup(caps or [N] * S))


def policy(delegation="off", caps=None, queues=QueueSettings(2, 8), every=1) -> ControlPolicy:
    return ControlPolicy(initial_plan(caps), Costs.uniform(S, 10.0), N, caps, every, delegation, CFG, queues)


def feed(p: ControlPolicy, series, ops=MEASURED, start=0) -> list[tuple[int, Decision]]:
    out = []
    for it, links in enumerate(series, start):
        d = p.step(it, *ops, links)
        if d is not None:
            out.append((it, d))
    return out


def threshold(p: ControlPolicy, link: int) -> float:
    """The detector's rule: a delay above this, twice in a row, is a slower link."""
    return max(CFG.floor_ms, (1 + CFG.up_margin) * max(p.detector.tolerance[link], p.detector.planned_for[link]))


def test_a_link_going_from_0_to_30_ms_and_back_is_re_planned_twice():
    p = policy("off")
    plan0 = p.plan_in_force
    assert 30.4 > threshold(p, 2)  # the first plan does not absorb 30 ms on link 2
    series = [CALM] * 4 + [SLOW] * 6 + [RECOVERED] * 4  # slow from iteration 4, recovered from 10
    events = feed(p, series)
    # up: the 2nd slow iteration in a row (5), target rounded up to the quantum; down: the 2nd calm one
    # (11), below the floor: back to no delay; in between 30.4 stays within 5 % of the plan for 31
    assert [it for it, _ in events] == [5, 11]
    (_, up), (_, down) = events
    assert up.target_ms == [0.0, 0.0, math.ceil(30.4)] and down.target_ms == [0.0, 0.0, 0.0]
    for d in (up, down):
        assert d.replans and d.plan is not None
        validate_schedule(d.plan, S, N)
        assert (d.costs.f, d.costs.b, d.costs.w) == ROUNDED
        assert d.link_modes == {} and d.queues == {}  # delegation off: every link stays direct
        assert d.predicted_ms == replay(d.plan, d.costs, N, link_model=DIRECT).iteration_ms
        assert d.tolerance_ms == [t.replay_ms for t in link_tolerances(d.plan, d.costs, N, resolution_ms=0.1,
                                                                        link_model=DIRECT)]
    assert "slow links [] -> [2]" in up.reason and "slow links [2] -> []" in down.reason
    # the new plan is no worse than the one it replaces under the delays it was made for
    assert up.predicted_ms <= replay(plan0, up.costs, N, link_model=DIRECT).iteration_ms
    assert p.plan_in_force is down.plan and p.detector.planned_for == [0.0, 0.0, 0.0]


def test_the_same_samples_give_the_same_decisions_and_one_rank_can_plan_for_all():
    series = [CALM] * 3 + [SLOW] * 3 + [[0.3, 0.2, 61.0]] * 3
    alone = feed(policy("auto"), series)
    assert feed(policy("auto"), series) == alone  # deterministic: same plans, modes, queues, reasons
    ranks = [policy("auto") for _ in range(3)]  # as the runtime does it: observe everywhere, rank 0 proposes
    split = []
    for it, links in enumerate(series):
        due = [r.observe(it, *MEASURED, links) for r in ranks]
        assert all(c == due[0] for c in due)
        if due[0] is None:
            continue
        decision = pickle.loads(pickle.dumps(ranks[0].propose(due[0])))  # what the broadcast carries
        for r in ranks:
            r.adopt(decision)
        split.append((it, decision))
    assert split == alone
    assert all(r.link_queues == ranks[0].link_queues and r.plan_in_force == ranks[0].plan_in_force for r in ranks)


@pytest.mark.parametrize("delegation,modes", [
    ("off", {}),
    ("always", {0: "delegated", 1: "delegated", 2: "delegated"}),  # listed so their queues can grow
    ("auto", {0: "direct", 1: "direct", 2: "delegated"}),  # only the link planned for a delay
])
def test_link_modes_under_each_delegation_mode(delegation, modes):
    p = policy(delegation)
    assert p.fifos() == ([2, 2, 2] if delegation == "always" else [None] * 3)  # as the first plan runs
    [(it, d)] = feed(p, [CALM] * 4 + [SLOW] * 2)
    assert it == 5 and d.link_modes == modes
    assert set(d.queues) == {i for i, m in modes.items() if m == "delegated"}
    delegated = [i in d.queues for i in range(S - 1)]
    model = [Delegated(d.queues[i]) if delegated[i] else DIRECT for i in range(S - 1)]
    assert d.predicted_ms == replay(d.plan, d.costs, N, link_model=model).iteration_ms
    assert p.fifos() == [d.queues.get(i) for i in range(S - 1)]  # what the estimator reads next iteration
    assert p.link_model() == model


def needed(plan, costs, link, model, lo, hi) -> int:
    """plan/sched/queues.py: the smallest k in [lo, hi] with which replaying the plan with k FIFOs on ``link``
    is as fast (within SLACK) as with unlimited ones; hi if none; a link without delay needs lo."""
    if costs.links[link] <= 0:
        return lo
    others = list(model)
    unlimited = makespan(plan, costs, N, link_model=[*others[:link], LATENCY, *others[link + 1:]])
    for k in range(lo, hi + 1):
        with_k = makespan(plan, costs, N, link_model=[*others[:link], Delegated(k), *others[link + 1:]])
        if with_k <= unlimited * (1 + SLACK):
            return k
    return hi


def test_a_link_with_little_delay_keeps_its_queues():
    """14 ms on link 2 with 10 ms ops: a stage emits at most one message per 10 ms op, so message n
    leaves at least 2 x 10 ms after message n-2 of its FIFO, which arrived 14 ms after it left: two
    FIFOs never queue (c <= k t), the link keeps the configured 2; links without delay keep theirs."""
    for delegation in ("auto", "always"):
        p = policy(delegation, queues=QueueSettings(2, 8))
        [(_, d)] = feed(p, [CALM] * 3 + [[0.3, 0.2, 14.0]] * 2, ops=UNIFORM)
        assert d.target_ms == [0.0, 0.0, 14.0]
        assert d.queues == ({0: 2, 1: 2, 2: 2} if delegation == "always" else {2: 2})


def test_a_link_slower_than_all_its_queues_can_carry_gets_the_most():
    """200 ms on link 2, 8 messages per direction, at most 3 queues: a FIFO carries at least 3 of them
    one after the other (600 ms) where unlimited FIFOs carry them side by side: no k <= 3 keeps pace
    (c > k t), so the link gets the maximum, 3, since going from 1 FIFO (1600 ms of serial sends) to 3
    gains far more than GROW_GAIN."""
    p = policy("auto", queues=QueueSettings(1, 3))
    [(_, d)] = feed(p, [CALM] * 3 + [[0.3, 0.2, 200.0]] * 2, ops=UNIFORM)
    assert d.queues == {2: 3}
    plan = d.plan
    one = replay(plan, d.costs, N, link_model=[DIRECT, DIRECT, Delegated(1)]).iteration_ms
    assert d.predicted_ms < (1 - GROW_GAIN) * one


def test_a_running_link_grows_its_queues_only_for_a_gain_above_grow_gain():
    """Link 2 delegated for 31 ms, then 61 ms: its count follows plan/sched/queues.py (smallest that keeps
    pace, between what it has and max_queues), kept at what it has unless growing gains more than
    GROW_GAIN of the iteration."""
    p = policy("auto", queues=QueueSettings(2, 8))
    events = feed(p, [CALM] * 3 + [SLOW] * 3 + [[0.3, 0.2, 61.0]] * 3, ops=UNIFORM)
    assert [it for it, _ in events] == [4, 7]
    (_, first), (_, second) = events
    for d, have in ((first, 2), (second, first.queues[2])):
        model = [DIRECT, DIRECT, LATENCY]
        k = needed(d.plan, d.costs, 2, model, lo=have, hi=max(have, 8))
        if k > have:
            now = replay(d.plan, d.costs, N, link_model=[DIRECT, DIRECT, Delegated(have)]).iteration_ms
            grown = replay(d.plan, d.costs, N, link_model=[DIRECT, DIRECT, Delegated(k)]).iteration_ms
            if grown > (1 - GROW_GAIN) * now:
                k = have
        assert d.queues == {2: k}
    assert second.queues[2] > first.queues[2]  # 61 ms needs more FIFOs than the two it had
    assert p.link_queues == [2, 2, second.queues[2]]


def test_jitter_around_the_planned_delay_is_not_re_planned_but_a_slower_link_is():
    p = policy("off")
    [(_, up)] = feed(p, [CALM] * 3 + [SLOW] * 2)
    assert up.target_ms[2] == 31.0
    top = threshold(p, 2)  # 5 % above what the new plan absorbs (at least the 31 it was made for)
    low = CFG.recover_ratio * 31.0  # below this twice in a row: recovered
    jitter = [29.1, 31.8, 30.2, top - 0.05, 28.7, top - 0.01, 30.9, low + 0.1, top - 0.3, 29.9]
    assert feed(p, [[0.3, 0.2, x] for x in jitter], start=5) == []
    # one iteration above the margin is a hiccup; two in a row re-plan for the new delay
    assert feed(p, [[0.3, 0.2, top + 0.5], [0.3, 0.2, 30.0]], start=15) == []
    [(it, d)] = feed(p, [[0.3, 0.2, top + 0.5]] * 2, start=17)
    assert it == 18 and d.target_ms == [0.0, 0.0, math.ceil(top + 0.5)]


def test_the_plan_in_force_is_kept_when_within_2_percent_of_the_lower_bound():
    caps = [8, 6, 4, 2]
    p = policy("auto", caps=caps)
    [(_, first)] = feed(p, [CALM] * 3 + [SLOW] * 2, ops=UNIFORM)
    plan = p.plan_in_force
    assert plan is first.plan
    # the same slow link at 34 ms (above the 5 % margin): same transports, so the plan in force is
    # scored first; stages next to the delegated link stage activations in host memory (cap N)
    [(_, kept)] = feed(p, [[0.3, 0.2, 34.0]] * 2, start=5, ops=UNIFORM)
    model = [DIRECT, DIRECT, Delegated(2)]
    t = replay(plan, kept.costs, N, link_model=model).iteration_ms
    bound = lower_bound_ms(kept.costs, N, caps=[8, 6, N, N])
    assert t <= (1 + KEEP_WITHIN) * bound
    assert kept.plan is None and not kept.replans and "kept the plan in force" in kept.reason
    assert kept.target_ms == [0.0, 0.0, 34.0] and kept.predicted_ms == t
    assert kept.link_modes == first.link_modes and kept.queues == first.queues  # nothing moves
    assert p.plan_in_force is plan and p.detector.planned_for == [0.0, 0.0, 34.0]
    # 61 ms: the plan in force is now more than 2 % above the bound: re-planned
    [(_, again)] = feed(p, [[0.3, 0.2, 61.0]] * 2, start=7, ops=UNIFORM)
    t = replay(plan, again.costs, N, link_model=model).iteration_ms
    assert t > (1 + KEEP_WITHIN) * lower_bound_ms(again.costs, N, caps=[8, 6, N, N])
    assert again.plan is not None and "more than 2% above the lower bound" in again.reason


def test_the_first_iteration_is_not_measured_and_every_sets_the_pace():
    slow_from_start = [SLOW] * 9
    [(it, _)] = feed(policy("off"), slow_from_start)
    assert it == 2  # iteration 0 is start-up: the detector sees iterations 1 and 2
    [(it, _)] = feed(policy("off", every=3), slow_from_start)
    assert it == 5  # observed after iterations 2, 5, 8: the second slow observation is at 5


def test_a_bad_delegation_mode_is_refused():
    with pytest.raises(ValueError, match="delegation"):
        policy("sometimes")


# -- a direct path whose sends do not block (gloo's isend): one FIFO per direction, the wire's ---------
FIFO = Delegated(1)


def nonblocking(delegation="auto", caps=None) -> ControlPolicy:
    return ControlPolicy(initial_plan(caps), Costs.uniform(S, 10.0), N, caps, 1, delegation, CFG, QueueSettings(2, 8),
                  direct=FIFO)


@pytest.mark.parametrize("delegation", ["off", "auto"])
def test_where_direct_sends_do_not_block_auto_keeps_a_slow_link_direct_and_plans_it_as_one_fifo(delegation):
    p = nonblocking(delegation)
    (it, d), = feed(p, [CALM, SLOW, SLOW])
    assert d.replans and d.target_ms[2] > 0
    # "auto" lists every link as direct (delegates would add copies and nothing the wire does not give);
    # "off" routes none.
    assert d.link_modes == ({i: "direct" for i in range(S - 1)} if delegation == "auto" else {})
    assert d.queues == {}
    # The prediction is the replay of the new plan with every link one FIFO whose sender never waits.
    assert d.predicted_ms == pytest.approx(replay(d.plan, d.costs, N, link_model=FIFO).iteration_ms)
    assert p.link_model() == [FIFO] * (S - 1)
    assert p.fifos() == [1] * (S - 1)  # the estimator discounts a message queued behind the one before


def test_with_one_blocking_link_auto_delegates_it_and_keeps_slow_links_that_do_not_block_direct():
    # A delay injector on link 0 only (gloo): its sends wait for the delay, links 1 and 2 go out by
    # gloo's isend. All three are measured slow (large messages take long on links 1 and 2 too).
    p = ControlPolicy(initial_plan(), Costs.uniform(S, 10.0), N, None, 1, "auto", CFG, QueueSettings(2, 8),
                      direct=[DIRECT, FIFO, FIFO])
    slow_everywhere = [25.3, 40.2, 30.4]
    (it, d), = feed(p, [CALM, slow_everywhere, slow_everywhere])
    assert d.replans and all(t > 0 for t in d.target_ms)  # every link planned for its delay
    assert d.link_modes == {0: "delegated", 1: "direct", 2: "direct"}
    assert set(d.queues) == {0}
    # The plan is made for link 0 on the delegates and links 1 and 2 as one FIFO each.
    assert d.predicted_ms == pytest.approx(replay(d.plan, d.costs, N, link_model=[Delegated(d.queues[0]), FIFO, FIFO])
                                           .iteration_ms)
    assert p.fifos() == [d.queues[0], 1, 1]
    assert p.may_delegate and p.direct_model == [DIRECT, FIFO, FIFO]
    with pytest.raises(ValueError, match="2 link models given for 3 links"):
        p.set_direct_model([DIRECT, FIFO])


def test_a_fifo_whose_sender_never_waits_is_never_slower_than_one_that_blocks_it():
    # The reason the model matters: for the same plan and delay, a sender that waits can only finish later.
    plan, costs = initial_plan(), Costs.uniform(S, 10.0, [0.0, 40.0, 0.0])
    assert replay(plan, costs, N, link_model=FIFO).iteration_ms <= replay(plan, costs, N, link_model=DIRECT).iteration_ms


def test_caps_are_relaxed_only_for_links_that_are_really_delegated():
    caps, target = [4, 3, 2, 1], [0.0, 0.0, 30.0]  # the detector's target: link 2 slow
    assert nonblocking("auto", caps)._caps_for(target) == caps  # direct: activations stay on the device
    assert policy("auto", caps)._caps_for(target) == [4, 3, N, N]  # delegated link 2: host staging, cap N


def test_a_direct_model_other_than_a_blocking_send_or_one_fifo_is_refused():
    with pytest.raises(ValueError, match="Direct"):
        ControlPolicy(initial_plan(), Costs.uniform(S, 10.0), N, None, 1, "auto", CFG, QueueSettings(2, 8), direct=LATENCY)


def test_a_first_reaction_keeps_the_plan_in_force_when_the_closed_form_plan_replays_slower():
    # Skewed stages (stage 1's F and B, stage 0's W twice the others), 4 stages x 6 micro-batches in
    # the 1F1B warm-up, and a 2 ms delay on link 0: Alg. 2's warm-up for it is slower than what runs.
    from ds_pipemorph.plan.sched.warmup import adapted_warmup

    f, b, w = [10.0, 20.0, 10.0, 10.0], [10.0, 20.0, 10.0, 10.0], [20.0, 10.0, 10.0, 10.0]
    plan = list_schedule(Costs(f, b, w, [0.0] * 3), 6, initial_warmup([4, 3, 2, 1]))
    policy = ControlPolicy(plan, Costs(f, b, w, [0.0] * 3), 6)
    slow = Costs(f, b, w, [2.0, 0.0, 0.0])
    in_force = replay(plan, slow, 6, link_model=DIRECT).iteration_ms
    closed_form = replay(list_schedule(slow, 6, adapted_warmup(slow, 6)), slow, 6, link_model=DIRECT).iteration_ms
    assert in_force < closed_form  # the case: 312 against 324 ms

    decision = policy.react(slow)
    assert decision.plan is None and decision.predicted_ms == pytest.approx(in_force)
    assert decision.refine and decision.target_ms == [2.0, 0.0, 0.0] and "kept the plan in force" in decision.reason
    policy.adopt(decision)
    assert policy.plan_in_force == plan and policy.detector.planned_for == [2.0, 0.0, 0.0]
    # the search beside training starts from it: what it proposes is never slower than the plan in force
    refined = policy.refine(slow)
    assert refined.predicted_ms <= in_force + 1e-6
    # the inline path (search at once) keeps the same rule
    assert ControlPolicy(plan, Costs(f, b, w, [0.0] * 3), 6).propose(slow).predicted_ms <= in_force + 1e-6


def test_a_plan_in_force_beyond_the_memory_the_new_delays_allow_is_never_kept():
    # Planned for a delegated 30 ms link 1 (stages 1 and 2 may hold N activations); then link 1
    # recovers and link 0 is 5 ms slow: stage 2's cap is back to 2. The plan in force would replay
    # faster than the new one, but it holds 3 activations on stage 2: it must go.
    from ds_pipemorph.plan.sched.warmup import adapted_warmup

    f, b, w = [10.0, 10.0, 20.0, 10.0], [20.0] * 4, [10.0, 10.0, 20.0, 10.0]
    caps = [4, 3, 2, 1]
    start = Costs(f, b, w, [0.0] * 3)
    policy = ControlPolicy(list_schedule(start, 8, initial_warmup(caps)), start, 8, caps=caps, delegation="always")
    policy.adopt(policy.react(Costs(f, b, w, [0.0, 30.0, 0.0])))
    relaxed = policy.plan_in_force
    assert peak_inflight(relaxed)[2] > caps[2]
    now = Costs(f, b, w, [5.0, 0.0, 0.0])
    closed_form = list_schedule(now, 8, adapted_warmup(now, 8, caps=[8, 8, 2, 1]))  # link 0's stages relaxed
    model = [Delegated(2)] * 3
    assert replay(relaxed, now, 8, link_model=model).iteration_ms < replay(closed_form, now, 8, link_model=model).iteration_ms
    back = policy.react(now)
    assert back.plan is not None and all(p <= c for p, c in zip(peak_inflight(back.plan), [8, 8, 2, 1]))


def test_a_reaction_that_moves_a_link_to_the_delegates_brings_its_plan_even_when_the_plan_in_force_replays_faster():
    # The case above under delegation "auto": link 0 (direct sends that block) moves to the delegates.
    # A kept plan changes nothing in the transport, so a route that changes always comes with a plan.
    f, b, w = [10.0, 20.0, 10.0, 10.0], [10.0, 20.0, 10.0, 10.0], [20.0, 10.0, 10.0, 10.0]
    plan = list_schedule(Costs(f, b, w, [0.0] * 3), 6, initial_warmup([4, 3, 2, 1]))
    policy = ControlPolicy(plan, Costs(f, b, w, [0.0] * 3), 6, delegation="auto")
    slow = Costs(f, b, w, [2.0, 0.0, 0.0])
    decision = policy.react(slow)
    in_force = replay(plan, slow, 6, link_model=[Delegated(decision.queues[0]), DIRECT, DIRECT]).iteration_ms
    assert in_force < decision.predicted_ms  # kept, it would have been faster
    assert decision.plan is not None and decision.link_modes == {0: Route.DELEGATED, 1: Route.DIRECT, 2: Route.DIRECT}
