"""Micro-batches of varying shape train exactly like stock DeepSpeed under ordered and ready dispatch.

One 2-rank launch trains recipes/gpt/varlen.py's two workloads (``PipelineModule(dynamic_shape=True)``,
fp32, 3 optimizer steps of Adam with gradient clipping, as in test_equivalence) with stock DeepSpeed
and with our engine: the ``zb`` plan ordered, and ready dispatch with the ``zb`` (BFW) and ``1f1b``
(BF) hints. ``multimodal``: each iteration a quarter of the micro-batches, drawn anew, is 4x longer
on stage 0 (the encoder) and pooled before it is sent; ``varlen``: every micro-batch has its own
length on both stages, so activations and gradients of every shape cross the link both ways.
Losses and every parameter must agree within 1e-5; every rank runs each F, B and W once per
iteration in an order that respects the dependencies, within its plan's activations.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ds_pipemorph.plan.ir.ops import peak_inflight
from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.runtime.plans import build_plan

from .launch import launch, max_param_diff
from .test_ready_dispatch import _assert_ready_run_equals_stock

TOL = 1e-5
N, STEPS, SEQ = 4, 3, 8  # the worker's VARLEN_SEQ
WORKLOADS = ("multimodal", "varlen")


def _section(schedule: str, dispatch: str) -> dict:
    return {"schedule": schedule, "dispatch": dispatch, "delegation": {"mode": "off"}, "adapt": {"enabled": False}}


RUNS = {"zb_ordered": _section("zb", "ordered"), "zb_ready": _section("zb", "ready"),
        "1f1b_ready": _section("1f1b", "ready")}


def _jobs() -> list[dict]:
    jobs = []
    for wl in WORKLOADS:
        jobs.append({"name": f"stock_{wl}", "stages": 2, "micro_batches": N, "steps": STEPS, "model": wl,
                     "pipemorph": None})
        jobs += [{"name": f"{run}_{wl}", "stages": 2, "micro_batches": N, "steps": STEPS, "model": wl,
                  "pipemorph": section} for run, section in RUNS.items()]
    return jobs


TIMEOUT = 300


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("varlen2")
    return launch(2, _jobs(), out, timeout=TIMEOUT)


def _shapes(workload: str) -> list[list[int]]:
    """Each iteration's input lengths, from the workload's own module (what the worker feeds replica 0)."""
    path = Path(__file__).resolve().parents[2] / "recipes" / "gpt" / "varlen.py"
    spec = importlib.util.spec_from_file_location("recipes_gpt_varlen", path)
    varlen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(varlen)
    batches = varlen.Batches(workload, N, batch=2, seq=SEQ, seed=0)
    return [batches.shapes(k) for k in range(STEPS)]


def test_the_workloads_vary_in_shape_within_and_across_iterations():
    for wl in WORKLOADS:
        shapes = _shapes(wl)
        assert any(len(set(s)) > 1 for s in shapes), f"{wl}: {shapes}"  # within an iteration
        assert len({tuple(s) for s in shapes}) > 1, f"{wl}: {shapes}"  # drawn anew each iteration


@pytest.mark.timeout(TIMEOUT + 60)
def test_varying_shapes_under_ordered_and_ready_dispatch_train_equal_to_stock(two_ranks):
    run = two_ranks
    for wl in WORKLOADS:
        stock = f"stock_{wl}"
        for r in range(2):
            ours, ref = run.result(f"zb_ordered_{wl}", r), run.result(stock, r)
            plan = build_plan(parse_config(RUNS["zb_ordered"]), 2, N)
            for ops in ours["ops"]:  # ordered: the plan's order, every iteration
                assert [op for op in ops if op[0] in "FBW" and op[1:].isdigit()] == [str(op) for op in plan[ours["stage"]]]
            assert ours["losses"] == pytest.approx(ref["losses"], abs=TOL), f"zb_ordered_{wl} rank {r}: losses differ"
            assert max_param_diff(ours, ref) <= TOL, f"zb_ordered_{wl} rank {r}: parameters differ"
        for name in ("zb_ready", "1f1b_ready"):
            peak = peak_inflight(build_plan(parse_config(RUNS[name]), 2, N))
            _assert_ready_run_equals_stock(run, f"{name}_{wl}", stock, 2, peak)
