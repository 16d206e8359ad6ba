"""Tensor parallelism inside a stage: DeepSpeed's pipe x model (x data) topology, ours against stock.

One 4-rank launch: 2 stages x 2 tensor-parallel ranks of ``tp_models``' column/row-parallel MLP,
stock DeepSpeed (``PipelineEngine``, the same topology, its partitioned activations as configured
by default and whole ones) against ``1f1b``, ``zb`` (with a tied layer too), ``adaptive`` re-planning
for a slowed link and for one slowed tensor-parallel pair, ``auto`` delegation for that pair,
every link delegated, ``zb`` under NCCL's point-to-point rules (the gloo double), a checkpoint
resumed; then the refusals. A second launch adds two replicas (8 ranks). Results are read from the
files each rank writes.
"""
from __future__ import annotations

import pytest
import torch

from ds_pipemorph.runtime.compat import TP_MOVING_REFUSED, TP_PARTITIONED_REFUSED, TP_READY_REFUSED

from .launch import launch, max_param_diff

TOL = 1e-5
S, TP, N, STEPS = 2, 2, 4, 4
WHOLE = {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
BASE = {"stages": S, "tp": TP, "micro_batches": N, "steps": STEPS, "ds": WHOLE}
SLOW_MS = 30
PAIR = "1-3"  # global ranks 1 and 3: stage 0 and stage 1 of tensor-parallel rank 1 (expected_stage_ranks)


def _pm(schedule: str, **more) -> dict:
    return {"schedule": schedule, "delegation": {"mode": "off"}, "timeout_s": 60, **more}


REPLAN = {"replan": "inline"}
# job name -> (pipemorph section, reference job, more job settings)
TRAINED = {
    "1f1b": (_pm("1f1b"), "stock", {}),
    # repartition is refused, training goes on; a checkpoint after 2 steps; evaluation (stock's schedule)
    "zb": (_pm("zb"), "stock", {"migrate": {"1": [0, 4, 7]}, "save": {"2": "ckpt"}, "eval": True}),
    "zb_tied": (_pm("zb"), "stock_tied", {"tied": True}),
    "adaptive_link": (_pm("adaptive", adapt=REPLAN, inject={"links": {"0": {"delay_ms": SLOW_MS}}}), "stock", {}),
    "adaptive_pair": (_pm("adaptive", adapt=REPLAN, inject={"rank_links": {PAIR: SLOW_MS}}), "stock", {}),
    "auto_pair": ({**_pm("adaptive", adapt=REPLAN, inject={"rank_links": {PAIR: SLOW_MS}}),
                   "delegation": {"mode": "auto"}}, "stock", {"steps": 6}),
    # NCCL's point-to-point rules (one in-order queue per pair of ranks) on gloo: the NCCL lowering.
    "zb_nccl_rules": (_pm("zb", inject={"nccl_rules": True}), "stock", {}),
    "delegated": ({**_pm("zb"), "delegation": {"mode": "always"}}, "stock", {}),
    "switch_ready": (_pm("zb"), "stock", {"switch_dispatch": "ready"}),
}
REFUSED = {  # job name -> (pipemorph section, DeepSpeed settings, the sentence)
    "ready": (_pm("zb", dispatch="ready"), WHOLE, TP_READY_REFUSED),
    "rebalance": (_pm("zb", rebalance={"enabled": True}), WHOLE, TP_MOVING_REFUSED),
    "partitioned": (_pm("zb"), {}, TP_PARTITIONED_REFUSED),  # DeepSpeed's default: partitioned
}


def _jobs() -> list[dict]:
    jobs = [{"name": "stock", **BASE, "eval": True, "pipemorph": None},
            {"name": "stock_partitioned", **BASE, "ds": {}, "pipemorph": None},
            {"name": "stock_tied", **BASE, "tied": True, "pipemorph": None},
            {"name": "stock_long", **BASE, "steps": 6, "pipemorph": None}]
    for name, (section, _, more) in TRAINED.items():
        jobs.append({"name": name, **BASE, "pipemorph": section, **more})
    # zb's checkpoint after 2 steps, loaded by every rank (each its own shards): 2 more steps.
    jobs.append({"name": "zb_resumed", **BASE, "pipemorph": _pm("zb"), "load": {"dir": "ckpt", "step": 2}})
    for name, (section, ds, _) in REFUSED.items():  # last: a refusal makes the launch exit with code 2
        jobs.append({"name": f"refused_{name}", **BASE, "ds": ds, "pipemorph": section, "expect_error": True})
    return jobs


def expected_stage_ranks(rank: int, dp: int = 1) -> list[int]:
    """DeepSpeed's topology orders ranks (pipe, data, model), the last fastest: the ranks that hold
    every stage with this rank's tensor-parallel and data-parallel coordinates."""
    t, d = rank % TP, (rank // TP) % dp
    return [s * dp * TP + d * TP + t for s in range(S)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch(S * TP, _jobs(), tmp_path_factory.mktemp("tensor_parallel"), timeout=480)


def _compute_ops(ops: list[str]) -> list[str]:
    return [op for op in ops if op[:1] in "FBW" and op[1:].isdigit()]


def _check_trained(run, name: str, ref: str, ranks: int, steps: int = STEPS, dp: int = 1) -> None:
    for r in range(ranks):
        ours, stock = run.result(name, r), run.result(ref, r)
        assert len(ours["losses"]) == steps, f"{name} rank {r}"
        assert ours["losses"] == pytest.approx(stock["losses"], abs=TOL), f"{name} rank {r}: losses differ"
        assert max_param_diff(ours, stock) <= TOL, f"{name} rank {r}: parameters differ"
        if ours["eval_loss"] is not None:  # eval_batch: DeepSpeed's own schedule, after training
            assert ours["eval_loss"] == pytest.approx(stock["eval_loss"], abs=TOL), f"{name} rank {r}: eval differs"
        # Each message goes to the rank of the other stage with the same tensor-parallel coordinate.
        assert ours["stage_ranks"] == expected_stage_ranks(r, dp), f"{name} rank {r}: {ours['stage_ranks']}"
        for step, ops in enumerate(ours["ops"]):
            ran = _compute_ops(ops)
            assert sorted(ran) == sorted(f"{k}{m}" for k in "FBW" for m in range(N)), f"{name} rank {r}: {ran}"
            # The input-gradient all-reduce of the stage's column-parallel layer runs in B, once per
            # micro-batch; W runs none.
            assert sorted(ours["tp_backward_ops"][step]) == [f"B{m}" for m in range(N)], \
                f"{name} rank {r} step {step}: backward all-reduces ran in {ours['tp_backward_ops'][step]}"
    for first in range(0, ranks, TP):  # the ranks of a tensor-parallel group ran the same ops every step
        group = [run.result(name, r) for r in range(first, first + TP)]
        assert all(g["ops"] == group[0]["ops"] for g in group), f"{name}: ranks {first}.. ran different orders"


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_two_stages_by_two_tensor_parallel_ranks_train_as_stock_under_every_schedule_and_slow_link(run):
    for name, (_, ref, more) in TRAINED.items():
        _check_trained(run, name, "stock_long" if more.get("steps") == 6 else ref, S * TP, more.get("steps", STEPS))
    for r in range(S * TP):  # stock sends partitioned activations by default; the same training as whole ones
        assert run.result("stock_partitioned", r)["losses"] == pytest.approx(run.result("stock", r)["losses"], abs=TOL)
        assert max_param_diff(run.result("stock_partitioned", r), run.result("stock", r)) <= TOL
    assert all(run.result("zb_nccl_rules", r)["p2p"] == "NcclRules" for r in range(S * TP))  # the double ran
    # The tied layer is one weight at both ends (TiedLayerSpec ties the weight; each end keeps its bias).
    for t in range(TP):
        first, last = run.result("zb_tied", t)["params"], run.result("zb_tied", TP + t)["params"]
        assert torch.equal(first["tied_modules.ends.weight"], last["tied_modules.ends.weight"]), f"rank {t}"
    # The slowed link and the one slowed pair of link 0 were re-planned for, at the same boundary on
    # every rank (the ranks of a group ran the same new order: _check_trained).
    for name in ("adaptive_link", "adaptive_pair", "auto_pair"):
        replans = run.result(name, 0)["replans"]
        assert replans and all(run.result(name, r)["replans"] == replans for r in range(S * TP)), name
    for r in range(S * TP):  # resumed from zb's checkpoint: stock's last two steps
        ours, stock = run.result("zb_resumed", r), run.result("stock", r)
        assert ours["losses"] == pytest.approx(stock["losses"][2:], abs=TOL), f"zb_resumed rank {r}"
        assert max_param_diff(ours, stock) <= TOL, f"zb_resumed rank {r}: parameters differ"
    # One slowed pair of link 0: the plan is made for its delay, not for the mean over the pairs.
    for name in ("adaptive_pair", "auto_pair"):
        first = run.result(name, 0)["replan_links"][0]
        assert first[0] >= 0.8 * SLOW_MS, f"{name}: planned for link delays {first} ms"
    # "auto": link 0 went to the delegates on every rank, the pair that was not slowed included (a
    # boundary's route is the stage's, set from the slowest pair).
    modes = [run.result("auto_pair", r)["link_modes"] for r in range(S * TP)]
    assert modes == [["delegated"]] * (S * TP), modes
    # Refusals after start-up: repartition and a switch to ready dispatch, before anything changed.
    for r in range(S * TP):
        assert run.result("zb", r)["migrations"] == [{"step": 1, "error": TP_MOVING_REFUSED}]
        assert run.result("switch_ready", r)["switch_error"] == TP_READY_REFUSED


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_tensor_parallel_refusals_are_one_sentence_on_every_rank(run):
    for name, (_, _, sentence) in REFUSED.items():
        for r in range(S * TP):
            assert run.error(f"refused_{name}", r) == sentence, f"{name} rank {r}"


def _replica_jobs() -> list[dict]:
    """2 stages x 2 tensor-parallel ranks x 2 replicas (8 ranks)."""
    base = {**BASE, "dp": 2}
    jobs = [{"name": "stock", **base, "pipemorph": None},
            {"name": "stock_tied", **base, "tied": True, "pipemorph": None}]
    for name in ("zb", "zb_tied", "adaptive_link"):
        section, _, more = TRAINED[name]
        jobs.append({"name": name, **base, "pipemorph": section, **{k: v for k, v in more.items() if k == "tied"}})
    return jobs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_stages_by_two_tensor_parallel_ranks_by_two_replicas_train_as_stock(tmp_path):
    run = launch(S * TP * 2, _replica_jobs(), tmp_path, timeout=540)
    for name in ("zb", "zb_tied", "adaptive_link"):
        _check_trained(run, name, TRAINED[name][1], S * TP * 2, dp=2)
    replans = run.result("adaptive_link", 0)["replans"]
    assert replans and all(run.result("adaptive_link", r)["replans"] == replans for r in range(S * TP * 2))
    for r in range(S * TP * 2):  # the replicas read different data and averaged their gradients: equal weights
        other = r ^ TP  # the same stage and tensor-parallel rank in the other replica (ranks: pipe, data, model)
        ours, theirs = run.result("zb", r), run.result("zb", other)
        assert expected_stage_ranks(other, 2)[0] != expected_stage_ranks(r, 2)[0]
        assert all(torch.equal(ours["params"][k], theirs["params"][k]) for k in ours["params"]), f"rank {r}"
