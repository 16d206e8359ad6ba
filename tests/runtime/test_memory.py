"""Memory-safe by default: no schedule, dispatch or re-plan holds more activation memory than stock
DeepSpeed 1F1B on the same job, unless the user grants it (``memory.budget``), and then no more
than granted.

One launch, 4 stages x 8 micro-batches, 4 steps: stock DeepSpeed, then the engine with every
built-in schedule under both dispatches with the default section, ``adaptive`` re-planning for a
slow link (20 ms injected on link 0, delegation "auto"), ``zb`` with ``budget`` 2 and with no budget. From the second
step on, the worker counts what autograd holds saved for the backward (``SavedPeak`` in worker.py:
the test's own count, each storage once, parameters left out) and keeps each step's peak. The
engine's own measurement of its first iteration (F's bytes per micro-batch) must predict stock's
peak, (S - s) of them, give or take what one backward holds while it runs.

A second launch grants ``memory.budget_mb`` (bytes, in force from the second step): stock, ``zb`` and
``adaptive`` under both dispatches, ``adaptive`` re-planning for the slow link, and a grant below one
micro-batch that every rank refuses after the first step.
"""
from __future__ import annotations

import pytest

from .launch import launch

S, N, STEPS = 4, 8, 4


def _job(name: str, pipemorph, **more) -> dict:
    return {"name": name, "stages": S, "micro_batches": N, "steps": STEPS, "meter": True, "pipemorph": pipemorph,
            "gradient_clipping": 0, **more}


def _section(schedule: str, dispatch: str = "ordered", **more) -> dict:
    return {"schedule": schedule, "dispatch": dispatch, "delegation": {"mode": "off"}, **more}


JOBS = [_job("stock", None)]
for _sched in ("1f1b", "zb", "adaptive"):
    for _dispatch in ("ordered", "ready"):
        JOBS.append(_job(f"{_sched}_{_dispatch}", _section(_sched, _dispatch, adapt={"enabled": False})))
JOBS += [
    # as the demo runs it: the slow link may go to the delegates (delegation "auto")
    _job("adaptive_replans", _section("adaptive", inject={"links": {"0": {"delay_ms": 20}}}, delegation={"mode": "auto"})),
    _job("zb_budget2", _section("zb", memory={"budget": 2.0})),
    _job("zb_unlimited", _section("zb", memory={"budget": None})),
    # a grant deep enough that the send window, bounding both directions, would deadlock its plan
    _job("adaptive_budget3_n12", _section("adaptive", memory={"budget": 3.0}, adapt={"enabled": False}),
         micro_batches=12),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch(S, JOBS, tmp_path_factory.mktemp("memory"), timeout=1500)


def _peaks(run, name: str) -> dict[int, int]:
    """Stage -> the most saved bytes at once over the metered steps."""
    out = {}
    for r in range(S):
        res = run.result(name, r)
        assert len(res["saved_peaks"]) == STEPS - 1, name
        out[res["stage"]] = max(res["saved_peaks"])
    return out


@pytest.mark.timeout(1800)
def test_stock_1f1b_holds_s_minus_s_micro_batches_as_the_engine_measured_them(run):
    stock = _peaks(run, "stock")
    for name in ("zb_ordered", "adaptive_ready"):
        measured = {a["stage"]: a for a in run.result(name, 0)["activation_bytes"]}
        assert sorted(measured) == list(range(S))
        for s in range(S):
            assert measured[s]["f"] > 0 and measured[s]["stock"] == (S - s) * measured[s]["f"]
            # (S - s) x F's bytes, plus what a backward holds while it runs (at most one more micro-batch's)
            assert measured[s]["stock"] <= stock[s] <= measured[s]["stock"] + measured[s]["f"], (name, s, measured[s], stock[s])
            # the generic split: W frees what F saved and B did not free (graph parts W does not
            # need go with B's outputs): at most what F saved, the share plans count with (1)
            assert 0 < measured[s]["w"] <= measured[s]["f"] and measured[s]["grads"] > 0


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", [j["name"] for j in JOBS[1:8]])
def test_with_the_default_section_no_stage_holds_more_than_stock(run, name):
    stock, ours = _peaks(run, "stock"), _peaks(run, name)
    assert all(ours[s] <= stock[s] for s in range(S)), (name, ours, stock)
    if name == "adaptive_replans":
        assert run.result(name, 0)["replans"], "the slow link was not re-planned for"


@pytest.mark.timeout(1800)
def test_a_budget_is_kept_and_without_one_zb_holds_more_than_stock(run):
    stock, granted, unlimited = _peaks(run, "stock"), _peaks(run, "zb_budget2"), _peaks(run, "zb_unlimited")
    assert all(granted[s] <= 2 * stock[s] for s in range(S)), (granted, stock)
    assert any(granted[s] > stock[s] for s in range(S)), (granted, stock)  # the grant is used
    assert any(unlimited[s] > 2 * stock[s] for s in range(S)), (unlimited, stock)  # what the default prevents


@pytest.mark.timeout(1800)
def test_a_plan_the_send_window_would_deadlock_in_both_directions_trains_within_its_grant(run):
    from ds_pipemorph.plan.ir.lower import Dispatch, window_deadlock
    from ds_pipemorph.runtime.config import parse_config
    from ds_pipemorph.runtime.plans import build_plan, lowering_for, sent_in_order

    cfg = parse_config(_section("adaptive", memory={"budget": 3.0}, adapt={"enabled": False}))
    plan = build_plan(cfg, S, 12)
    streams = lowering_for(cfg).for_dispatch(Dispatch.ORDERED).lower(plan)
    both = [sent_in_order(plan, s) for s in range(S)]
    assert window_deadlock(streams, both, cfg.send_window_in_force), "the case no longer needs the guard"
    stock, ours = _peaks(run, "stock"), _peaks(run, "adaptive_budget3_n12")  # every step ran (a hang: a timeout)
    assert all(ours[s] <= 3 * stock[s] for s in range(S)), (ours, stock)


# -- memory.budget_mb: a grant in bytes, converted once the first iteration has measured ---------------
#
# Per micro-batch of 2 x 16 fp32 (128 B per tensor), a stage of this model (Linear, GELU, Linear, GELU)
# saves for its backward the input of each Linear and of each GELU: 4 x 128 = 512 B; the last stage's
# MSE loss also saves its input and its target: 768 B. The grant below is 2.5 micro-batches' worth on
# every stage: less than stock 1F1B's 4 on stage 0, more than its 1 on stage 3.
F_BYTES = [512, 512, 512, 768]
GRANT_BYTES = [2.5 * f for f in F_BYTES]
MIB = 1024 * 1024
GRANT_MB = [b / MIB for b in GRANT_BYTES]
TOO_SMALL_MB = 100 / MIB  # less than one micro-batch on every stage: refused, naming stage 0

MB_JOBS = [_job("stock", None)]
for _sched in ("zb", "adaptive"):
    for _dispatch in ("ordered", "ready"):
        MB_JOBS.append(_job(f"mb_{_sched}_{_dispatch}", _section(_sched, _dispatch, memory={"budget_mb": GRANT_MB})))
# re-planning for a slow link (20 ms injected on link 0, delegation "auto"): the re-plans keep within the grant
MB_JOBS.append(_job("mb_adaptive_replans", _section("adaptive", memory={"budget_mb": GRANT_MB},
                                                    inject={"links": {"0": {"delay_ms": 20}}},
                                                    delegation={"mode": "auto"})))
MB_JOBS.append(_job("mb_too_small", _section("zb", memory={"budget_mb": TOO_SMALL_MB}), expect_train_error=True))
MB_NAMES = [j["name"] for j in MB_JOBS[1:-1]]


@pytest.fixture(scope="module")
def run_mb(tmp_path_factory):
    return launch(S, MB_JOBS, tmp_path_factory.mktemp("memory_mb"), timeout=1200)


@pytest.mark.timeout(1500)
def test_a_grant_in_bytes_is_kept_from_the_second_iteration_and_trains_as_stock(run_mb):
    from .launch import max_param_diff

    stock = _peaks(run_mb, "stock")
    for name in MB_NAMES:
        measured = {a["stage"]: a["f"] for a in run_mb.result(name, 0)["activation_bytes"]}
        assert [measured[s] for s in range(S)] == F_BYTES, (name, measured)
        ours = _peaks(run_mb, name)  # the steps after the first: the grant in force
        for s in range(S):
            budget = run_mb.result(name, s)["budget"]  # every rank holds every stage's, the same
            assert budget == run_mb.result(name, 0)["budget"], name
            assert budget["units"][s] == pytest.approx(2.5) and budget["caps"][s] == 2, (name, budget)
            assert ours[s] <= GRANT_BYTES[s], (name, s, ours[s], GRANT_BYTES[s])
        assert ours[0] < stock[0], (name, ours, stock)  # tighter than stock where the grant is smaller
        for r in range(S):  # fp32: the same training as stock DeepSpeed's
            res, ref = run_mb.result(name, r), run_mb.result("stock", r)
            assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) <= 1e-5, name
            assert max_param_diff(res, ref) <= 1e-5, name
    # rank 0's line after the first iteration: the budget per stage in MiB (5 decimals: two significant
    # digits of the smallest per-micro-batch figure, 0.00049 MiB) and in micro-batches' activations
    line = (f"the budget from now on (memory.budget_mb): [{', '.join(f'{b / MIB:.5f}' for b in GRANT_BYTES)}] MiB "
            f"per stage, [2.5, 2.5, 2.5, 2.5] micro-batches' activations")
    assert run_mb.output.count(line) == len(MB_NAMES), run_mb.output[-3000:]
    assert run_mb.result("mb_adaptive_replans", 0)["replans"], "the slow link was not re-planned for"


@pytest.mark.timeout(1500)
def test_a_grant_below_one_micro_batch_is_refused_on_every_rank_naming_the_stage(run_mb):
    # the launch ended (no hang): each rank recorded the refusal and exits 2; the launch exits 1 (it may stop
    # a rank still running first)
    assert run_mb.returncode == 1 and "exited with code 2" in run_mb.output, run_mb.output[-3000:]
    least = F_BYTES[0] / MIB
    for r in range(S):
        err = run_mb.error("mb_too_small", r)
        assert err.startswith(f"pipemorph.memory.budget_mb gives stage 0 {TOO_SMALL_MB:.4g} MiB, less than one "
                              f"micro-batch's activations there ({least:.4g} MiB measured"), err
        assert f"the smallest budget_mb that runs is {least:.4g} MiB on stage 0" in err, err
