"""With one data-parallel replica the engine skips DeepSpeed's gradient all-reduce only where it is
the identity (``runtime.grad_reduce``), and trains exactly like stock DeepSpeed either way.

Two stages on two ranks, 3 Adam steps with gradient clipping, each job compared with stock
DeepSpeed on the same settings (losses and every parameter within 1e-5):

- the default fp32 job: every parameter has a gradient, so each of the 3 reductions is skipped;
- ``gradient_predivide_factor`` 3: DeepSpeed scales by 1/3 before and by 3 after the collective,
  which can round, so the reduction must run;
- every Linear holding a parameter its forward never uses, with weight decay: DeepSpeed's
  reduction gives it a zero gradient, so the optimizer decays it, where a skipped reduction would
  leave it without one (and untouched). The reduction must run, and the idle parameters move."""
from __future__ import annotations

import pytest

from .launch import launch, max_param_diff

TOL = 1e-5
SECTION = {"schedule": "zb", "delegation": {"mode": "off"}, "adapt": {"enabled": False}}
PREDIVIDE = {"gradient_predivide_factor": 3.0, "prescale_gradients": False}
DECAY = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


@pytest.mark.timeout(300)
def test_the_reduction_is_skipped_only_where_it_changes_nothing(tmp_path):
    jobs = []
    for name, extra in (("plain", {}), ("pre", {"ds": PREDIVIDE}), ("idle", {"ds": DECAY, "idle": True})):
        for side, section in (("stock", None), ("ours", SECTION)):
            jobs.append({"name": f"{side}_{name}", "stages": 2, "micro_batches": 4, "pipemorph": section, **extra})
    run = launch(2, jobs, tmp_path, timeout=280)
    for rank in range(2):
        for name, skipped in (("plain", 3), ("pre", 0), ("idle", 0)):
            ours, ref = run.result(f"ours_{name}", rank), run.result(f"stock_{name}", rank)
            assert ours["reductions_skipped"] == skipped, f"{name} rank {rank}: {ours['reductions_skipped']} skipped"
            assert len(ours["reduce_ms"]) == 3, f"{name} rank {rank}: ReduceGrads ran {len(ours['reduce_ms'])} times"
            assert ours["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} rank {rank}: losses differ"
            assert max_param_diff(ours, ref) <= TOL, f"{name} rank {rank}: parameters differ"
        idle = {k: v for k, v in run.result("stock_idle", rank)["params"].items() if k.endswith(".idle")}
        assert idle and all((v - 1.0).abs().max() > 1e-4 for v in idle.values()), \
            f"rank {rank}: weight decay did not move the idle parameters, so the test shows nothing"
