"""Property tests: every produced plan is valid and within its caps, and the simulator's iteration
time equals an independent longest-path computation over the dependency graph."""
from collections import defaultdict, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipemorph.plan.ir.ops import peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, gpipe, zb_h1
from ds_pipemorph.plan.sched.bounds import lower_bound_ms
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import POLICIES, search, warmup_candidates
from ds_pipemorph.plan.sched.warmup import check_lemma1, initial_warmup
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.plan.sim.validate import validate_schedule


def critical_path_ms(schedule, costs, n, fused=False):
    """Longest path through the DAG of (stage order edges + dependency edges with link delays)."""
    S = len(schedule)
    dur = {}
    edges = defaultdict(list)  # u -> [(v, weight added after u ends)]
    indeg = defaultdict(int)
    nodes = []
    for s, row in enumerate(schedule):
        for i, op in enumerate(row):
            u = (s, op.kind, op.mb)
            nodes.append(u)
            dur[u] = costs.op_time(s, op.kind)
            if i:
                p = row[i - 1]
                edges[(s, p.kind, p.mb)].append((u, 0.0))
    for s, row in enumerate(schedule):
        for i, op in enumerate(row):
            u, m = (s, op.kind, op.mb), op.mb
            if op.kind == "F" and s > 0:
                edges[(s - 1, "F", m)].append((u, costs.links[s - 1]))
            if op.kind == "B":
                edges[(s, "F", m)].append((u, 0.0))
                if s < S - 1:
                    src_row = schedule[s + 1]
                    j = src_row.index(type(op)("B", m))
                    fused_here = fused and j + 1 < len(src_row) and src_row[j + 1] == type(op)("W", m)
                    if fused_here:
                        edges[(s + 1, "W", m)].append((u, costs.links[s]))
                    else:
                        edges[(s + 1, "B", m)].append((u, costs.links[s]))
            if op.kind == "W":
                edges[(s, "B", m)].append((u, 0.0))
    for u in nodes:
        for v, _ in edges[u]:
            indeg[v] += 1
    start = {u: 0.0 for u in nodes}
    q = deque(u for u in nodes if indeg[u] == 0)
    seen = 0
    while q:
        u = q.popleft()
        seen += 1
        for v, wgt in edges[u]:
            start[v] = max(start[v], start[u] + dur[u] + wgt)
            indeg[v] -= 1
            if indeg[v] == 0:
                q.append(v)
    assert seen == len(nodes), "cycle"
    return max(start[u] + dur[u] for u in nodes)


@st.composite
def cases(draw, max_stages=5, max_n=8):
    S = draw(st.integers(2, max_stages))
    n = draw(st.integers(1, max_n))
    t = st.floats(0.5, 20.0, allow_nan=False)
    costs = Costs(
        [draw(t) for _ in range(S)],
        [draw(t) for _ in range(S)],
        [draw(t) for _ in range(S)],
        [draw(st.sampled_from([0.0, 0.0, draw(st.floats(0.0, 40.0))])) for _ in range(S - 1)],
    )
    caps = [draw(st.integers(1, n)) for _ in range(S)]
    return costs, n, caps


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from(POLICIES))
def test_list_schedules_are_valid_within_caps_and_replay_equals_critical_path(case, policy):
    costs, n, caps = case
    x = initial_warmup(caps)
    check_lemma1(x)
    sched = list_schedule(costs, n, x, policy=policy)
    validate_schedule(sched, costs.stages, n, caps=caps)
    assert all(p <= c for p, c in zip(peak_inflight(sched), caps))
    tl = replay(sched, costs, n)
    assert abs(tl.iteration_ms - critical_path_ms(sched, costs, n)) < 1e-6
    assert tl.iteration_ms >= lower_bound_ms(costs, n, caps=caps) - 1e-6


@settings(max_examples=40, deadline=None)
@given(cases())
def test_search_plans_are_valid_no_slower_than_greedy_and_above_the_bound(case):
    costs, n, caps = case
    res = search(costs, n, caps=caps, budget_s=10, max_evals=60)
    validate_schedule(res.schedule, costs.stages, n, caps=caps)
    assert abs(res.iteration_ms - critical_path_ms(res.schedule, costs, n)) < 1e-6
    greedy = replay(list_schedule(costs, n, initial_warmup(caps)), costs, n).iteration_ms
    assert res.iteration_ms <= greedy + 1e-9
    assert res.iteration_ms >= res.lower_bound_ms - 1e-6
    for x in warmup_candidates(costs, n, caps):
        check_lemma1(x)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_baselines_replay_equals_critical_path_fused_and_split(case):
    costs, n, _ = case
    S = costs.stages
    for sched, fused in ((deepspeed_1f1b(S, n), True), (gpipe(S, n), True), (zb_h1(costs, n), False)):
        validate_schedule(sched, S, n)
        assert abs(replay(sched, costs, n, fused_backward=fused).iteration_ms - critical_path_ms(sched, costs, n, fused)) < 1e-6


def test_uniform_profiles_without_delay_or_cap_reach_the_bound_exactly():
    for S, n in ((2, 2), (3, 4), (4, 12), (8, 32), (32, 256)):
        res = search(Costs.uniform(S, 10.0), n, budget_s=30, max_evals=3)
        assert res.iteration_ms == res.lower_bound_ms == 3 * n * 10.0 + (S - 1) * 10.0
