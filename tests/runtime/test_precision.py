"""bf16, bf16 + ZeRO-1, fp16 and activation checkpointing train exactly as stock DeepSpeed does.

Every job trains the same seed and data for 3 optimizer steps (Adam, gradient clipping) and writes
its losses, its stage's parameters (bf16 or fp16 where the model is) and the optimizer's fp32
master weights. Ours is compared with stock DeepSpeed 1F1B under the same settings.

Bit for bit, and why: each micro-batch's weight gradient is the same autograd kernel on the same
tensors in B/W as in the fused backward, and DeepSpeed adds each micro-batch's bf16 gradient into
its fp32 master gradient in the order the stage's backwards (here: W) run, which every plan below
keeps in micro-batch order on each stage, and ready dispatch too: it runs a stage's Ws in the
hint's order whatever order its Bs took (``plan.ir.ready_rule``). Anything else (a different
accumulation order) would show here as a difference.

fp16: DeepSpeed's CPU accelerator refuses fp16 ("Type fp16 is not supported on your device"); these
jobs tell it that it supports fp16 (``fake_fp16`` in the worker) so that DeepSpeed's own fp16
optimizers and dynamic loss scaler run on CPU tensors. A scale of 2^30 overflows: the step is
skipped on every stage and the scale lowered, as in stock.
"""
from __future__ import annotations

import pytest
import torch

from ds_pipemorph.runtime.compat import MOVING_REFUSED

from .launch import launch, launch_shared, max_param_diff
from .plans_io import write_plan

BF16 = {"bf16": {"enabled": True}}
Z1 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
# The 4-rank tests' jobs run in one launch (one start of the ranks and DeepSpeed), each test's in
# its own order; its ceiling is the sum of theirs as launches of their own (560, 560, 700, 560 s).
SHARED_TIMEOUT = 2380
TEST_TIMEOUT = SHARED_TIMEOUT + 60  # the first test to ask for the launch waits for all of it


def _pm(schedule: str, **more) -> dict:
    return {"schedule": schedule, "delegation": {"mode": "off"}, "adapt": {"enabled": False}, **more}


def _assert_identical(run, name: str, ref: str, ranks: int, tol: float = 0.0) -> None:
    for r in range(ranks):
        ours, stock = run.result(name, r), run.result(ref, r)
        assert len(ours["losses"]) == len(stock["losses"]) > 0, f"{name} rank {r}"
        assert ours["losses"] == pytest.approx(stock["losses"], abs=tol, rel=0), \
            f"{name} rank {r}: losses {ours['losses']} != {stock['losses']}"
        assert max_param_diff(ours, stock) <= tol, f"{name} rank {r}: parameters differ from {ref}"
        assert len(ours["master"]) == len(stock["master"]), f"{name} rank {r}: master weights"
        for a, b in zip(ours["master"], stock["master"]):
            assert (a - b).abs().max().item() <= tol, f"{name} rank {r}: fp32 master weights differ from {ref}"
        assert ours["skipped_steps"] == stock["skipped_steps"], f"{name} rank {r}: skipped steps"
        assert ours["loss_scale"] == stock["loss_scale"], f"{name} rank {r}: loss scale"


# Ready dispatch adds each stage's weight gradients in the hint's order (micro-batch order in these
# plans), so bf16 gives stock's bits, except where the memory budget lets a W run before a W ahead of
# it to free memory (``plan.ir.ready_rule``), which needs activations taken out of order: on a loaded
# host a receive thread can wake later than the inbox's 2 ms of settling. The ready jobs under the
# default budget settle for up to half a second (``settle_ms``) so that they take their activations
# in order; ``late_fused_z1`` takes two out of order on purpose, with no budget.
READY_SETTLE_MS = 500


def _ws_in_order(run, name: str, ranks: int) -> bool:
    """Every rank ran its Ws in micro-batch order in every iteration of job ``name``."""
    for r in range(ranks):
        for ops in run.result(name, r)["executed"]:
            ws = [int(o[len(f"{r}W"):]) for o in ops if o.startswith(f"{r}W")]
            if ws != sorted(ws):
                return False
    return True


def _four_stage_jobs(out_dir) -> tuple[list[dict], list[tuple[str, str]]]:
    """The jobs of the first test below (its plan file written to ``out_dir``), and the pairs of
    (job, stock job) it compares."""
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
    from ds_pipemorph.plan.sched.listsched import list_schedule

    plan = write_plan(out_dir / "plan.yaml", list_schedule(Costs.uniform(4, 10.0), 8, [6, 4, 2, 1]), 8)
    fused = write_plan(out_dir / "fused.yaml", deepspeed_1f1b(4, 8), 8, fused=True)
    jobs, checks = [], []
    for prec, ds in (("bf16", BF16), ("z1", Z1)):
        jobs.append({"name": f"stock_{prec}", "stages": 4, "micro_batches": 8, "pipemorph": None, "ds": ds})
        jobs.append({"name": f"stock_{prec}_tied", "stages": 4, "micro_batches": 8, "tied": True,
                     "pipemorph": None, "ds": ds})
        sections = {"1f1b": _pm("1f1b"), "zb": _pm("zb"), "ready": _pm("zb", dispatch="ready"),
                    # 30 ms slept before each send on link 0: the control loop re-plans for it.
                    "adaptive": {"schedule": "adaptive", "delegation": {"mode": "off"}, "timeout_s": 60,
                                 "adapt": {"replan": "inline"}, "inject": {"links": {"0": {"delay_ms": 30}}}},
                    "plan": {"schedule": "plan", "plan_file": str(plan), "delegation": {"mode": "off"}}}
        for sched, section in sections.items():
            jobs.append({"name": f"{sched}_{prec}", "stages": 4, "micro_batches": 8, "pipemorph": section, "ds": ds,
                         **({"settle_ms": READY_SETTLE_MS} if sched == "ready" else {})})
            checks.append((f"{sched}_{prec}", f"stock_{prec}"))
        jobs.append({"name": f"zb_{prec}_tied", "stages": 4, "micro_batches": 8, "tied": True,
                     "pipemorph": _pm("zb"), "ds": ds})
        checks.append((f"zb_{prec}_tied", f"stock_{prec}_tied"))
    # The last stage notices F2 after F3 (a busy host) under ready dispatch of a fused 1F1B plan: B3
    # runs before F2, split from its W, which waits for W2.
    jobs.append({"name": "late_fused_z1", "stages": 4, "micro_batches": 8, "ds": Z1,
                 "pipemorph": {**_pm("plan", dispatch="ready"), "plan_file": fused},
                 "late_notice": {"rank": 3, "kind": "F", "mb": 2, "ms": 2000}})
    checks.append(("late_fused_z1", "stock_z1"))
    for job in jobs:
        job["steps"] = 4
    return jobs, checks


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The 4-rank tests' jobs in one launch: a view of it per test."""
    out = tmp_path_factory.mktemp("precision")
    return launch_shared(4, {"stages4": _four_stage_jobs(out)[0], "replicas": _replica_jobs(),
                             "moving": _moving_jobs(), "scheduled": _scheduled_jobs()}, out, timeout=SHARED_TIMEOUT)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_four_stages_in_bf16_and_bf16_zero1_equal_stock_bit_for_bit_under_every_schedule_and_dispatch(four_ranks,
                                                                                                        tmp_path):
    run = four_ranks["stages4"]
    for name, ref in _four_stage_jobs(tmp_path)[1]:
        assert _ws_in_order(run, name, 4), f"{name}: a stage ran its Ws out of micro-batch order"
        _assert_identical(run, name, ref, 4)
    for prec in ("bf16", "z1"):  # the slow link was re-planned for, mid-run, on every rank alike
        replans = run.result(f"adaptive_{prec}", 0)["replans"]
        assert replans and all(run.result(f"adaptive_{prec}", r)["replans"] == replans for r in range(4))
    # The bf16 jobs really trained in bf16 with fp32 masters, and the tied jobs on tied weights.
    r0 = run.result("zb_bf16", 0)
    assert all(v.dtype == torch.bfloat16 for v in r0["params"].values() if v.is_floating_point())
    assert r0["master"] and all(m.dtype == torch.float32 for m in r0["master"])
    assert r0["losses"][-1] < r0["losses"][0]
    # Out of order on the last stage: F3 and B3 before F2, and the weight gradients still added W2 then W3.
    late = [run_ for run_ in run.result("late_fused_z1", 3)["executed"] if run_.index("3F3") < run_.index("3F2")]
    assert late, "the late notice of F2 never let F3 run first"
    for ops in late:
        assert ops.index("3B3") < ops.index("3F2") and ops.index("3W2") < ops.index("3W3"), ops
    first, last = run.result("zb_z1_tied", 0)["params"], run.result("zb_z1_tied", 3)["params"]
    # TiedLayerSpec ties the weight (its tied_weight_attr); each end keeps its own bias.
    assert torch.equal(first["tied_modules.ends.weight"], last["tied_modules.ends.weight"]), "tied weights differ"


def _replica_jobs() -> list[dict]:
    """The jobs of the test below."""
    jobs = [{"name": "stock_z1", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": None, "ds": Z1,
             "save": {"2": "ck_stock"}},
            {"name": "zb_z1", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": _pm("zb"), "ds": Z1,
             "save": {"2": "ck_ours"}},
            {"name": "delegated_z1", "stages": 2, "dp": 2, "micro_batches": 4, "ds": Z1,
             "pipemorph": {**_pm("zb"), "delegation": {"mode": "always"}}},
            # The direct path of link 0 fails from its 6th message each way: both ends fail over to the delegates.
            {"name": "failover_z1", "stages": 2, "dp": 2, "micro_batches": 4, "ds": Z1,
             "pipemorph": {"schedule": "zb", "delegation": {"mode": "auto", "queues": 1}, "adapt": {"enabled": False},
                           "inject": {"faults": {"link_fails_after": {"0": 5}}}}},
            {"name": "stock_from_ours", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": None, "ds": Z1,
             "load": {"dir": "ck_ours", "step": 2}},
            {"name": "ours_from_stock", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": _pm("zb"), "ds": Z1,
             "load": {"dir": "ck_stock", "step": 2}},
            {"name": "stock_bf16", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": None, "ds": BF16},
            {"name": "zb_bf16", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": _pm("zb"), "ds": BF16},
            {"name": "delegated_bf16", "stages": 2, "dp": 2, "micro_batches": 4, "ds": BF16,
             "pipemorph": {**_pm("zb"), "delegation": {"mode": "always"}}},
            {"name": "failover_bf16", "stages": 2, "dp": 2, "micro_batches": 4, "ds": BF16,
             "pipemorph": {"schedule": "zb", "delegation": {"mode": "auto", "queues": 1}, "adapt": {"enabled": False},
                           "inject": {"faults": {"link_fails_after": {"0": 5}}}}}]
    return jobs


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_replicas_zero1_partitions_delegated_links_and_checkpoints_that_resume_across_engines(four_ranks):
    """2 stages x 2 replicas: ZeRO-1 and BF16_Optimizer partition the fp32 masters over the replicas.
    Links delegated from the start, and a direct link that fails mid-run and fails over, change
    nothing.
    A run saved by ours at step 2 resumes under stock DeepSpeed, and the reverse, to the parameters
    and masters of the run that never stopped."""
    run = four_ranks["replicas"]
    for name, ref in (("zb_z1", "stock_z1"), ("delegated_z1", "stock_z1"), ("failover_z1", "stock_z1"),
                      ("zb_bf16", "stock_bf16"), ("delegated_bf16", "stock_bf16"), ("failover_bf16", "stock_bf16")):
        _assert_identical(run, name, ref, 4)
    for name in ("failover_z1", "failover_bf16"):
        assert any("direct path failed at SEND" in e for r in range(4) for e in run.result(name, r)["events"]), name
    # Each replica holds its half of the fp32 masters (ZeRO-1's partition).
    full = sum(p.numel() for p in run.result("stock_z1", 0)["params"].values())
    assert 0 < sum(m.numel() for m in run.result("zb_z1", 0)["master"]) < full
    # (bf16 without ZeRO: DeepSpeed 0.19.8 cannot load its own pipeline checkpoint, KeyError in
    # BF16_Optimizer._load_legacy_checkpoint, so no resume is compared there.)
    for resumed, ref in (("stock_from_ours", "stock_z1"), ("ours_from_stock", "stock_z1")):
        for r in range(4):
            a, b = run.result(resumed, r), run.result(ref, r)
            assert a["losses"] == b["losses"][2:], f"{resumed} rank {r}"
            assert max_param_diff(a, b) == 0.0, f"{resumed} rank {r}: parameters differ"
            assert all(torch.equal(x, y) for x, y in zip(a["master"], b["master"])), f"{resumed} rank {r}: masters"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp16_loss_scaling_and_activation_checkpointing_equal_stock_and_fp16_without_zero_keeps_its_layers(tmp_path):
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 30}}
    ckpt = {"pipeline": {"activation_checkpoint_interval": 2}}
    jobs = []
    for zero in (0, 1):  # FP16_Optimizer, and ZeRO-1's optimizer with its own loss scaler
        ds = {**fp16, "zero_optimization": {"stage": zero}}
        for name, section in ((f"stock_fp16_z{zero}", None), (f"zb_fp16_z{zero}", _pm("zb"))):
            jobs.append({"name": name, "stages": 2, "micro_batches": 4, "steps": 4, "fake_fp16": True,
                         "pipemorph": section, "ds": ds})
    jobs += [
        {"name": "zb", "stages": 2, "micro_batches": 4, "pipemorph": _pm("zb")},
        {"name": "zb_ckpt", "stages": 2, "micro_batches": 4, "pipemorph": _pm("zb"), "ds": ckpt},
        {"name": "stock_ckpt", "stages": 2, "micro_batches": 4, "pipemorph": None, "ds": ckpt},
        {"name": "gpt", "stages": 2, "micro_batches": 4, "model": "gpt", "pipemorph": _pm("zb")},
        {"name": "gpt_ckpt", "stages": 2, "micro_batches": 4, "model": "gpt", "ckpt_layers": ["Block"],
         "pipemorph": _pm("zb"), "ds": {"pipeline": {"activation_checkpoint_interval": 1}}},
        {"name": "stock_bf16_ckpt", "stages": 2, "micro_batches": 4, "pipemorph": None, "ds": {**BF16, **ckpt}},
        {"name": "adaptive_bf16_ckpt", "stages": 2, "micro_batches": 4, "ds": {**BF16, **ckpt},
         "pipemorph": {"schedule": "adaptive", "delegation": {"mode": "off"}}},
        {"name": "ready_bf16_ckpt", "stages": 2, "micro_batches": 4, "ds": {**BF16, **ckpt},
         "pipemorph": _pm("zb", dispatch="ready"), "settle_ms": READY_SETTLE_MS},
        {"name": "migrate_fp16", "stages": 2, "micro_batches": 4, "steps": 2, "fake_fp16": True, "pipemorph": _pm("zb"),
         "ds": {**fp16, "zero_optimization": {"stage": 0}}, "migrate": {"1": [0, 3, 8]}},
    ]
    run = launch(2, jobs, tmp_path, timeout=560)
    for zero in (0, 1):
        _assert_identical(run, f"zb_fp16_z{zero}", f"stock_fp16_z{zero}", 2)
    # ZeRO-1's dynamic scaler skipped the overflowing steps and lowered its scale, on both stages alike.
    z1 = run.result("zb_fp16_z1", 0)
    assert 0 < z1["skipped_steps"] and z1["loss_scale"] < 2.0 ** 30
    # Checkpointing changes memory, not numbers: fp32 to 1e-6 of the same job without it (here: equal).
    for name, ref in (("zb_ckpt", "zb"), ("stock_ckpt", "zb"), ("gpt_ckpt", "gpt")):
        for r in range(2):
            a, b = run.result(name, r), run.result(ref, r)
            assert a["losses"] == pytest.approx(b["losses"], abs=1e-6) and max_param_diff(a, b) <= 1e-6, name
    for name in ("adaptive_bf16_ckpt", "ready_bf16_ckpt"):
        _assert_identical(run, name, "stock_bf16_ckpt", 2)
    for r in range(2):  # FP16_Optimizer keeps no per-parameter mapping: layers stay where they are
        assert run.result("migrate_fp16", r)["migrations"] == [{"step": 1, "error": MOVING_REFUSED}]


def _replica(run, name: str, ranks, key: str = "params") -> dict:
    out = {}
    for r in ranks:
        out.update(run.result(name, r)[key])
    return out


def _moving_jobs() -> list[dict]:
    """The jobs of the test below."""
    base = {"stages": 2, "dp": 2, "micro_batches": 4, "steps": 4, "tied": True,
            "pipemorph": {"schedule": "zb", "timeout_s": 60, "delegation": {"mode": "off"}}}
    new = [[0, 2], [1, 3]]  # ranks[stage][replica]: ranks 1 and 2 swap stages
    jobs = []
    for prec, ds in (("bf16", BF16), ("z1", Z1)):
        jobs += [{**base, "ds": ds, "name": f"still_{prec}"},
                 {**base, "ds": ds, "name": f"moved_{prec}", "migrate": {"1": [0, 3, 10], "2": [0, 7, 10]}},
                 {**base, "ds": ds, "name": f"remapped_{prec}", "migrate": {"1": [0, 3, 10]}, "remap": {"2": new}}]
    # Resumed from step 2. DeepSpeed's own resume of a bf16 ZeRO-1 run (stock saved, stock resumed)
    # trains the second step after the load a few ulps away from the run that never stopped; ours
    # after a migration is held to the stock resume, with the tolerances above.
    jobs += [{**base, "ds": Z1, "name": "saved_z1", "migrate": {"1": [0, 3, 10]}, "save": {"2": "ck_moved"}},
             {**base, "ds": Z1, "name": "resumed_z1", "load": {"dir": "ck_moved", "step": 2}},
             {**base, "ds": Z1, "name": "stock_saved_z1", "pipemorph": None, "save": {"2": "ck_stock"}},
             {**base, "ds": Z1, "name": "stock_resumed_z1", "pipemorph": None, "load": {"dir": "ck_stock", "step": 2}}]
    return jobs


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_layers_and_ranks_move_in_bf16_and_zero1_and_train_as_if_they_had_not(four_ranks):
    """2 stages x 2 replicas, 10 layers with tied ends (uniform [0, 5, 10]). Layers move both ways
    (live migration) and ranks take new stages (re-mapping); each parameter, its fp32 master (by
    name: the flat partitions are laid out anew) and every loss are compared with the run that never
    moved. A ZeRO-1 checkpoint saved after a migration resumes on the partition it was saved on.

    Not bit for bit, and by how much: gradient clipping's norm is a sum of squares added per stage,
    then over the stages; a layer that moved is added on another stage, so the norm, and the clip
    coefficient every gradient is multiplied by, can differ in their last bit (a relative 2^-24 per
    addition, a few additions). Adam divides the scaled gradient by the root of its scaled square,
    so the coefficient cancels but for ``eps``: a master moves by a few fp32 ulps at most per step
    (we allow 8 ulps of its magnitude over the 4 steps), a bf16 weight, the master rounded, by at
    most one bf16 ulp (2^-8 relative), and a loss computed from such weights by a few bf16 ulps of
    the loss (2^-6 relative allowed)."""
    run = four_ranks["moving"]
    for prec in ("bf16", "z1"):
        still = f"still_{prec}"
        for name, replicas in ((f"moved_{prec}", ([0, 2], [1, 3])), (f"remapped_{prec}", ([0, 1], [2, 3]))):
            for r in range(4):
                a, b = run.result(still, r), run.result(name, r)
                assert b["losses"] == pytest.approx(a["losses"], rel=2 ** -6), f"{name} rank {r}: losses differ"
            assert run.result(name, 0)["parts"] == ([0, 7, 10] if name.startswith("moved") else [0, 3, 10])
            for key, rel in (("params", 2 ** -8), ("master_by_name", 8 * 2 ** -24)):
                ref = _replica(run, still, [0, 2], key)  # replica 0 of the run that never moved
                for ranks in replicas:
                    got = _replica(run, name, ranks, key)
                    assert got.keys() == ref.keys() and ref, f"{name} {key}"
                    for k in (k for k in got if ":" not in k):  # the masters (moments: as the masters they make)
                        x, y = got[k].float(), ref[k].float()
                        assert ((x - y).abs() <= rel * y.abs() + 1e-12).all(), \
                            f"{name} replica {ranks}: {key} {k} differs by {(x - y).abs().max().item():g}"
        assert all(m["ok"] for m in run.result(f"moved_{prec}", 0)["migrations"])
        assert all(r["ok"] for r in run.result(f"remapped_{prec}", 1)["remaps"])
    for r in range(4):
        a, b = run.result("stock_resumed_z1", r), run.result("resumed_z1", r)
        assert b["parts"] == [0, 3, 10] and b["losses"] == pytest.approx(a["losses"], rel=2 ** -6), f"rank {r}"
    for key, rel in (("params", 2 ** -8), ("master_by_name", 8 * 2 ** -24)):
        ref = _replica(run, "stock_resumed_z1", [0, 2], key)
        got = _replica(run, "resumed_z1", [0, 2], key)
        masters = [k for k in ref if ":" not in k]  # Adam's moments are compared as the masters they make
        assert masters and set(masters) <= got.keys()
        for k in masters:
            x, y = got[k].float(), ref[k].float()
            assert ((x - y).abs() <= rel * y.abs() + 1e-12).all(), f"resumed {key} {k}"


def _scheduled_jobs() -> list[dict]:
    """The jobs of the test below."""
    sched = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 3}}}
    ds = {**BF16, **sched, "pipeline": {"activation_checkpoint_interval": 2}}
    base = {"stages": 4, "micro_batches": 4, "steps": 4, "pipemorph": {**_pm("zb"), "timeout_s": 60}}
    ovl = {**Z1, "zero_optimization": {"stage": 1, "overlap_comm": True}}
    jobs = [{**base, "name": "still", "ds": ds},
            {**base, "name": "moved", "ds": ds, "migrate": {"1": [0, 4, 6, 12, 16]}},
            {**base, "name": "stock_overlap", "ds": ovl, "pipemorph": None},
            {**base, "name": "zb_overlap", "ds": ovl},
            {**base, "name": "ready_overlap", "ds": ovl, "pipemorph": {**_pm("zb", dispatch="ready"), "timeout_s": 60},
             "settle_ms": READY_SETTLE_MS}]
    return jobs


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_four_stages_move_layers_with_a_scheduler_and_checkpointing_and_zero1_overlaps_reduction_as_stock(four_ranks):
    """4 stages x 1 replica, bf16 with a warm-up lr schedule and activation checkpointing of every
    Linear/GELU pair: layers 6 and 7 move from stage 1 to stage 2 after step 1, while stages 0 and
    3 hold on to theirs (their optimizers stay as they are), the schedule keeps driving the stage's
    new optimizer and the moved layers run checkpointed on their new stage; held to the run that
    never moved with the tolerances of the test above. ZeRO-1 with ``overlap_comm`` reduces in
    DeepSpeed's gradient hooks, which fire in W: bit for bit as stock."""
    run = four_ranks["scheduled"]
    for r in range(4):
        a, b = run.result("still", r), run.result("moved", r)
        assert b["migrations"][0]["ok"] and b["parts"] == [0, 4, 6, 12, 16], f"rank {r}"
        assert b["losses"] == pytest.approx(a["losses"], rel=2 ** -6), f"rank {r}: losses differ"
    # The schedule's lr rises from 0 over 3 steps: an lr frozen after the move (a scheduler left on the old
    # optimizer) would move the weights differently from the second step after it on.
    for key, rel in (("params", 2 ** -8), ("master_by_name", 8 * 2 ** -24)):
        ref, got = _replica(run, "still", range(4), key), _replica(run, "moved", range(4), key)
        assert got.keys() == ref.keys() and ref
        for k in (k for k in got if ":" not in k):
            x, y = got[k].float(), ref[k].float()
            assert ((x - y).abs() <= rel * y.abs() + 1e-12).all(), f"moved {key} {k}"
    for name in ("zb_overlap", "ready_overlap"):
        _assert_identical(run, name, "stock_overlap", 4)
