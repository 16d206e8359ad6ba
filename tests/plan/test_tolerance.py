"""Replayed link tolerance against the exact value from an independent longest-path computation."""
import random

import pytest

from crossing_paths import exact_tolerance
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sim.listsched_py import Policy
from ds_pipemorph.plan.sched.tolerance import link_tolerances
from ds_pipemorph.plan.sched.warmup import initial_warmup


def _case(seed):
    rng = random.Random(seed)
    S, N = rng.choice([(2, 4), (3, 6), (4, 8), (5, 10)])
    draw = lambda: [round(rng.uniform(2, 20), 1) for _ in range(S)]  # noqa: E731
    costs = Costs(draw(), draw(), draw(), [round(rng.choice([0, 0, rng.uniform(1, 30)]), 1) for _ in range(S - 1)])
    caps = [rng.randint(1, N) for _ in range(S)]
    policy = rng.choice([Policy("BFW"), Policy("BWF"), Policy("FBW")])
    return costs, N, list_schedule(costs, N, initial_warmup(caps), policy=policy)


@pytest.mark.parametrize("seed", range(40))
def test_replay_tolerance_is_the_exact_one_within_resolution(seed):
    costs, n, sched = _case(seed)
    for t in link_tolerances(sched, costs, n, resolution_ms=0.01):
        want = exact_tolerance(sched, costs, t.link)
        if want == float("inf"):
            assert t.replay_ms == float("inf")
        else:
            # Never above the exact value (a plan must not claim to absorb what it does not), and
            # at most one resolution step below it.
            assert float(want) - 0.01 - 1e-9 <= t.replay_ms <= float(want) + 1e-6
