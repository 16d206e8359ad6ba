"""With one data-parallel replica the engine skips DeepSpeed's gradient all-reduce only where it is
the identity (``runtime.grad_reduce``), and trains exactly like stock DeepSpeed either way.

Two stages on two ranks, 3 Adam steps with gradient clipping: the default fp32 job may skip; with
``gradient_predivide_factor`` 3 DeepSpeed scales by 1/3 before and by 3 after the collective,
which can round, so the reduction must run. Each is compared with stock DeepSpeed on the same
settings (losses and every parameter within 1e-5)."""
from __future__ import annotations

import pytest

from .launch import launch, max_param_diff

TOL = 1e-5
SECTION = {"schedule": "zb", "delegation": {"mode": "off"}, "adapt": {"enabled": False}}


@pytest.mark.timeout(240)
def test_the_reduction_is_skipped_only_where_it_changes_nothing(tmp_path):
    predivide = {"gradient_predivide_factor": 3.0, "prescale_gradients": False}
    jobs = [{"name": "stock", "stages": 2, "micro_batches": 4, "pipemorph": None},
            {"name": "ours", "stages": 2, "micro_batches": 4, "pipemorph": SECTION},
            {"name": "stock_pre", "stages": 2, "micro_batches": 4, "pipemorph": None, "ds": predivide},
            {"name": "ours_pre", "stages": 2, "micro_batches": 4, "pipemorph": SECTION, "ds": predivide}]
    run = launch(2, jobs, tmp_path, timeout=200)
    for rank in range(2):
        for name, stock, skippable in (("ours", "stock", True), ("ours_pre", "stock_pre", False)):
            ours, ref = run.result(name, rank), run.result(stock, rank)
            assert ours["reduce_skippable"] is skippable, f"{name} rank {rank}"
            assert len(ours["reduce_ms"]) == 3, f"{name} rank {rank}: ReduceGrads ran {len(ours['reduce_ms'])} times"
            assert ours["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} rank {rank}: losses differ"
            assert max_param_diff(ours, ref) <= TOL, f"{name} rank {rank}: parameters differ"
