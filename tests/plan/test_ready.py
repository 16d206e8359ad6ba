"""Readiness-driven dispatch (``plan.sim.ready``) and op-time variation (``plan.sim.variation``).

Expected values come from ``simulate.replay`` (ordered dispatch with constant times must be it),
from hand-worked timelines, and from checks computed here from the replayed slots alone: each op
once, no overlap on a stage, dependencies and link delays respected, caps held at every moment, and
the dispatch rule itself (no op earlier in the hint was ready when a later one started; a stage
never idles while an op it may run is ready).
"""
import math
from bisect import bisect_right

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.ir.links import DIRECT, LATENCY, Delegated
from ds_pipemorph.plan.ir.ops import Op, parse_stage, peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, gpipe, zb_h1
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import POLICIES, search
from ds_pipemorph.plan.sim.ready import replay_ready, replay_varying
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.plan.sim.timeline import StuckSchedule
from ds_pipemorph.plan.sim.variation import (
    OpTable,
    heavy,
    heavy_microbatches,
    jitter,
    link_trace,
    parse_vary,
)
from ds_pipemorph.plan.sched.warmup import adapted_warmup, initial_warmup

KIDX = {"F": 0, "B": 1, "W": 2}


def rows(*texts):
    return [parse_stage(t.split()) for t in texts]


def slot_map(tl):
    return {(x.stage, x.op.kind, x.op.mb): (x.start, x.end) for x in tl.slots}


def stage_order(tl, s):
    return [str(x.op) for x in sorted((x for x in tl.slots if x.stage == s), key=lambda x: x.start)]


# -- ordered dispatch with constant times is simulate.replay, to the last bit ---------------------

COSTS = Costs([10.0, 11.0, 9.0, 12.0], [10.0, 12.5, 10.0, 9.0], [5.0, 6.0, 7.5, 8.0], [3.0, 0.0, 20.0])
N = 12
CAPS = [7, 5, 3, 1]


PLANS = {  # name -> (planner, fused backward): the project's own planners
    "1f1b": (lambda: deepspeed_1f1b(4, N), True),
    "gpipe": (lambda: gpipe(4, N), True),
    "zb-h1": (lambda: zb_h1(COSTS, N), False),
    "adaptive-greedy": (lambda: list_schedule(COSTS, N, initial_warmup(CAPS)), False),
    "adaptive-alg2": (lambda: list_schedule(COSTS, N, adapted_warmup(COSTS, N, caps=CAPS)), False),
    "adaptive-search": (lambda: search(COSTS, N, caps=CAPS, budget_s=10, max_evals=150, exact=False).schedule, False),
}


@pytest.mark.parametrize("model", [LATENCY, DIRECT, Delegated(2)], ids=str)
@pytest.mark.parametrize("name", list(PLANS))
def test_ordered_with_constant_times_equals_simulate_replay_exactly(name, model):
    make, fused = PLANS[name]
    sched = make()
    want = replay(sched, COSTS, N, fused_backward=fused, link_model=model)
    for got in (
        replay_varying(sched, COSTS, N, dispatch="ordered", fused_backward=fused, link_model=model),
        # the same times given per op, and the same delays given as one breakpoint per link
        replay_varying(sched, COSTS, N, dispatch="ordered", op_times=OpTable.constant(COSTS, N),
                       link_delays=[[(0.0, c)] for c in COSTS.links], fused_backward=fused, link_model=model),
    ):
        assert got.iteration_ms == want.iteration_ms
        assert slot_map(got) == slot_map(want)
        assert got.busy_ms == want.busy_ms
        assert got.peak_inflight == want.peak_inflight == peak_inflight(sched)
    got = replay_varying(sched, COSTS, N, dispatch="ordered", fused_backward=fused, link_model=model)
    assert got.bubble_rate == want.bubble_rate


def test_ordered_stuck_order_raises_like_simulate():
    bad = rows("F0 B0 W0", "B0 F0 W0")  # last stage: B0 before its own F0
    with pytest.raises(StuckSchedule) as want:
        replay(bad, Costs.uniform(2, 1.0), 1)
    with pytest.raises(StuckSchedule) as got:
        replay_varying(bad, Costs.uniform(2, 1.0), 1)
    assert str(got.value) == str(want.value) and "stage 0: B0 cannot run" in str(got.value)
    # the same rows as a hint: ready dispatch runs them
    tl = replay_ready(bad, Costs.uniform(2, 1.0), 1, caps=[1, 1])
    assert stage_order(tl, 1) == ["F0", "B0", "W0"] and tl.iteration_ms == 5.0


# -- hand-worked timelines (1 ms per op unless said, latency links) -------------------------------

def test_ready_lets_a_ready_w_overtake_a_late_b():
    """2 stages, 2 micro-batches, F1 on stage 1 takes 5 ms (a heavy micro-batch there).

    stage 1 (both rules): F0 1-2, B0 2-3, F1 3-8, B1 8-9, W0 9-10, W1 10-11.
    stage 0 ordered: F0 0-1, F1 1-2, B0 3-4, then waits for B1's gradient (9): B1 9-10, W0 10-11,
    W1 11-12 -> 12 ms. Ready: after B0 it runs W0 4-5 (B1 is not ready), then B1 9-10, W1 10-11
    -> 11 ms.
    """
    hint = rows("F0 F1 B0 B1 W0 W1", "F0 B0 F1 B1 W0 W1")
    costs = Costs.uniform(2, 1.0)
    times = {(1, "F", 1): 5.0}
    ordered = replay_varying(hint, costs, 2, dispatch="ordered", op_times=times)
    ready = replay_ready(hint, costs, 2, caps=peak_inflight(hint), op_times=times)
    assert ordered.iteration_ms == 12.0 and ready.iteration_ms == 11.0
    assert stage_order(ready, 0) == ["F0", "F1", "B0", "W0", "B1", "W1"]
    assert slot_map(ready)[(0, "W", 0)] == (4.0, 5.0)
    assert slot_map(ready)[(0, "B", 1)] == (9.0, 10.0)
    assert stage_order(ready, 1) == stage_order(ordered, 1) == ["F0", "B0", "F1", "B1", "W0", "W1"]


def test_the_bare_rule_can_be_slower_than_the_order_and_patience_waits_for_the_message_on_its_way():
    """2 stages, 2 ms link, F1 on stage 0 takes 3 ms, W0 on stage 1 takes 3 ms.

    stage 0: F0 0-1 (arrives 3), F1 1-4 (arrives 6).
    stage 1 ordered: F0 3-4, B0 4-5 (gradient at 7), F1 6-7, B1 7-8 (gradient at 10), W0 8-11, W1 11-12.
    stage 0 ordered: B0 7-8, W0 8-9, B1 10-11, W1 11-12 -> 12 ms.
    stage 1, bare rule: at 5 only W0 is ready (F1 arrives at 6): W0 5-8, F1 8-9, B1 9-10 (gradient
    at 12), W1 10-11; stage 0 then runs B1 12-13, W1 13-14 -> 14 ms.
    With patience W0 would end at 8, after F1 lands at 6: stage 1 waits and runs the order -> 12 ms.
    """
    hint = rows("F0 F1 B0 W0 B1 W1", "F0 B0 F1 B1 W0 W1")
    costs = Costs.uniform(2, 1.0, [2.0])
    times = {(0, "F", 1): 3.0, (1, "W", 0): 3.0}
    ordered = replay_varying(hint, costs, 2, dispatch="ordered", op_times=times)
    assert ordered.iteration_ms == 12.0
    bare = replay_ready(hint, costs, 2, caps=[2, 1], op_times=times, patience=False)
    assert bare.iteration_ms == 14.0
    assert slot_map(bare)[(1, "W", 0)] == (5.0, 8.0)
    assert slot_map(bare)[(0, "B", 1)] == (12.0, 13.0)
    patient = replay_ready(hint, costs, 2, caps=[2, 1], op_times=times)
    assert patient.iteration_ms == 12.0
    assert slot_map(patient)[(1, "F", 1)] == (6.0, 7.0) and slot_map(patient)[(1, "W", 0)] == (8.0, 11.0)
    assert slot_map(patient) == slot_map(ordered)


def test_patience_does_not_wait_for_a_message_that_lands_after_the_other_op_would_end():
    """As above with W0 on stage 1 taking 0.5 ms: at 5 it would end at 5.5, before F1 lands at 6,
    so W0 runs 5-5.5 and F1 still starts at 6: F1 6-7, B1 7-8, W1 8-9 on stage 1; the gradient of
    B1 lands on stage 0 at 10: B1 10-11, W1 11-12 -> 12 ms, W0 out of the hint's order."""
    hint = rows("F0 F1 B0 W0 B1 W1", "F0 B0 F1 B1 W0 W1")
    costs = Costs.uniform(2, 1.0, [2.0])
    times = {(0, "F", 1): 3.0, (1, "W", 0): 0.5}
    tl = replay_ready(hint, costs, 2, caps=[2, 1], op_times=times)
    assert slot_map(tl)[(1, "W", 0)] == (5.0, 5.5) and slot_map(tl)[(1, "F", 1)] == (6.0, 7.0)
    assert tl.iteration_ms == 12.0


def test_the_cap_keeps_a_ready_forward_waiting():
    """2 stages, 3 micro-batches; stage 0's hint is F0 F1 F2 B0 ..., B0's gradient arrives at 3.

    cap 2: F2 must wait for B0 (3-4): F0 0-1, F1 1-2, idle, B0 3-4, F2 4-5.
    cap 3: F2 runs 2-3 while B0's gradient is on its way.
    """
    hint = rows("F0 F1 F2 B0 W0 B1 W1 B2 W2", "F0 B0 W0 F1 B1 W1 F2 B2 W2")
    costs = Costs.uniform(2, 1.0)
    two = slot_map(replay_ready(hint, costs, 3, caps=[2, 1]))
    assert two[(0, "B", 0)] == (3.0, 4.0) and two[(0, "F", 2)] == (4.0, 5.0)
    three = slot_map(replay_ready(hint, costs, 3, caps=[3, 1]))
    assert three[(0, "F", 2)] == (2.0, 3.0) and three[(0, "B", 0)] == (3.0, 4.0)


def test_a_message_takes_the_delay_in_force_when_it_departs():
    """1 micro-batch over 2 stages; link 0 is 0 ms before t=1 ms and 10 ms from then on.

    F0 0-1 on stage 0 departs at 1 (10 ms): arrives 11; stage 1 F0 11-12, B0 12-13, W0 13-14;
    the gradient departs at 13 and arrives at 23; stage 0 B0 23-24, W0 24-25 -> 25 ms.
    """
    sched = rows("F0 B0 W0", "F0 B0 W0")
    for how in ("ordered", "ready"):
        tl = replay_varying(sched, Costs.uniform(2, 1.0), 1, dispatch=how, link_delays=[[(0.0, 0.0), (1.0, 10.0)]])
        assert tl.iteration_ms == 25.0
        assert slot_map(tl)[(1, "F", 0)] == (11.0, 12.0)


def test_fused_backward_sends_the_gradient_after_w_under_both_rules():
    """2 stages, 1 micro-batch, B0 W0 fused, W takes 4 ms on stage 1: the gradient leaves at 7."""
    sched = rows("F0 B0 W0", "F0 B0 W0")
    for how in ("ordered", "ready"):
        tl = replay_varying(sched, Costs.uniform(2, 1.0), 1, dispatch=how, op_times={(1, "W", 0): 4.0},
                            fused_backward=True)
        assert slot_map(tl)[(0, "B", 0)] == (7.0, 8.0) and tl.iteration_ms == 9.0


def test_bad_arguments_raise_value_errors():
    sched = rows("F0 B0 W0", "F0 B0 W0")
    costs = Costs.uniform(2, 1.0)
    with pytest.raises(ValueError, match="dispatch is 'ordered' or 'ready'"):
        replay_varying(sched, costs, 1, dispatch="eager")
    with pytest.raises(ValueError, match="at least 1 activation"):
        replay_ready(sched, costs, 1, caps=[1, 0])
    with pytest.raises(ValueError, match="stage 1: W0 is missing"):
        replay_ready(rows("F0 B0 W0", "F0 B0"), costs, 1)
    with pytest.raises(ValueError, match="trace times must not decrease"):
        replay_ready(sched, costs, 1, link_delays=[[(5.0, 1.0), (2.0, 1.0)]])
    with pytest.raises(ValueError, match="finite and >= 0"):
        replay_ready(sched, costs, 1, op_times={(0, "F", 0): -1.0})


# -- properties over random hints, caps, times and delays ----------------------------------------

def delay_at(curve, t):
    """The delay in force at t: the last breakpoint at or before t (the first before them all)."""
    i = bisect_right([p[0] for p in curve], t) - 1
    return curve[max(i, 0)][1]


@st.composite
def replay_cases(draw, any_hint=True, models=True, curves=True):
    S = draw(st.integers(2, 4))
    n = draw(st.integers(1, 6))
    t = st.floats(0.5, 10.0)
    costs = Costs([draw(t) for _ in range(S)], [draw(t) for _ in range(S)], [draw(t) for _ in range(S)],
                  [draw(st.sampled_from([0.0, 2.0, 7.5])) for _ in range(S - 1)])
    spread = draw(st.sampled_from([0.0, 0.3, 0.8]))
    table = jitter(costs, n, spread, seed=draw(st.integers(0, 2**16)), kinds="FBW")
    if any_hint and draw(st.booleans()):
        # any order at all: a hint need not respect the dependencies
        ops = [Op(k, m) for m in range(n) for k in "FBW"]
        hint = [draw(st.permutations(ops)) for _ in range(S)]
    else:
        x = [draw(st.integers(1, n)) for _ in range(S)]
        hint = list_schedule(costs, n, initial_warmup(x), policy=draw(st.sampled_from(POLICIES)))
    caps = [draw(st.integers(1, n + 1)) for _ in range(S)]
    delays = None
    if curves and draw(st.booleans()):
        delays = [sorted([(draw(st.floats(0, 60)), draw(st.floats(0, 15))) for _ in range(draw(st.integers(1, 3)))])
                  for _ in range(S - 1)]
    model = draw(st.sampled_from([LATENCY, DIRECT, Delegated(1), Delegated(2)])) if models else LATENCY
    return costs, n, hint, caps, table, delays, model


def check_timeline(tl, costs, n, table, delays):
    """Each op once with its own time, no overlap on a stage, every dependency and link delay kept."""
    S = costs.stages
    got = slot_map(tl)
    assert len(got) == len(tl.slots) == 3 * n * S
    curves = delays if delays is not None else [[(0.0, c)] for c in costs.links]
    least = [min(c for _, c in curve) for curve in curves]
    for (s, k, m), (a, b) in got.items():
        assert b - a == pytest.approx(table(s, k, m), abs=1e-9)
    for s in range(S):
        mine = sorted(v for key, v in got.items() if key[0] == s)
        for (_, e0), (a1, _) in zip(mine, mine[1:]):
            assert a1 >= e0
    for s in range(S):
        for m in range(n):
            fa, fb = got[(s, "F", m)]
            ba, bb = got[(s, "B", m)]
            wa, _ = got[(s, "W", m)]
            assert ba >= fb and wa >= bb
            if s > 0:
                assert fa >= got[(s - 1, "F", m)][1] + least[s - 1]
            if s < S - 1:  # (a fused backward sends it even later, after W)
                assert ba >= got[(s + 1, "B", m)][1] + least[s]
    return got


def held_at(got, s, n, t):
    """Activations stage s holds at t: F m started before t, B m not ended by t."""
    return sum(1 for m in range(n) if got[(s, "F", m)][0] < t and got[(s, "B", m)][1] > t)


@settings(max_examples=120, deadline=None)
@given(replay_cases(), st.booleans())
def test_ready_dispatch_never_deadlocks_keeps_caps_and_dependencies(case, fused):
    costs, n, hint, caps, table, delays, model = case
    tl = replay_ready(hint, costs, n, caps=caps, op_times=table, link_delays=delays, fused_backward=fused,
                      link_model=model)
    got = check_timeline(tl, costs, n, table, delays)
    S = costs.stages
    for s in range(S):
        for m in range(n):  # the cap, at each moment a forward starts (when the count goes up)
            assert held_at(got, s, n, got[(s, "F", m)][0]) + 1 <= caps[s]
    assert all(p <= c for p, c in zip(tl.peak_inflight, caps))
    # something runs or travels at every moment: the iteration is at most all work plus all travel
    longest = [max(c for _, c in curve) for curve in (delays or [[(0.0, c)] for c in costs.links])]
    assert tl.iteration_ms <= sum(tl.busy_ms) + 2 * n * sum(longest) + 1e-6
    assert tl.iteration_ms >= max(tl.busy_ms) - 1e-9


@settings(max_examples=120, deadline=None)
@given(replay_cases(models=False))
def test_ready_dispatch_follows_its_rule(case):
    """The bare rule (no patience), latency links, so an op's ready time follows from the slots
    alone: at each start no op earlier in the hint was ready, and during each idle gap no op the
    stage may run was ready."""
    costs, n, hint, caps, table, delays, _ = case
    S = costs.stages
    tl = replay_ready(hint, costs, n, caps=caps, op_times=table, link_delays=delays, patience=False)
    got = check_timeline(tl, costs, n, table, delays)
    curves = delays if delays is not None else [[(0.0, c)] for c in costs.links]

    def ready_time(s, k, m):
        if k == "F":
            if s == 0:
                return 0.0
            e = got[(s - 1, "F", m)][1]
            return e + delay_at(curves[s - 1], e)
        if k == "W":  # its B is done and the W before it in the hint has run (Ws run in hint order)
            ws = [op.mb for op in hint[s] if op.kind == "W"]
            i = ws.index(m)
            return max(got[(s, "B", m)][1], got[(s, "W", ws[i - 1])][1] if i else 0.0)
        r = got[(s, "F", m)][1]
        if s < S - 1:
            e = got[(s + 1, "B", m)][1]
            r = max(r, e + delay_at(curves[s], e))
        return r

    def may_run(s, op, t):
        if ready_time(s, op.kind, op.mb) > t:
            return False
        return op.kind != "F" or held_at(got, s, n, t) < caps[s]

    for s in range(S):
        pos = {op: i for i, op in enumerate(hint[s])}
        mine = sorted((got[(s, op.kind, op.mb)], pos[op], op) for op in hint[s])
        prev_end = 0.0
        for (a, b), i, op in mine:
            if prev_end < a:  # idle over [prev_end, a): nothing it may run became ready before a
                full = held_at(got, s, n, prev_end) >= caps[s]  # holds still while the stage idles
                for other in hint[s]:
                    if got[(s, other.kind, other.mb)][0] >= a:
                        assert ready_time(s, other.kind, other.mb) >= a or (other.kind == "F" and full), \
                            f"stage {s} idled over [{prev_end}, {a}) with {other} ready"
            for other in hint[s]:  # at a, no op before it in the hint could run
                if pos[other] < i and got[(s, other.kind, other.mb)][0] > a:
                    assert not may_run(s, other, a), f"stage {s}: {op} started at {a} before ready {other}"
            prev_end = b


@settings(max_examples=80, deadline=None)
@given(replay_cases(any_hint=False, curves=False))
def test_ordered_with_constant_times_equals_replay_for_random_plans(case):
    costs, n, plan, _, _, _, model = case
    want = replay(plan, costs, n, link_model=model)
    got = replay_varying(plan, costs, n, dispatch="ordered", link_model=model)
    assert got.iteration_ms == want.iteration_ms and slot_map(got) == slot_map(want)


@settings(max_examples=80, deadline=None)
@given(replay_cases(any_hint=False, models=False, curves=False), st.booleans())
def test_ordered_with_varying_times_equals_the_longest_path(case, fused):
    """Ordered dispatch under per-op times: each op starts at the latest end among its stage
    predecessor and its inputs (plus the link delay), computed here in plan order."""
    costs, n, plan, _, table, _, _ = case
    S = costs.stages
    tl = replay_varying(plan, costs, n, dispatch="ordered", op_times=table, fused_backward=fused)
    check_timeline(tl, costs, n, table, None)
    end = {}
    pending = [list(r) for r in plan]
    free = [0.0] * S
    while any(pending):
        moved = False
        for s in range(S):
            while pending[s]:
                op = pending[s][0]
                k, m = op.kind, op.mb
                deps = []
                if k == "F" and s > 0:
                    deps.append((s - 1, "F", m, costs.links[s - 1]))
                if k == "B":
                    deps.append((s, "F", m, 0.0))
                    if s < S - 1:
                        row = plan[s + 1]
                        j = row.index(Op("B", m))
                        last = "W" if fused and j + 1 < len(row) and row[j + 1] == Op("W", m) else "B"
                        deps.append((s + 1, last, m, costs.links[s]))
                if k == "W":
                    deps.append((s, "B", m, 0.0))
                if any((a, b, c) not in end for a, b, c, _ in deps):
                    break
                start = max([free[s]] + [end[(a, b, c)] + d for a, b, c, d in deps])
                end[(s, k, m)] = free[s] = start + table(s, k, m)
                pending[s].pop(0)
                moved = True
        assert moved
    assert tl.iteration_ms == pytest.approx(max(end.values()), abs=1e-9)
    assert {key: v[1] for key, v in slot_map(tl).items()} == pytest.approx(end, abs=1e-9)


# -- variation specs --------------------------------------------------------------------------------

BASE = Costs([10.0, 20.0, 30.0], [11.0, 21.0, 31.0], [5.0, 6.0, 7.0], [0.0, 0.0])


def test_jitter_is_seeded_and_parse_vary_gives_the_same_table():
    a = jitter(BASE, 8, 0.3, seed=1)
    assert a == jitter(BASE, 8, 0.3, seed=1) == parse_vary("jitter:0.3,seed=1", BASE, 8)
    assert parse_vary(" jitter:spread=0.3, seed=1 ", BASE, 8) == a
    assert a != jitter(BASE, 8, 0.3, seed=2)
    assert jitter(BASE, 8, 0.0, seed=5) == OpTable.constant(BASE, 8)


def test_jitter_factors_lie_in_the_spread_with_mean_one():
    costs = Costs([10.0], [4.0], [2.0], [])
    n = 20000
    tab = jitter(costs, n, 0.3, seed=7)
    for row, base in ((tab.f[0], 10.0), (tab.b[0], 4.0)):
        factors = [t / base for t in row]
        assert min(factors) >= 0.7 - 1e-12 and max(factors) <= 1.3 + 1e-12
        assert abs(sum(factors) / n - 1.0) < 0.01  # sd of the mean: 0.3 / sqrt(3 n) = 0.0012
        assert len(set(factors)) > n * 0.99  # each op draws its own factor
    assert set(tab.w[0]) == {2.0}  # default kinds F and B
    only_w = parse_vary("jitter:0.5,seed=7,kinds=w", costs, 50)
    assert set(only_w.f[0]) == {10.0} and set(only_w.b[0]) == {4.0} and len(set(only_w.w[0])) == 50


@pytest.mark.parametrize("frac,n,count", [(0.25, 12, 3), (0.1, 7, 1), (0.3, 5, 2), (0.5, 5, 3), (0.0, 9, 0), (1.0, 4, 4)])
def test_heavy_picks_round_frac_n_microbatches_half_up(frac, n, count):
    picked = heavy_microbatches(n, frac, seed=3)
    assert len(picked) == count == len(set(picked)) and all(0 <= m < n for m in picked)
    assert picked == heavy_microbatches(n, frac, seed=3)


def test_heavy_slows_those_microbatches_on_the_first_k_stages_only():
    n = 12
    tab = parse_vary("heavy:frac=0.25,factor=3,stages=2,seed=4", BASE, n)
    assert tab == heavy(BASE, n, frac=0.25, factor=3.0, stages=2, seed=4)
    picked = set(heavy_microbatches(n, 0.25, 4))
    assert len(picked) == 3
    for s in range(3):
        for k in "FBW":
            base = BASE.op_time(s, k)
            slow = {m for m in range(n) if tab(s, k, m) != base}
            assert slow == (picked if s < 2 else set())
            assert all(tab(s, k, m) == 3 * base for m in slow)
    assert parse_vary("heavy:", BASE, n) == heavy(BASE, n)  # defaults: 0.25, 3, 1 stage, seed 0


def test_table_file_fills_left_out_keys_from_the_costs(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("forward: [[1, 2], 3, [4, 5]]\n")
    tab = parse_vary(f"table:{p}", BASE, 2)
    assert tab.f == ((1.0, 2.0), (3.0, 3.0), (4.0, 5.0))
    assert tab.b == OpTable.constant(BASE, 2).b and tab.w == OpTable.constant(BASE, 2).w
    assert parse_vary(str(p), BASE, 2) == tab  # a bare path to a YAML/JSON file


@pytest.mark.parametrize("spec,needle", [
    ("", "is not a variation"),
    ("wobble:1", "is not a variation"),
    ("jitter", "give the spread"),
    ("jitter:abc", "is not a number"),
    ("jitter:1.5", "fraction in [0, 1]"),
    ("jitter:nan", "is not a number"),
    ("jitter:0.3,seed=x", "is not a whole number"),
    ("jitter:0.3,kinds=FX", "letters of FBW"),
    ("jitter:0.3,foo=1", "unknown key 'foo'"),
    ("jitter:0.3,seed=1,seed=2", "given twice"),
    ("jitter:0.3,0.4", "should be key=value"),
    ("heavy:0.5", "should be key=value"),
    ("heavy:frac=2", "frac is a fraction"),
    ("heavy:factor=-1", "factor is a number >= 0"),
    ("heavy:stages=4", "should be 1..3"),
    ("table:", "give the file"),
    ("table:/nonexistent/t.yaml", "no such file"),
])
def test_bad_specs_raise_bad_input_with_one_sentence(spec, needle):
    with pytest.raises(BadInput) as e:
        parse_vary(spec, BASE, 4)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.strip() == msg


@pytest.mark.parametrize("text,needle", [
    ("forward: [1, 2]\n", "expected 3 rows"),
    ("forward: [[1, 2, 3], 1, 1]\n", "stage 0 has 3 values, expected 4"),
    ("forward: [-1, 1, 1]\n", "times are >= 0"),
    ("forwards: [1, 1, 1]\n", "unknown key 'forwards'"),
])
def test_bad_table_files_raise_bad_input(tmp_path, text, needle):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    with pytest.raises(BadInput) as e:
        parse_vary(f"table:{p}", BASE, 4)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_link_trace_turns_seconds_into_breakpoints_in_ms(tmp_path):
    p = tmp_path / "tr.yaml"
    p.write_text("points:\n - {t: 0, links_ms: [0, 5]}\n - {t: 0.1, links_ms: [0, 20]}\n - {t: 0.25, links_ms: [3, 20]}\n")
    assert link_trace(p, 2) == [[(0.0, 0.0), (250.0, 3.0)], [(0.0, 5.0), (100.0, 20.0)]]


@pytest.mark.parametrize("data,needle", [
    ({"points": []}, "points"),
    ({"points": [{"t": 1, "links_ms": [0, 0]}, {"t": 0.5, "links_ms": [0, 0]}]}, "times must not decrease"),
    ({"points": [{"t": 0, "links_ms": [0, -1]}]}, "link 1 has a delay of -1 ms; a delay is a finite number >= 0"),
    ({"points": [{"t": -1, "links_ms": [0, 0]}]}, "points.0.t"),
    ({"points": [{"t": 0, "links_ms": [0]}]}, "has 1 delays, the pipeline has 2 links"),
    ({"points": [{"t": 0, "links_ms": [0, 0], "delays": [0, 0]}]}, "unknown key 'points.0.delays'"),
])
def test_bad_link_traces_raise_bad_input(tmp_path, data, needle):
    import json

    p = tmp_path / "tr.json"
    p.write_text(json.dumps(data))
    with pytest.raises(BadInput) as e:
        link_trace(p, 2)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_replay_under_jitter_is_deterministic_and_never_shorter_than_a_stage_busy_time():
    sched = zb_h1(BASE, 8)
    tab = parse_vary("jitter:0.4,seed=9", BASE, 8)
    a = replay_ready(sched, BASE, 8, caps=peak_inflight(sched), op_times=tab)
    b = replay_ready(sched, BASE, 8, caps=peak_inflight(sched), op_times=tab)
    assert slot_map(a) == slot_map(b)
    assert a.iteration_ms >= max(sum(tab(s, k, m) for k in "FBW" for m in range(8)) for s in range(3)) - 1e-9
    assert not math.isnan(a.bubble_rate)
