"""PipeMorph §3.1/§4 figures, reproduced by the planner and the replay simulator.

Expected iteration times and tolerances come from the paper (Fig. 4, Fig. 5), from closed formulas
written out in the tests, or from ``crossing_paths``: an independent longest-path
computation over the plan's dependency graph (no code of ``ds_pipemorph.plan.sim.simulate`` involved).
"""
from fractions import Fraction

import pytest

from crossing_paths import longest_paths_by_crossings

from ds_pipemorph.plan.ir.links import DIRECT, LATENCY, Delegated
from ds_pipemorph.plan.ir.ops import warmup_counts
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import search
from ds_pipemorph.plan.sched.tolerance import link_tolerances
from ds_pipemorph.plan.sched.warmup import adapted_warmup, check_lemma1, eq1_tolerance_ms, initial_warmup, slackness
from ds_pipemorph.plan.sim.simulate import replay

N = 12
UNIFORM = Costs.uniform(4, 10.0)


def zb_plan():
    return list_schedule(UNIFORM, N, [7, 5, 3, 1])


def with_link0(ms):
    return UNIFORM.with_links([ms, 0.0, 0.0])


def test_fig4_zb_plan_with_warmup_7_5_3_1_takes_390ms():
    # Zero bubble with F = B = W = t: every stage is busy 3·N·t, and the last stage starts (S-1)·t
    # after the first: 3·12·10 + 3·10 = 390 ms (Fig. 4).
    sched = zb_plan()
    assert warmup_counts(sched) == [7, 5, 3, 1]
    assert replay(sched, UNIFORM, N).iteration_ms == 3 * N * 10.0 + 3 * 10.0 == 390.0
    assert max(longest_paths_by_crossings(sched, UNIFORM, 0).values()) == 390


def test_fig5_fixed_zb_plan_replayed_with_10ms_on_link0_takes_400ms():
    # 10 ms is within the 14 ms this order absorbs on link 0 beyond its own latency (see the
    # tolerance test): only the path crossing link 0 once grows, 390 + 10.
    paths = longest_paths_by_crossings(zb_plan(), UNIFORM, 0)
    assert max(length + k * 10 for k, length in paths.items()) == 400
    assert replay(zb_plan(), with_link0(10), N).iteration_ms == 400.0


def test_fig5_fixed_zb_plan_replayed_with_20ms_on_link0_takes_440ms():
    # Fig. 5: the plan made for no delay loses 50 ms to 20 ms on link 0. The path that crosses link 0
    # six times (320 ms of ops) sets it: 320 + 6·20 = 440.
    paths = longest_paths_by_crossings(zb_plan(), UNIFORM, 0)
    assert paths[6] == 320
    assert max(length + k * 20 for k, length in paths.items()) == 440
    assert replay(zb_plan(), with_link0(20), N).iteration_ms == 440.0


def test_replanned_knowing_20ms_on_link0_takes_at_most_410ms():
    # 410 is the best any plan can do: the first activation reaches stage 3 after three forwards and
    # the slow link (3·10 + 20 = 50 ms), and stage 3 still has 3·N·t = 360 ms of work.
    replanned = list_schedule(with_link0(20), N, [7, 5, 3, 1])
    assert replay(replanned, with_link0(20), N).iteration_ms <= 410.0
    best = search(with_link0(20), N, caps=[7, 5, 3, 1], budget_s=10, max_evals=300)
    assert best.iteration_ms <= 410.0


def test_alg1_spreads_slackness_evenly_from_the_first_stage():
    # x_max = 12: Δ_avg = ⌊11/3⌋ = 3, remainder 2 goes to the first two links.
    assert initial_warmup([12] * 4) == [12, 8, 4, 1]
    assert initial_warmup([7] * 4) == [7, 5, 3, 1]
    assert initial_warmup([4] * 4) == [4, 3, 2, 1]


def test_alg1_respects_per_stage_caps_and_lemma1():
    x = initial_warmup([9, 3, 8, 2])
    check_lemma1(x)
    assert all(v <= c for v, c in zip(x, [9, 3, 3, 2]))
    assert min(slackness(x)) >= 0


def test_lemma1_violation_names_the_stage():
    with pytest.raises(ValueError, match="stage 2"):
        check_lemma1([5, 3, 4, 1])


def test_eq1_tolerance_is_delta_minus_one_times_t_for_uniform_ops():
    assert eq1_tolerance_ms(UNIFORM, [7, 5, 3, 1]) == [10.0, 10.0, 10.0]
    assert eq1_tolerance_ms(UNIFORM, [10, 6, 3, 1]) == [30.0, 20.0, 10.0]


def test_alg2_raises_slackness_on_the_slow_link_only():
    x = adapted_warmup(Costs.uniform(4, 10.0, [0, 0, 30]), 32)
    d = slackness(x)
    assert x[-1] == 1
    assert d[0] == d[1] == 2
    # Eq. 1: 10 + 10 + 2*30 <= Δ (10 + 10)  =>  Δ >= 4.
    assert d[2] == 4
    assert eq1_tolerance_ms(Costs.uniform(4, 10.0), x)[2] >= 30


def test_alg2_as_printed_rounds_down_and_can_miss_eq1():
    # The paper's line 7 uses ⌊·⌋: for 25 ms it gives Δ=3 where Eq. 1 needs 3.5 -> 4.
    costs = Costs.uniform(4, 10.0, [0, 0, 25])
    assert slackness(adapted_warmup(costs, 32, paper_floor=True))[2] == 3
    assert slackness(adapted_warmup(costs, 32))[2] == 4


def test_tolerance_is_measured_by_replay_next_to_eq1():
    tols = link_tolerances(zb_plan(), UNIFORM, N)
    assert [t.eq1_ms for t in tols] == [10.0, 10.0, 10.0]
    # The tolerance is the largest c with T(c) <= T(0) + c. With T(c) = max_k (L_k + k·c) that is
    # min over k >= 2 of (T(0) - L_k) / (k - 1), computed exactly from the dependency graph. The
    # Fig. 4 order absorbs more than Eq. 1 promises on the first links (the steady-phase order
    # matters, not only the warm-up counts): link 0's binding path crosses it 6 times with 320 ms of
    # ops, (390 - 320) / 5 = 14; link 1's crosses 8 times with 310 ms, (390 - 310) / 7 = 80/7. On the
    # last link it is exactly Eq. 1's 10 ms.
    exact = []
    for link in range(3):
        paths = longest_paths_by_crossings(zb_plan(), UNIFORM, link)
        t0 = max(paths.values())
        exact.append(min((t0 - length) / (k - 1) for k, length in paths.items() if k >= 2))
    assert exact == [14, Fraction(80, 7), 10]
    for t, want in zip(tols, exact):
        assert t.replay_ms == pytest.approx(float(want), abs=0.01)  # bisection to 0.01 ms
    for t in tols:
        assert t.absorbed
        before = replay(zb_plan(), UNIFORM.with_links([t.replay_ms if i == t.link else 0 for i in range(3)]), N)
        assert before.iteration_ms <= 390.0 + t.replay_ms + 1e-6


@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("delay", [10, 30, 60])
def test_plan_made_for_a_measured_delay_absorbs_it(stages, delay):
    n = 32
    no_delay = search(Costs.uniform(stages, 10.0), n, budget_s=10, max_evals=200).iteration_ms
    for link in (0, stages // 2 - 1, stages - 2):
        links = [0.0] * (stages - 1)
        links[link] = delay
        costs = Costs.uniform(stages, 10.0, links)
        planned = search(costs, n, budget_s=10, max_evals=200)
        assert planned.iteration_ms - no_delay <= 1.1 * delay, (link, planned.iteration_ms, no_delay)


def test_direct_link_model_blocks_the_sender_until_the_previous_message_arrived():
    # 2 stages, F = 5 ms, 20 ms on link 0, stage 0 runs F0 F1 F2 first. With one message in flight,
    # F1's activation leaves at 25 (when F0's has arrived) and stage 0 is blocked until then, so F2
    # starts at 25, not 10; without the model every message just arrives 20 ms after its F.
    costs = Costs([5.0, 5.0], [5.0, 5.0], [5.0, 5.0], [20.0])
    sched = list_schedule(costs, 3, [3, 1])
    start = lambda tl: {(x.stage, str(x.op)): x.start for x in tl.slots}  # noqa: E731
    ideal, direct = start(replay(sched, costs, 3)), start(replay(sched, costs, 3, link_model=DIRECT))
    assert ideal[(0, "F2")] == 10.0 and direct[(0, "F2")] == 25.0
    assert ideal[(1, "F1")] == 35.0 and direct[(1, "F1")] == 45.0  # after B0 (30-35) vs on arrival
    assert replay(sched, costs, 3, link_model=DIRECT).iteration_ms >= replay(sched, costs, 3).iteration_ms


def test_delegated_link_model_has_k_fifos_and_never_blocks_the_sender():
    # Same pipeline, delegated link with k FIFOs: message n travels in FIFO n % k. With k = 2, F0's
    # and F1's activations travel at once (arrive 25 and 30) but F2's waits for FIFO 0 (leaves at
    # 25, arrives 45); the sender is never blocked, so stage 0's F2 starts at 10 as with no model.
    costs = Costs([5.0, 5.0], [5.0, 5.0], [5.0, 5.0], [20.0])
    sched = list_schedule(costs, 3, [3, 1])
    start = lambda tl: {(x.stage, str(x.op)): x.start for x in tl.slots}  # noqa: E731
    two = start(replay(sched, costs, 3, link_model=[Delegated(2)]))
    assert two[(0, "F2")] == 10.0
    assert two[(1, "F0")] == 25.0 and two[(1, "F2")] >= 45.0
    # Enough FIFOs behave as pure latency; one FIFO serialises like a direct link without blocking.
    assert replay(sched, costs, 3, link_model=[Delegated(3)]).iteration_ms == replay(sched, costs, 3).iteration_ms
    assert replay(sched, costs, 3, link_model=[Delegated(1)]).iteration_ms >= replay(sched, costs, 3, link_model=[Delegated(2)]).iteration_ms


def test_queue_count_decides_whether_60ms_on_the_last_link_is_absorbed():
    # 4 stages, 32 micro-batches, 10 ms ops: a message per 30 ms each way on the last link. With
    # 60 ms per message, 2 FIFOs carry exactly that rate, so no plan hides it; 3 FIFOs do (§5.2's
    # rule: enough queues that delegates keep pace with the stage that produces the messages).
    costs = Costs.uniform(4, 10.0, [0.0, 0.0, 60.0])
    two = search(costs, 32, budget_s=10, max_evals=300, link_model=[LATENCY, LATENCY, Delegated(2)]).iteration_ms
    three = search(costs, 32, budget_s=10, max_evals=300, link_model=[LATENCY, LATENCY, Delegated(3)]).iteration_ms
    no_delay = 3 * 32 * 10.0 + 3 * 10.0  # 990 ms: 3·N·t on the last stage after (S-1)·t of warm-up
    assert three <= no_delay + 60 < two


def test_queues_needed_keeps_pace_with_the_message_rate():
    # §5.2's rule by replay: 60 ms per message, a message every 30 ms each way -> 2 FIFOs fall behind,
    # 3 keep pace; 30 ms needs only the default 2; a link with no delay needs the minimum.
    from ds_pipemorph.plan.sched.queues import queues_needed

    for delay, want in ((60.0, 3), (30.0, 2), (0.0, 2)):
        costs = Costs.uniform(4, 10.0, [0.0, 0.0, delay])
        plan = search(costs, 32, budget_s=10, max_evals=300).schedule
        assert queues_needed(plan, costs, 32, link=2) == want, delay
    with pytest.raises(ValueError, match="link 3 does not exist"):
        queues_needed(plan, costs, 32, link=3)
