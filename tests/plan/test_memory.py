"""Activation memory of plans (``plan.ir.memory``): counted off the order, kept within a budget by the
list scheduler (compiled and Python alike), by ``fit_budget`` for any other order, by the search, and
by ready dispatch as it runs.

The unit is one micro-batch's activations between its F and its B; between its B and its W a
micro-batch counts ``w_share``. Stock 1F1B with a fused backward holds S - s units on stage s: the
first F of stage s is followed by S - s - 1 more before the first gradient returns.
"""
from __future__ import annotations

import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipemorph.plan.ir.memory import OverBudget, budget_units, caps_within, fit_budget, peak_units, stock_units
from ds_pipemorph.plan.ir.ops import warmup_counts
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, zb_h1
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import search
from ds_pipemorph.plan.sched.warmup import initial_warmup
from ds_pipemorph.plan.sim.listsched_py import Policy, list_schedule_py
from ds_pipemorph.plan.sim.ready import replay_ready
from ds_pipemorph.plan.sim.validate import validate_schedule


def walk(rows, share: float):
    """An independent count: per stage and op, (stage, position, op, micro-batches between F and B,
    between B and W), walking each row with the two sets."""
    for s, row in enumerate(rows):
        fb, bw = set(), set()
        for k, op in enumerate(row):
            if op.kind == "F":
                fb.add(op.mb)
            elif op.kind == "B":
                fb.discard(op.mb)
                bw.add(op.mb)
            else:
                bw.discard(op.mb)
            yield s, k, op, len(fb), len(bw)


def held(rows, share: float) -> list[float]:
    """Per stage, the most units held at once."""
    peak = [0.0] * len(rows)
    for s, _, _, h, w in walk(rows, share):
        peak[s] = max(peak[s], h + share * w)
    return peak


def over(rows, share: float, units) -> list[tuple]:
    """The points where a stage holds more than ``units[s]``: (stage, position, held). Right after a B
    with no other W pending, the one micro-batch between its B and its W may go over (nothing could
    run before it): there the bound is the F-to-B ones plus ``share``."""
    bad = []
    for s, k, op, h, w in walk(rows, share):
        bound = max(units[s], h + share) if op.kind == "B" and w == 1 else units[s]
        if h + share * w > bound + 1e-9:
            bad.append((s, k, h + share * w))
    return bad


def test_stock_1f1b_holds_s_minus_s_and_zb_h1_holds_more_when_w_keeps_everything():
    for S, N in [(2, 4), (4, 8), (4, 12), (6, 12)]:
        assert peak_units(deepspeed_1f1b(S, N), 1.0) == [float(S - s) for s in range(S)] == stock_units(S)
        zb = zb_h1(Costs.uniform(S, 10.0), N)
        # ZB-H1 defers W: with W keeping all of B's graph it holds more than stock; with W keeping
        # nothing it holds what 1F1B holds (its warm-up is S - s).
        assert any(p > u for p, u in zip(peak_units(zb, 1.0), stock_units(S)))
        assert peak_units(zb, 0.0) == [float(x) for x in warmup_counts(zb)] == stock_units(S)
        assert peak_units(zb, 1.0) == held(zb, 1.0)


@settings(max_examples=60, deadline=None)
@given(S=st.integers(2, 5), N=st.integers(1, 10), factor=st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0]),
       share=st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 1e6]), seed=st.integers(0, 10_000),
       pol=st.sampled_from([Policy(), Policy(w_fits_gap=True), Policy("BWF"), Policy("FBW")]))
def test_the_list_scheduler_keeps_within_any_budget_compiled_and_python_alike(S, N, factor, share, seed, pol):
    rng = random.Random(seed)
    costs = Costs([rng.uniform(1, 5) for _ in range(S)], [rng.uniform(1, 8) for _ in range(S)],
                  [rng.uniform(0.5, 5) for _ in range(S)], [rng.choice([0.0, rng.uniform(0, 20)]) for _ in range(S - 1)])
    units = budget_units(S, factor)
    warm = initial_warmup([min(c, N) for c in caps_within(units)])
    within = Policy(pol.priority, pol.w_fits_gap, pol.late_w, tuple(units), share)
    plan = list_schedule(costs, N, warm, policy=within)
    assert plan == list_schedule_py(costs, N, warm, within)
    validate_schedule(plan, S, N)
    assert over(plan, share, units) == []


def test_with_more_memory_the_list_scheduler_approaches_zero_bubble():
    """4 stages x 12 micro-batches, 10 ms per F, B and W, W keeping all of B's graph: within stock's
    memory the scheduler's order takes 1F1B's time; more memory never makes it slower; and a budget
    at ZB-H1's own peak never binds, so ZB-H1's warm-up gives ZB-H1's order and time."""
    from ds_pipemorph.plan.sim.simulate import makespan

    S, N = 4, 12
    costs = Costs.uniform(S, 10.0)
    one = makespan(deepspeed_1f1b(S, N), costs, N)
    zb = zb_h1(costs, N)
    assert makespan(zb, costs, N) < one
    times = []
    for factor in (1.0, 1.5, 2.0, 3.0):
        units = budget_units(S, factor)
        warm = initial_warmup([min(c, N) for c in caps_within(units)])
        times.append(makespan(list_schedule(costs, N, warm, policy=Policy(units=tuple(units))), costs, N))
    assert times[0] == one
    assert times == sorted(times, reverse=True) and times[-1] < one
    assert list_schedule(costs, N, [4, 3, 2, 1], policy=Policy(units=tuple(peak_units(zb, 1.0)))) == zb


@settings(max_examples=40, deadline=None)
@given(S=st.integers(2, 5), N=st.integers(2, 10), share=st.sampled_from([0.25, 0.5, 1.0, 1.5, 1e6]), seed=st.integers(0, 999))
def test_fit_budget_moves_only_ws_earlier_and_keeps_any_valid_plan_within_the_budget(S, N, share, seed):
    rng = random.Random(seed)
    costs = Costs([rng.uniform(1, 5) for _ in range(S)], [rng.uniform(1, 5) for _ in range(S)],
                  [rng.uniform(1, 5) for _ in range(S)], [0.0] * (S - 1))
    plan = list_schedule(costs, N, initial_warmup([N] * S), policy=Policy(late_w=frozenset(range(S))))  # every W last
    units = [float(max(x, 1)) for x in warmup_counts(plan)]  # the forwards fit, the deferred Ws do not
    fitted = fit_budget(plan, units, ratio=share)
    validate_schedule(fitted, S, N)
    assert over(fitted, share, units) == []
    for old, new in zip(plan, fitted):
        assert [op for op in old if op.kind != "W"] == [op for op in new if op.kind != "W"]
        assert sorted(new) == sorted(old)
        for k, op in enumerate(new):  # a W never moves later than it was
            if op.kind == "W":
                assert len([o for o in new[:k] if o.kind != "W"]) <= len([o for o in old[:old.index(op)] if o.kind != "W"])
    assert fit_budget(fitted, units, ratio=share) == fitted


def test_fit_budget_refuses_a_warm_up_deeper_than_the_budget():
    with pytest.raises(ValueError, match="stage 0 holds 4 micro-batches between F and B, more than its budget of 3"):
        fit_budget(deepspeed_1f1b(4, 8), [3.0, 3.0, 2.0, 1.0])
    with pytest.raises(OverBudget) as e:  # a budget converted from bytes is printed as a reader reads it
        fit_budget(deepspeed_1f1b(4, 8), [4.0, 2.178723, 2.0, 1.0])
    assert (e.value.stage, e.value.held) == (1, 3)
    assert str(e.value) == "stage 1 holds 3 micro-batches between F and B, more than its budget of 2.18"
    again = pickle.loads(pickle.dumps(e.value))
    assert (type(again), str(again), again.stage, again.held) == (OverBudget, str(e.value), 1, 3)


def test_the_search_keeps_within_the_budget_and_beats_or_ties_the_greedy_pass():
    S, N = 4, 8
    costs = Costs([4.0, 6.0, 5.0, 3.0], [8.0, 9.0, 7.0, 6.0], [3.0, 4.0, 3.0, 2.0], [2.0, 15.0, 2.0])
    units = budget_units(S, 1.5)
    res = search(costs, N, budget_s=30.0, seed=0, exact=False, max_evals=400, units=units, w_share=1.0)
    assert over(res.schedule, 1.0, units) == []
    from ds_pipemorph.plan.sim.simulate import makespan

    warm = initial_warmup([min(c, N) for c in caps_within(units)])
    greedy = list_schedule(costs, N, warm, policy=Policy(units=tuple(units)))
    assert res.iteration_ms <= makespan(greedy, costs, N) + 1e-9


@pytest.mark.parametrize("share", [0.5, 1.0, 2.0])
def test_ready_dispatch_keeps_within_the_budget_even_when_the_hint_defers_every_w(share):
    """The hint (ZB-H1 with every W at the end) does not fit; under ready dispatch the rule runs Ws
    early enough that the executed order does, and never stalls."""
    S, N = 4, 8
    costs = Costs([4.0, 6.0, 5.0, 3.0], [8.0, 9.0, 7.0, 6.0], [3.0, 4.0, 3.0, 2.0], [1.0, 12.0, 1.0])
    hint = list_schedule(costs, N, [4, 3, 2, 1], policy=Policy(late_w=frozenset(range(S))))
    units = budget_units(S, 1.0)
    assert any(p > u for p, u in zip(held(hint, share), units))
    tl = replay_ready(hint, costs, N, caps=[4, 3, 2, 1], units=units, w_share=share)
    executed = [[slot.op for slot in sorted((x for x in tl.slots if x.stage == s), key=lambda x: x.start)]
                for s in range(S)]
    assert all(len(row) == 3 * N for row in executed)
    assert over(executed, share, units) == []
