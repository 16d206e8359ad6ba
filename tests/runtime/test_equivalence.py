"""PipeMorphEngine trains exactly like stock DeepSpeed (TrainSchedule) under every plan it runs.

Each launch trains several jobs on the same seed and data: stock DeepSpeed and our engine with
`zb`, `adaptive`, `1f1b`, plan files and random valid plans, on a Linear/GELU stack (with and
without a tied layer) and on the tiny_gpt recipe's model, 3 optimizer steps of Adam with
gradient clipping. Losses and every parameter must agree within 1e-5, and the peak of in-flight
activations each stage measured must equal its plan's. Results are judged from the files each
rank writes, not from exit codes (DeepSpeed 0.19.8 on CPU occasionally aborts at process exit).
"""
from __future__ import annotations

import random

import pytest

from ds_pipemorph.plan.ir.fused import fused_at
from ds_pipemorph.plan.ir.ops import peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sim.validate import validate_schedule
from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.runtime.plans import build_plan

from .launch import SHARED_CEILING, launch, launch_shared, max_param_diff, shared_jobs
from .plans_io import write_plan
from .randplans import random_plan

TOL = 1e-5


def _expected_peak(section: dict, stages: int, n: int) -> list[int]:
    return peak_inflight(build_plan(parse_config(section), stages, n))


def _assert_equal_to_stock(run, name: str, stock: str, ranks: int, expected_peak=None, plan=None) -> None:
    for r in range(ranks):
        ours, ref = run.result(name, r), run.result(stock, r)
        ran = [op for op in ours["ops"][-1] if op[0] in "FBW" and op[1:].isdigit()]
        n = len(ran) // 3
        assert sorted(ran) == sorted(f"{k}{m}" for k in "FBW" for m in range(n)), f"{name} rank {r}: ops {ran}"
        if plan is not None:
            assert ran == [str(op) for op in plan[ours["stage"]]], f"{name} rank {r}: did not run its plan's order"
        assert len(ours["losses"]) == 3
        assert ours["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} rank {r}: losses differ"
        if ref.get("eval_loss") is not None:
            assert ours["eval_loss"] == pytest.approx(ref["eval_loss"], abs=TOL), f"{name} rank {r}: eval differs"
        assert max_param_diff(ours, ref) <= TOL, f"{name} rank {r}: parameters differ"
        if expected_peak is not None:
            assert ours["peak"] == [expected_peak[ours["stage"]]] * len(ours["peak"]), \
                f"{name} rank {r}: measured peak in-flight {ours['peak']} != plan's {expected_peak[ours['stage']]}"


def _jobs_for(stages: int, dp: int, ns, schedules, tied=False):
    jobs, checks = [], []
    for n in ns:
        stock = f"stock_s{stages}_n{n}{'_tied' if tied else ''}"
        jobs.append({"name": stock, "stages": stages, "dp": dp, "micro_batches": n, "tied": tied, "pipemorph": None})
        for sched in schedules:
            section = {"schedule": sched, "delegation": {"mode": "off"}, "adapt": {"enabled": False}}
            name = f"{sched}_s{stages}_n{n}{'_tied' if tied else ''}"
            jobs.append({"name": name, "stages": stages, "dp": dp, "micro_batches": n, "tied": tied,
                         "pipemorph": section})
            checks.append((name, stock, _expected_peak(section, stages, n)))
    return jobs, checks


def _plan_file_job(stages: int, n: int, warmup: list[int], tmp_path, stock: str):
    plan = list_schedule(Costs.uniform(stages, 10.0), n, warmup)
    path = write_plan(tmp_path / f"plan_s{stages}_n{n}.yaml", plan, n)
    name = f"planfile_s{stages}_n{n}"
    job = {"name": name, "stages": stages, "micro_batches": n,
           "pipemorph": {"schedule": "plan", "plan_file": path, "delegation": {"mode": "off"}}}
    return job, (name, stock, peak_inflight(plan), plan)


@pytest.mark.timeout(240)
def test_two_stages_zb_adaptive_1f1b_and_plan_file_equal_stock_deepspeed(tmp_path):
    jobs, checks = _jobs_for(2, 1, (1, 2, 8), ("zb", "adaptive"))
    more, more_checks = _jobs_for(2, 1, (8,), ("1f1b",))
    jobs += [j for j in more if j["pipemorph"] is not None]
    checks += more_checks
    job, check = _plan_file_job(2, 8, [2, 1], tmp_path, "stock_s2_n8")
    jobs.append(job)
    checks.append(check)
    # Where a B runs its W in the same pass: the first stage's B m directly followed by W m always under
    # ordered dispatch (it sends no input gradient), every stage's under `backward: fused`.
    passes = {"1f1b_s2_n8": ("1f1b", "ordered", "split"), "1f1b_fused_s2_n8": ("1f1b", "ordered", "fused"),
              "zb_ready_fused_s2_n8": ("zb", "ready", "fused")}
    for name, (sched, dispatch, backward) in passes.items():
        section = {"schedule": sched, "dispatch": dispatch, "backward": backward, "delegation": {"mode": "off"},
                   "adapt": {"enabled": False}}
        if name not in {j["name"] for j in jobs}:
            jobs.append({"name": name, "stages": 2, "micro_batches": 8, "pipemorph": section})
            checks.append((name, "stock_s2_n8", _expected_peak(section, 2, 8)))
        next(j for j in jobs if j["name"] == name)["grad_ops"] = True
    # While `adaptive` re-plans, its control loop measures B and W apart: the first stage too.
    jobs.append({"name": "adaptive_live_s2_n8", "stages": 2, "micro_batches": 8, "grad_ops": True,
                 "pipemorph": {"schedule": "adaptive", "delegation": {"mode": "off"}}})
    checks.append(("adaptive_live_s2_n8", "stock_s2_n8", None))
    for job in jobs:
        job["eval"] = job["micro_batches"] == 8  # evaluation runs DeepSpeed's own schedule afterwards
    # A/B inside the job (pipemorph.compare): zb against 1f1b, alternating; 16 steps against stock's.
    jobs.append({"name": "stock_s2_n8_long", "stages": 2, "micro_batches": 8, "steps": 16, "pipemorph": None})
    # A is stock's schedule and backward (`1f1b`, fused) on this engine.
    jobs.append({"name": "compare_s2_n8", "stages": 2, "micro_batches": 8, "steps": 16, "grad_ops": True, "pipemorph": {
        "schedule": "zb", "delegation": {"mode": "off"}, "adapt": {"enabled": False},
        "compare": {"schedule": "1f1b", "backward": "fused", "warmup": 2, "iterations": 12}}})
    run = launch(2, jobs, tmp_path, timeout=220)
    _assert_compare(run)
    _assert_passes(run, passes)
    for name, stock, peak, *plan in checks:
        _assert_equal_to_stock(run, name, stock, 2, peak, *plan)
        # One replica on gloo: the loss left the last stage at its last forward (runtime.train_loss),
        # and every rank returned stock's loss all the same: bit for bit at the first step, where
        # the parameters are still the same.
        for r in range(2):
            ours, ref = run.result(name, r), run.result(stock, r)
            assert ours["early_loss"], f"{name} rank {r}"
            assert ours["losses"][0] == ref["losses"][0], f"{name} rank {r}: {ours['losses'][0]} != {ref['losses'][0]}"


def _assert_passes(run, passes: dict) -> None:
    """Each parameter's gradient was added in the op the rule names: ``B m`` where B m ran the whole
    backward, ``W m`` where B and W ran apart. The first iteration measures the activation memory,
    B and W apart everywhere; under ready dispatch only the last stage's order is known beforehand."""
    for name, (sched, dispatch, backward) in passes.items():
        plan = build_plan(parse_config({"schedule": sched}), 2, 8)
        for r in range(2):
            ours = run.result(name, r)
            s = ours["stage"]
            row = plan[s]
            whole = {op.mb for i, op in enumerate(row) if fused_at(row, i)} if backward == "fused" or s == 0 else set()
            expected = {f"{'B' if m in whole else 'W'}{m}" for m in range(8)}
            assert set(ours["grad_ops"][0]) == {f"W{m}" for m in range(8)}, f"{name} rank {r}: first iteration"
            if dispatch == "ordered" or s == 1:
                for step in (1, 2):
                    assert set(ours["grad_ops"][step]) == expected, f"{name} rank {r} step {step}"
    # (that some B ran whole, and some ran apart, is in what the rule expects on these plans)
    assert any(op.startswith("B") for op in run.result("1f1b_s2_n8", 0)["grad_ops"][1])
    assert all(op.startswith("W") for op in run.result("1f1b_s2_n8", 1)["grad_ops"][1])
    for r in range(2):
        for step in (1, 2):
            assert {op[0] for op in run.result("adaptive_live_s2_n8", r)["grad_ops"][step]} == {"W"}, f"rank {r}"
    assert "dispatch 'ordered', backward 'fused' (a B directly followed by its W runs as one pass)" in run.output


def _assert_compare(run) -> None:
    """Each iteration ran its side's order, training equals stock's, and the result has its pairs."""
    from ds_pipemorph.paired import sequence
    from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b

    zb = build_plan(parse_config({"schedule": "zb"}), 2, 8)
    orders = {"A": deepspeed_1f1b(2, 8), "A'": deepspeed_1f1b(2, 8), "B": zb}
    sides = sequence(14, 2) + ["B", "B"]  # then B only
    for r in range(2):
        ours, ref = run.result("compare_s2_n8", r), run.result("stock_s2_n8_long", r)
        assert ours["comparison"]["sides"] == sides[:14], f"rank {r}"
        for step, side in enumerate(sides):
            ran = [op for op in ours["ops"][step] if op[0] in "FBW" and op[1:].isdigit()]
            assert ran == [str(op) for op in orders[side][ours["stage"]]], f"rank {r} step {step} ({side})"
            # A's backward is one pass on both stages; B's (`zb` under the default budget runs each W
            # right after its B here) on the first stage only, the last one sends its gradient first
            if step:
                whole = side != "B" or ours["stage"] == 0
                assert {op[0] for op in ours["grad_ops"][step]} == {"B" if whole else "W"}, f"rank {r} step {step}"
        assert ours["losses"] == pytest.approx(ref["losses"], abs=TOL), f"rank {r}: losses differ"
        assert max_param_diff(ours, ref) <= TOL, f"rank {r}: parameters differ"
        result = ours["comparison"]["result"]
        assert result["ratio"]["pairs"] == 6 and result["noise"]["pairs"] == 3  # 3 cycles A B A' B
    assert "pipemorph compare: B = zb/ordered, A = 1f1b/ordered/fused, 12 measured iterations: " in run.output


def _four_stage_jobs(out_dir):
    """The jobs of the 4-stage test below (its plan files written to ``out_dir``) and its checks."""
    jobs, checks = _jobs_for(4, 1, (1, 2, 8), ("zb", "adaptive"))
    tied_jobs, tied_checks = _jobs_for(4, 1, (4,), ("zb",), tied=True)
    jobs += tied_jobs
    checks += tied_checks
    job, check = _plan_file_job(4, 8, [6, 4, 2, 1], out_dir, "stock_s4_n8")
    jobs.append(job)
    checks.append(check)
    for dyn in ("", "_dynamic"):  # the recipe's GPT, with fixed and with varying sequence lengths
        for name, section in ((f"stock_gpt{dyn}", None), (f"zb_gpt{dyn}", {"schedule": "zb", "delegation": {"mode": "off"}})):
            jobs.append({"name": name, "stages": 4, "micro_batches": 4, "model": "gpt", "dynamic": bool(dyn),
                         "pipemorph": section})
        checks.append((f"zb_gpt{dyn}", f"stock_gpt{dyn}", _expected_peak({"schedule": "zb"}, 4, 4)))
    rng = random.Random(7)
    for i in range(3):
        plan, caps = random_plan(4, 8, rng)
        validate_schedule(plan, 4, 8, caps=caps)
        path = write_plan(out_dir / f"random{i}.yaml", plan, 8)
        name = f"random{i}_s4_n8"
        jobs.append({"name": name, "stages": 4, "micro_batches": 8,
                     "pipemorph": {"schedule": "plan", "plan_file": path, "delegation": {"mode": "off"}}})
        checks.append((name, "stock_s4_n8", peak_inflight(plan), plan))
    return jobs, checks


def _replica_jobs():
    """The jobs of the 2 x 2 test below and its checks."""
    jobs, checks = _jobs_for(2, 2, (4,), ("zb", "adaptive"))
    # Every link delegated: the same link of the two replicas has delegates of its own on each.
    section = {"schedule": "zb", "delegation": {"mode": "always"}, "adapt": {"enabled": False}}
    jobs.append({"name": "zb_delegated_s2_n4", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": section})
    checks.append(("zb_delegated_s2_n4", "stock_s2_n4", _expected_peak(section, 2, 4)))
    return jobs, checks


# The 4-rank tests' jobs in one launch (one start of the ranks and DeepSpeed), each test's in its own
# order; its ceiling is the sum of theirs as launches of their own (380 and 180 s).
SHARED_TIMEOUT = 560


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence4")
    return launch_shared(4, {"four_stages": _four_stage_jobs(out)[0], "replicas": _replica_jobs()[0]}, out,
                         timeout=SHARED_TIMEOUT)


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first test to ask for the launch waits for all of it
def test_four_stages_zb_adaptive_plan_file_tied_gpt_and_random_plans_equal_stock_deepspeed(four_ranks, tmp_path):
    run = four_ranks["four_stages"]
    for name, stock, peak, *plan in _four_stage_jobs(tmp_path)[1]:  # the same random plans, from the same seed
        _assert_equal_to_stock(run, name, stock, 4, peak, *plan)


def _three_stage_jobs(folder):
    """The jobs of the test below (its plan files written to ``folder``) and its checks."""
    jobs = [{"name": "stock_s3_n6", "stages": 3, "micro_batches": 6, "pipemorph": None}]
    checks = []
    rng = random.Random(11)
    for i in range(4):
        plan, caps = random_plan(3, 6, rng)
        validate_schedule(plan, 3, 6, caps=caps)
        path = write_plan(folder / f"random{i}.yaml", plan, 6)
        name = f"random{i}_s3_n6"
        jobs.append({"name": name, "stages": 3, "micro_batches": 6,
                     "pipemorph": {"schedule": "plan", "plan_file": path, "delegation": {"mode": "off"}}})
        checks.append((name, peak_inflight(plan), plan))
    # A slow link changes timing, never results: the zb plan under 15 ms injected on link 1, direct,
    # and with every link delegated (staging rings + delegate processes, the delay in the delegates).
    for mode in ("off", "always"):
        section = {"schedule": "zb", "delegation": {"mode": mode}, "inject": {"links": {"1": {"delay_ms": 15}}}}
        jobs.append({"name": f"zb_injected_{mode}_s3_n6", "stages": 3, "micro_batches": 6, "pipemorph": section})
        checks.append((f"zb_injected_{mode}_s3_n6", _expected_peak(section, 3, 6), None))
    return jobs, checks


@shared_jobs("equivalence", timeout=180, ranks=3)  # run in the session's shared 3-rank launch
def _shared_three_stage_jobs(folder) -> list[dict]:
    return _three_stage_jobs(folder)[0]


@pytest.mark.timeout(SHARED_CEILING + 60)  # the first test to ask for the shared launch waits for all of it
def test_random_valid_plans_on_three_stages_run_without_deadlock_and_equal_stock(shared3, tmp_path):
    run = shared3["equivalence"]
    for name, peak, plan in _three_stage_jobs(tmp_path)[1]:  # the same random plans, from the same seed
        _assert_equal_to_stock(run, name, "stock_s3_n6", 3, peak, plan)


@pytest.mark.timeout(SHARED_TIMEOUT + 60)
def test_two_pipeline_by_two_data_parallel_zb_equals_stock(four_ranks):
    run = four_ranks["replicas"]
    for name, stock, peak, *plan in _replica_jobs()[1]:
        _assert_equal_to_stock(run, name, stock, 4, peak, *plan)
        # Two replicas: stock's own loss reduction (the mean over replicas, then the broadcast).
        assert not any(run.result(name, r)["early_loss"] for r in range(4)), name
