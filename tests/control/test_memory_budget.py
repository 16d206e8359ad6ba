"""One ``MemoryBudget`` object read by the policies when they plan: a grant that replaces its limits
after the policies were built (``memory.budget_mb``, known once the first iteration measured) bounds
every plan they make from then on, and the search beside training gets the limits in force when it
was handed over."""
import pickle

from ds_pipemorph.control.policy import ControlPolicy, QueueSettings
from ds_pipemorph.control.rebalance import Rebalancer
from ds_pipemorph.plan.ir.memory import MemoryBudget, peak_units, units_of_bytes
from ds_pipemorph.plan.ir.ops import warmup_counts
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.warmup import initial_warmup

S, N = 4, 8
STOCK = MemoryBudget((4, 3, 2, 1), (4.0, 3.0, 2.0, 1.0))
GRANT = MemoryBudget((2, 2, 2, 2), (2.5, 2.5, 2.5, 2.5), (1.0, 1.0, 1.0, 1.0))
SLOW = Costs.uniform(S, 10.0, [0.0, 0.0, 30.0])  # link 2 slow: a new plan is due


def test_bytes_become_units_of_each_stage_s_own_micro_batch():
    assert units_of_bytes([1000, 1000, 300], [400, 250, 0], most=8.0) == [2.5, 4.0, 8.0]  # nothing saved: no bound
    assert units_of_bytes([10_000], [100], most=8.0) == [8.0]


def test_a_grant_after_construction_bounds_the_policy_s_plans_and_travels_with_a_search():
    budget = MemoryBudget(STOCK.caps, STOCK.units)
    plan = list_schedule(Costs.uniform(S, 10.0), N, initial_warmup(list(STOCK.caps)))
    policy = ControlPolicy(plan, Costs.uniform(S, 10.0), N, every=1, delegation="off",
                           queues=QueueSettings(2, 8), budget=budget)
    before = policy.react(SLOW).plan
    assert max(warmup_counts(before)) > 2  # the stock budget lets stage 0 warm up deeper than the grant
    budget.grant(GRANT)  # the engine's object, changed in place
    assert policy.caps == [2, 2, 2, 2] and policy.units == GRANT.units
    for plan in (policy.react(SLOW).plan, policy.propose(SLOW).plan):
        assert all(u <= 2.5 for u in peak_units(plan, 1.0)), peak_units(plan, 1.0)
    policy.rebase(policy.react(SLOW).plan)  # as the engine puts the plan made within the grant in force
    shipped = pickle.loads(pickle.dumps(policy))  # as the background search receives it
    assert shipped.units == GRANT.units
    refined = shipped.refine(SLOW)  # the search's plan if faster, else the plan in force is kept
    assert all(u <= 2.5 for u in peak_units(refined.plan or shipped.plan_in_force, 1.0))


def test_a_rebalancer_takes_new_caps_into_the_profile_it_learned():
    rb = Rebalancer(S, 12, [0, 4, 8, 12, 16], caps=[4, 3, 2, 1], warmup=1, patience=1)
    for _ in range(2):  # the first is start-up work; the second teaches the layer costs, with the caps in force
        rb.observe([[10.0, 10.0, 10.0]] * S)
    assert rb.profile.memory.max_inflight == [4, 3, 2, 1]
    rb.set_caps([2, 2, 2, 2])
    assert rb.caps == [2, 2, 2, 2] and rb.profile.memory.max_inflight == [2, 2, 2, 2]
