"""A re-plan off the critical path: the first reaction is Alg. 2's closed-form warm-up, the search
refines it in a worker process and answers exactly what the same search gives in this process."""
import math
import time

import pytest

from ds_pipemorph.control.background import BackgroundPlanner
from ds_pipemorph.control.detector import DetectorConfig
from ds_pipemorph.control.policy import ControlPolicy
from ds_pipemorph.plan.ir.links import DIRECT
from ds_pipemorph.plan.ir.ops import warmup_counts
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import search
from ds_pipemorph.plan.sched.warmup import initial_warmup
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.plan.sim.validate import validate_schedule

S, N = 4, 12
SLOW = Costs.uniform(S, 10.0, [0.0, 0.0, 40.0])  # link 2 at 40 ms


def fresh(evals: int = 2000) -> ControlPolicy:
    return ControlPolicy(list_schedule(Costs.uniform(S, 10.0), N, initial_warmup([N] * S)), Costs.uniform(S, 10.0), N,
                  None, 1, "off", DetectorConfig(), search_evals=evals)


def wait(planner: BackgroundPlanner, timeout_s: float = 60.0) -> tuple:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        answer = planner.poll()
        if answer is not None:
            return answer
        time.sleep(0.01)
    raise AssertionError("the re-plan worker did not answer")


def test_the_first_reaction_is_alg2_closed_form_warm_up():
    d = fresh().react(SLOW)
    # Eq. 1 per link from the last stage: Δ_i = max(2, ⌈(F_i + B_i + 2 c_i) / (F_i+1 + B_i+1)⌉)
    deltas = [max(2, math.ceil((10 + 10 + 2 * c) / 20)) for c in SLOW.links]
    assert deltas == [2, 2, 5]
    x = [1]
    for dlt in reversed(deltas):
        x.insert(0, x[0] + dlt)
    assert x == [10, 8, 6, 1]
    assert d.plan is not None and warmup_counts(d.plan) == x
    validate_schedule(d.plan, S, N)
    assert d.predicted_ms == replay(d.plan, SLOW, N, link_model=DIRECT).iteration_ms
    assert d.reason.startswith("closed-form warm-up: slow links [] -> [2]")


def test_refine_gives_the_search_plan_when_faster_and_keeps_a_plan_it_cannot_beat():
    p = fresh()
    quick = p.react(SLOW)
    p.adopt(quick)
    found = search(SLOW, N, caps=None, budget_s=600.0, seed=0, exact=False, max_evals=2000, link_model=DIRECT).schedule
    t_found = replay(found, SLOW, N, link_model=DIRECT).iteration_ms
    assert t_found < quick.predicted_ms  # here the search beats Alg. 2's warm-up ...
    refined = p.refine(SLOW)
    assert refined.plan == found and refined.predicted_ms == t_found  # ... so its plan is taken
    p.adopt(refined)
    again = p.refine(SLOW)  # the same search cannot beat its own plan: the plan in force is kept
    assert again.plan is None and again.predicted_ms == t_found
    assert again.reason.startswith("kept")


@pytest.mark.timeout(120)
def test_the_worker_answers_what_the_search_gives_here():
    p = fresh()
    p.adopt(p.react(SLOW))
    planner = BackgroundPlanner()
    try:
        planner.submit(p, SLOW)
        assert planner.busy
        status, decision, seconds = wait(planner)
        assert status == "ok" and seconds >= 0
        here = p.refine(SLOW)
        assert decision.plan == here.plan and decision.predicted_ms == here.predicted_ms
        assert decision.tolerance_ms == here.tolerance_ms and decision.queues == here.queues
        assert not planner.busy
        planner.submit(p, SLOW)  # the same worker takes the next job
        assert wait(planner)[1].plan == here.plan
    finally:
        planner.close()


@pytest.mark.timeout(120)
def test_a_failing_job_and_a_dead_worker_answer_with_an_error():
    planner = BackgroundPlanner()
    try:
        planner.submit(fresh(), None)  # refine(None) fails inside the worker
        status, why = wait(planner)
        assert status == "error" and "re-plan search failed" in why
        big = Costs.uniform(8, 10.0, [0, 0, 0, 30.0, 0, 0, 0])
        p = ControlPolicy(list_schedule(Costs.uniform(8, 10.0), 64, initial_warmup([64] * 8)), Costs.uniform(8, 10.0),
                   64, None, 1, "off", DetectorConfig(), search_evals=10**7)
        planner.submit(p, big)  # runs for a long time: the worker is killed under it
        planner._proc.kill()
        status, why = wait(planner)
        assert status == "error" and "exited with code" in why
        planner.submit(fresh(), SLOW)  # a new worker starts for the next job
        assert wait(planner)[0] == "ok"
    finally:
        planner.close()
