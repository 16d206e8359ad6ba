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
