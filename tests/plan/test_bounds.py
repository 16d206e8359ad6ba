"""The lower bound (plan/sched/bounds.py): never above a proven optimum, at least the old bound, exact where
the optimum is known, and tight where the old one was loose (PipeMorph at scale, heterogeneous)."""
from __future__ import annotations

import random

import pytest

from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.bounds import lower_bound_ms
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import ramp_warmup
from ds_pipemorph.plan.sim.simulate import makespan


def old_bound(costs: Costs, N: int, caps=None) -> float:
    """Bounds (1)-(3) as they were before (4) and (5) and the g_s ramp in (3)."""
    S = costs.stages
    f, b, w, c = costs.f, costs.b, costs.w, costs.links
    caps = caps or [N] * S
    a = [0.0] * S
    for s in range(1, S):
        a[s] = a[s - 1] + f[s - 1] + c[s - 1]
    r = [0.0] * S
    r[S - 1] = a[S - 1] + f[S - 1]
    for s in range(S - 2, -1, -1):
        r[s] = r[s + 1] + b[s + 1] + c[s]
    best = 0.0
    for s in range(S):
        k = min(caps[s], N)
        q = sum(c[j] for j in range(s, S - 1)) * 2 + sum(f[j] + b[j] for j in range(s + 1, S))
        tail, acc = w[s], 0.0
        for j in range(s - 1, -1, -1):
            acc += c[j] + b[j]
            tail = max(tail, acc + w[j])
        start_last = a[s] + (N - 1) * f[s]
        if N > k:
            start_last = max(start_last, r[s] + (N - k) * b[s] + (N - k - 1) * f[s])
        best = max(best, a[s] + N * (f[s] + b[s] + w[s]), r[s] + N * (b[s] + w[s]) + max(0, N - k) * f[s],
                   start_last + f[s] + q + b[s] + tail)
    return best


def _case(rng: random.Random):
    S, N = rng.randint(2, 4), rng.randint(2, 6)
    draw = lambda: [round(rng.uniform(2.0, 20.0), 1) for _ in range(S)]  # noqa: E731
    links = [round(rng.choice([0.0, 0.0, rng.uniform(0.0, 30.0)]), 1) for _ in range(S - 1)]
    caps = [rng.randint(min(S - s, N), N) for s in range(S)]
    return Costs(draw(), draw(), draw(), links), N, caps


@pytest.mark.parametrize("seed", range(4))
def test_never_above_the_milp_optimum_and_never_below_the_old_bound(seed):
    pytest.importorskip("highspy", reason="highspy not installed (pip install ds_pipemorph[milp])")
    from ds_pipemorph.plan.sched.milp import solve_exact

    rng = random.Random(seed)
    for _ in range(5):
        costs, N, caps = _case(rng)
        lb = lower_bound_ms(costs, N, caps=caps)
        assert lb >= old_bound(costs, N, caps) - 1e-9
        res = solve_exact(costs, N, caps=caps, time_limit_s=30.0)
        assert res.optimal
        assert lb <= res.iteration_ms + 1e-6, (costs, N, caps, lb, res.iteration_ms)


@pytest.mark.parametrize("S,N", [(2, 4), (4, 8), (8, 32), (32, 256)])
def test_uniform_is_the_known_optimum(S, N):
    assert lower_bound_ms(Costs.uniform(S, 10.0), N) == pytest.approx(3 * N * 10.0 + (S - 1) * 10.0)


def test_slow_forwards_upstream_are_counted():
    """Stage 1 is the bottleneck but gets its forwards at stage 0's slower pace until its first
    gradient arrives: the old bound missed that idle time, the ramp-matched warm-up reaches the new."""
    costs = Costs([12.0, 8.0, 5.0], [5.0, 14.0, 5.0], [5.0, 14.0, 5.0], [0.0, 20.0])
    N = 16
    lb, old = lower_bound_ms(costs, N), old_bound(costs, N)
    assert lb > old + 1.0
    got = makespan(list_schedule(costs, N, ramp_warmup(costs, N, [N] * 3)), costs, N)
    assert lb <= got + 1e-9
