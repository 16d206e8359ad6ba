"""Exact planner (MILP with HiGHS): known optima, optimum <= every heuristic, brute force on tiny cases."""
import itertools
import random
import sys

import pytest

from ds_pipemorph.plan.ir.ops import Op, parse_stage, peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import BASELINES, baseline
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.warmup import initial_warmup
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.plan.sim.timeline import StuckSchedule
from ds_pipemorph.plan.sim.validate import validate_schedule

try:
    import highspy  # noqa: F401

    HAVE_HIGHS = True
except ImportError:
    HAVE_HIGHS = False

needs_highs = pytest.mark.skipif(not HAVE_HIGHS, reason="highspy not installed (pip install ds_pipemorph[milp])")


def solve(costs, n, caps=None, **kw):
    from ds_pipemorph.plan.sched.milp import solve_exact

    res = solve_exact(costs, n, caps=caps, **kw)
    validate_schedule(res.schedule, costs.stages, n, caps=caps)
    assert res.iteration_ms == pytest.approx(replay(res.schedule, costs, n).iteration_ms)
    return res


def random_costs(rng, S, slow_links=1):
    draw = lambda: [round(rng.uniform(5, 20), 1) for _ in range(S)]
    links = [0.0] * (S - 1)
    for i in rng.sample(range(S - 1), slow_links):
        links[i] = round(rng.uniform(5, 40), 1)
    return Costs(draw(), draw(), draw(), links)


@needs_highs
@pytest.mark.timeout(120)
def test_uniform_no_cap_is_3nt_plus_s_minus_1_t():
    S, N, t = 4, 12, 10.0
    res = solve(Costs.uniform(S, t), N)
    assert res.optimal
    assert res.iteration_ms == pytest.approx(3 * N * t + (S - 1) * t)  # 390 ms
    assert res.lower_bound_ms == pytest.approx(390.0)
    assert res.objective_ms == pytest.approx(390.0)


@needs_highs
@pytest.mark.timeout(120)
def test_uniform_zb_h1_memory_keeps_the_same_optimum():
    # With F = B = W the ZB-H1 memory (1F1B's S - s in flight) costs nothing: the ZB paper's H1
    # bubble is (S-1)(F+B-W) = (S-1)t, so the optimum is still 3Nt + (S-1)t = 390 ms, and the
    # greedy list scheduler with warm-up [4,3,2,1] already reaches it (checked here, not assumed).
    S, N, t, caps = 4, 12, 10.0, [4, 3, 2, 1]
    costs = Costs.uniform(S, t)
    greedy = replay(list_schedule(costs, N, caps), costs, N).iteration_ms
    res = solve(costs, N, caps)
    assert res.optimal
    assert res.iteration_ms == pytest.approx(390.0)
    assert res.iteration_ms <= greedy + 1e-9
    assert greedy == pytest.approx(390.0)
    assert peak_inflight(res.schedule) == caps


@needs_highs
@pytest.mark.timeout(120)
def test_one_activation_per_stage_costs_one_round_trip_per_microbatch():
    # Cap 1 on stage 0: F m+1 waits for B m there, and B m ends at least one round trip (F down S
    # stages, B back up S stages: 2*S*t) after F m starts. So B_{N-1} ends >= N*2*S*t, then W_{N-1}:
    # T >= N*2*S*t + t. The W's fit in the idle gaps, so this is the optimum: 4*80 + 10 = 330 ms.
    S, N, t = 4, 4, 10.0
    costs = Costs.uniform(S, t)
    res = solve(costs, N, [1] * S)
    assert res.optimal
    assert peak_inflight(res.schedule) == [1] * S
    assert res.iteration_ms == pytest.approx(N * 2 * S * t + t)
    seq = [[Op(k, m) for m in range(N) for k in "FBW"] for _ in range(S)]
    assert res.iteration_ms < replay(seq, costs, N).iteration_ms


@needs_highs
@pytest.mark.timeout(120)
def test_heterogeneous_optimum_beats_every_baseline_and_the_greedy_pass():
    rng = random.Random(7)
    S, N = 4, 6
    costs = random_costs(rng, S, slow_links=1)
    res = solve(costs, N, time_limit_s=60)
    assert res.optimal
    # Strictly better than the greedy pass and every baseline on this case (one slow link).
    heuristics = {name: baseline(name, costs, N) for name in BASELINES}
    heuristics["greedy"] = list_schedule(costs, N, initial_warmup([N] * S))
    for name, sched in heuristics.items():
        assert res.iteration_ms < replay(sched, costs, N).iteration_ms - 1e-6, name
    assert res.iteration_ms >= res.lower_bound_ms - 1e-6
    # And no better than two bounds every plan obeys, computed here by hand: stage s cannot start
    # before micro-batch 0's forward and the links reach it, then runs N·(F+B+W) of work; and
    # micro-batch 0 must go down every stage and back, then stage 0 runs its W.
    f, b, w, c = costs.f, costs.b, costs.w, costs.links
    busy = max(sum(f[:s]) + sum(c[:s]) + N * (f[s] + b[s] + w[s]) for s in range(S))
    round_trip = sum(f) + sum(b) + 2 * sum(c) + w[0]
    assert res.iteration_ms >= max(busy, round_trip) - 1e-6


@needs_highs
@pytest.mark.timeout(120)
def test_heterogeneous_with_caps_and_slow_links():
    rng = random.Random(3)
    S, N, caps = 4, 7, [5, 2, 3, 1]
    costs = random_costs(rng, S, slow_links=2)
    greedy = list_schedule(costs, N, initial_warmup(caps))
    res = solve(costs, N, caps, time_limit_s=60, warm_start=greedy)
    assert res.optimal
    assert all(p <= c for p, c in zip(peak_inflight(res.schedule), caps))
    assert res.iteration_ms <= replay(greedy, costs, N).iteration_ms + 1e-6
    # The baselines keep S - s activations in flight, over these caps on stage 1; the order that
    # runs F m, B m, W m one micro-batch at a time keeps one, so it is a plan within the caps too.
    sequential = [[Op(k, m) for m in range(N) for k in "FBW"] for _ in range(S)]
    assert all(p <= c for p, c in zip(peak_inflight(sequential), caps))
    assert res.iteration_ms <= replay(sequential, costs, N).iteration_ms + 1e-6


@needs_highs
@pytest.mark.timeout(120)
def test_time_limit_returns_the_start_plan_and_a_valid_bound():
    rng = random.Random(11)
    S, N, caps = 5, 8, [7, 4, 6, 4, 3]
    costs = random_costs(rng, S, slow_links=1)
    greedy = list_schedule(costs, N, initial_warmup(caps))
    res = solve(costs, N, caps, time_limit_s=0.0, warm_start=greedy)
    assert not res.optimal
    assert "time limit" in res.status.lower()
    assert res.iteration_ms <= replay(greedy, costs, N).iteration_ms + 1e-6
    assert 0 < res.lower_bound_ms <= res.iteration_ms


def _orders(n):
    """Every order of F m, B m, W m (m < n) on one stage that keeps F m < B m < W m per m."""
    ops = [Op(k, m) for m in range(n) for k in "FBW"]
    for perm in itertools.permutations(range(3 * n)):
        row = [ops[i] for i in perm]
        pos = {op: i for i, op in enumerate(row)}
        if all(pos[Op("F", m)] < pos[Op("B", m)] < pos[Op("W", m)] for m in range(n)):
            yield row


def _brute_force(costs, n, caps):
    rows = [r for r in _orders(n)]
    best = float("inf")
    for combo in itertools.product(*[[r for r in rows if peak_inflight([r])[0] <= caps[s]] for s in range(costs.stages)]):
        try:
            best = min(best, replay(list(combo), costs, n).iteration_ms)
        except StuckSchedule:
            pass
    return best


@needs_highs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed,caps,zero_w", [(1, [2, 2, 2], False), (2, [1, 2, 1], False), (5, [2, 1, 2], True)])
def test_matches_brute_force_over_all_orders_without_fifo(seed, caps, zero_w):
    # Brute force enumerates every per-stage order (micro-batches may overtake each other), so
    # equality checks the formulation and that the FIFO restriction loses nothing.
    rng = random.Random(seed)
    S, N = 3, 2
    costs = random_costs(rng, S, slow_links=1)
    if zero_w:
        costs = Costs(costs.f, costs.b, [0.0] * S, costs.links)
    res = solve(costs, N, caps)
    assert res.optimal
    assert res.iteration_ms == pytest.approx(_brute_force(costs, N, caps), abs=1e-6)


@needs_highs
@pytest.mark.timeout(120)
def test_warm_start_out_of_fifo_order_is_relabelled():
    from ds_pipemorph.plan.sched.milp import fifo_relabel

    S, N = 2, 3
    costs = Costs([10.0, 10.0], [10.0, 10.0], [5.0, 5.0], [0.0])
    # Stage 0 runs B/W of micro-batch 1 before those of 0 (swapped) -- valid, but not FIFO.
    row0 = parse_stage(["F0", "F1", "F2", "B1", "B0", "W1", "B2", "W0", "W2"])
    row1 = parse_stage(["F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "W2"])
    warm = [row0, row1]
    validate_schedule(warm, S, N)
    fifo = fifo_relabel(warm)
    assert replay(fifo, costs, N).iteration_ms <= replay(warm, costs, N).iteration_ms
    for row in fifo:
        for k in "FBW":
            assert [op.mb for op in row if op.kind == k] == list(range(N))
    res = solve(costs, N, warm_start=warm)
    assert res.optimal
    assert res.iteration_ms <= replay(warm, costs, N).iteration_ms


@pytest.mark.timeout(120)
def test_missing_highspy_says_how_to_install(monkeypatch):
    from ds_pipemorph.plan.sched.milp import solve_exact

    monkeypatch.setitem(sys.modules, "highspy", None)
    with pytest.raises(ImportError, match=r"pip install ds_pipemorph\[milp\]"):
        solve_exact(Costs.uniform(2), 2)


@pytest.mark.timeout(120)
def test_rejects_bad_caps():
    pytest.importorskip("highspy", reason="highspy not installed (pip install ds_pipemorph[milp])")
    from ds_pipemorph.plan.sched.milp import solve_exact

    with pytest.raises(ValueError, match="stage 1: cap 0"):
        solve_exact(Costs.uniform(2), 2, caps=[1, 0])
    with pytest.raises(ValueError, match="expected 2"):
        solve_exact(Costs.uniform(2), 2, caps=[1])


@needs_highs
@pytest.mark.timeout(60)
def test_the_solver_prints_nothing_on_standard_output(tmp_path):
    """HiGHS's banner would break ``pipemorph plan --json``: it goes to standard error."""
    import subprocess

    code = ("from ds_pipemorph.plan.sched.milp import solve_exact\n"
            "from ds_pipemorph.plan.ir.profile import Costs\n"
            "solve_exact(Costs.uniform(2), 2, time_limit_s=5)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == ""
