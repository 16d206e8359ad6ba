"""Readiness-driven dispatch (``dispatch: "ready"``) trains exactly like stock DeepSpeed.

Each launch trains stock DeepSpeed and our engine with ready dispatch on the same seed and data
(3 optimizer steps of Adam with gradient clipping, as in test_equivalence): `zb`, `adaptive` and
`1f1b` hints, a tied layer, 2 pipelines x 2 data-parallel replicas, random valid plans as hints and
a slow link. Losses and every parameter must agree within 1e-5; every rank runs each F, B and W
once, in an order that respects the dependencies, never holding more activations than its plan.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from ds_pipemorph.plan.files.planfile import PlanFile
from ds_pipemorph.plan.ir.ops import parse_stage, peak_inflight
from ds_pipemorph.plan.ir.profile import Profile
from ds_pipemorph.plan.sim.validate import validate_schedule
from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.runtime.plans import build_plan

from .launch import launch_shared, max_param_diff
from .plans_io import write_plan
from .randplans import random_plan

TOL = 1e-5


def _section(schedule: str, **more) -> dict:
    return {"schedule": schedule, "dispatch": "ready", "delegation": {"mode": "off"}, "adapt": {"enabled": False}, **more}


def _assert_ready_run_equals_stock(run, name: str, stock: str, ranks: int, plan_peak: list[int]) -> None:
    for r in range(ranks):
        ours, ref = run.result(name, r), run.result(stock, r)
        assert len(ours["choosing_ns"]) == len(ours["losses"]) == 3, f"{name} rank {r}: not dispatched by readiness"
        for ops in ours["ops"]:
            ran = [op for op in ops if op[0] in "FBW" and op[1:].isdigit()]
            n = len(ran) // 3
            assert sorted(ran) == sorted(f"{k}{m}" for k in "FBW" for m in range(n)), f"{name} rank {r}: ops {ran}"
            for m in range(n):  # each micro-batch's F before its B before its W
                assert ran.index(f"F{m}") < ran.index(f"B{m}") < ran.index(f"W{m}"), f"{name} rank {r}: {ran}"
        assert ours["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} rank {r}: losses differ"
        assert max_param_diff(ours, ref) <= TOL, f"{name} rank {r}: parameters differ"
        assert all(1 <= p <= plan_peak[ours["stage"]] for p in ours["peak"]), \
            f"{name} rank {r}: held {ours['peak']} activations, the plan at most {plan_peak[ours['stage']]}"


def _jobs(stages: int, dp: int, n: int, schedules, tied=False):
    suffix = f"s{stages}_dp{dp}_n{n}{'_tied' if tied else ''}"
    stock = f"stock_{suffix}"
    jobs = [{"name": stock, "stages": stages, "dp": dp, "micro_batches": n, "tied": tied, "pipemorph": None}]
    checks = []
    for sched in schedules:
        section = _section(sched)
        name = f"ready_{sched}_{suffix}"
        jobs.append({"name": name, "stages": stages, "dp": dp, "micro_batches": n, "tied": tied, "pipemorph": section})
        checks.append((name, stock, peak_inflight(build_plan(parse_config(section), stages, n))))
    return jobs, checks


def _four_stage_jobs(out_dir):
    """The jobs of the 4-stage test below (its random plans written to ``out_dir``) and its checks."""
    jobs, checks = _jobs(4, 1, 8, ("zb", "adaptive"))
    tied_jobs, tied_checks = _jobs(4, 1, 4, ("zb",), tied=True)
    jobs += tied_jobs
    checks += tied_checks
    rng = random.Random(5)
    for i in range(2):  # any valid plan is a hint ready dispatch runs to the end
        plan, caps = random_plan(4, 8, rng)
        validate_schedule(plan, 4, 8, caps=caps)
        path = write_plan(out_dir / f"random{i}.yaml", plan, 8)
        name = f"ready_random{i}_s4_n8"
        jobs.append({"name": name, "stages": 4, "micro_batches": 8,
                     "pipemorph": _section("plan", plan_file=path)})
        checks.append((name, "stock_s4_dp1_n8", peak_inflight(plan)))
    section = _section("zb", inject={"links": {"1": {"delay_ms": 15}}})  # timing changes, results do not
    jobs.append({"name": "ready_zb_slow_s4_n8", "stages": 4, "micro_batches": 8, "pipemorph": section})
    checks.append(("ready_zb_slow_s4_n8", "stock_s4_dp1_n8", peak_inflight(build_plan(parse_config(section), 4, 8))))
    return jobs, checks


# Stage 1's hint starts with F1, but stage 0 sends F0 first over a link that holds each message
# 30 ms (one in flight): F0 is in 30 ms before F1, so ready dispatch runs F0 and B0 first; W0
# waits for W1, the W before it in the hint (Ws accumulate in the hint's order), so F1 and B1 come
# between.
HINT = [parse_stage("F0 F1 B0 W0 B1 W1".split()), parse_stage("F1 B1 W1 F0 B0 W0".split())]


def _timeline_jobs(out_dir):
    """The jobs of the timeline test below: its hint and timeline files in ``out_dir``."""
    profile = Profile(stages=2, microbatches=2, compute_ms={"forward": 1.0, "backward_input": 1.0,
                                                             "backward_weight": 1.0})
    plan_path = out_dir / "hint.yaml"
    plan_path.write_text(json.dumps(PlanFile.build(HINT, profile).model_dump(mode="json")))
    section = _section("plan", plan_file=str(plan_path), inject={"links": {"0": {"delay_ms": 30}}},
                       timeline=str(out_dir / "timeline.json"))
    return [{"name": "stock", "stages": 2, "micro_batches": 2, "pipemorph": None},
            {"name": "departs", "stages": 2, "micro_batches": 2, "pipemorph": section}]


# The tests' jobs in two launches, by rank count (one start of the ranks and DeepSpeed each); each
# test's in its own order. A launch's ceiling is the sum of its tests' as launches of their own.
TIMEOUT_2, TIMEOUT_4 = 440, 600


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ready2")
    return out, launch_shared(2, {"two_stages": _jobs(2, 1, 8, ("zb", "adaptive", "1f1b"))[0],
                                  "timeline": _timeline_jobs(out)}, out, timeout=TIMEOUT_2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ready4")
    return launch_shared(4, {"four_stages": _four_stage_jobs(out)[0], "replicas": _jobs(2, 2, 4, ("zb", "adaptive"))[0]},
                         out, timeout=TIMEOUT_4)


@pytest.mark.timeout(TIMEOUT_2 + 60)  # the first test to ask for a launch waits for all of it
def test_two_stages_ready_dispatch_of_zb_adaptive_and_1f1b_hints_equals_stock(two_ranks):
    run = two_ranks[1]["two_stages"]
    for name, stock, peak in _jobs(2, 1, 8, ("zb", "adaptive", "1f1b"))[1]:
        _assert_ready_run_equals_stock(run, name, stock, 2, peak)


@pytest.mark.timeout(TIMEOUT_4 + 60)
def test_four_stages_ready_dispatch_with_a_tied_layer_random_hints_and_a_slow_link_equals_stock(four_ranks, tmp_path):
    run = four_ranks["four_stages"]
    for name, stock, peak in _four_stage_jobs(tmp_path)[1]:  # the same random plans, from the same seed
        _assert_ready_run_equals_stock(run, name, stock, 4, peak)


@pytest.mark.timeout(TIMEOUT_4 + 60)
def test_two_pipelines_by_two_data_parallel_ready_dispatch_equals_stock(four_ranks):
    run = four_ranks["replicas"]
    for name, stock, peak in _jobs(2, 2, 4, ("zb", "adaptive"))[1]:
        _assert_ready_run_equals_stock(run, name, stock, 4, peak)


@pytest.mark.timeout(TIMEOUT_2 + 60)
def test_the_timeline_shows_the_order_run_and_trace_compare_names_where_it_left_the_hint(two_ranks):
    out, runs = two_ranks
    hint, plan_path, timeline = HINT, out / "hint.yaml", out / "timeline.json"
    run = runs["timeline"]
    _assert_ready_run_equals_stock(run, "departs", "stock", 2, peak_inflight(hint))
    ran = [op for op in run.result("departs", 1)["ops"][-1] if op[0] in "FBW" and op[1:].isdigit()]
    assert ran == ["F0", "B0", "F1", "B1", "W1", "W0"], ran
    p = subprocess.run([sys.executable, "-m", "ds_pipemorph_cli.app", "trace", "compare", str(plan_path),
                        str(timeline), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"rank": 1, "stage": 1, "index": 0, "planned": "F1", "measured": "F0"} in out["divergences"], out["divergences"]
    assert all(d["rank"] == 1 for d in out["divergences"])  # stage 0 ran its hint as written
