"""Baselines: DeepSpeed's 1F1B in exactly the order its TrainSchedule runs, ZB-H1, GPipe."""
import pytest

from ds_pipemorph.plan.ir.ops import Op, peak_inflight, warmup_counts
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, gpipe, zb_h1
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.plan.sim.validate import validate_schedule


def deepspeed_order(stages, n, stage):
    ds_schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    ts = ds_schedule.TrainSchedule(micro_batches=n, stages=stages, stage_id=stage)
    order = []
    for step, cmds in enumerate(ts.steps()):
        mb, fwd = ts._step_to_micro_batch(step)
        names = [type(c).__name__ for c in cmds]
        if "ForwardPass" in names:
            assert fwd
            order.append(Op("F", mb))
        if "BackwardPass" in names:
            order += [Op("B", mb), Op("W", mb)]
    return order


@pytest.mark.parametrize("stages,n", [(2, 1), (2, 8), (3, 5), (4, 12), (5, 3), (8, 32)])
def test_1f1b_is_deepspeeds_train_schedule_order(stages, n):
    mine = deepspeed_1f1b(stages, n)
    for s in range(stages):
        assert mine[s] == deepspeed_order(stages, n, s)
    validate_schedule(mine, stages, n)


def test_1f1b_replayed_with_fused_backward_takes_450ms_for_the_paper_setup():
    # F = 10 ms, fused backward = B + W = 20 ms: (N + S - 1) * (10 + 20) = 450 ms.
    assert replay(deepspeed_1f1b(4, 12), Costs.uniform(4, 10.0), 12, fused_backward=True).iteration_ms == 450.0


def test_zb_h1_keeps_1f1b_memory_and_takes_390ms():
    c = Costs.uniform(4, 10.0)
    s = zb_h1(c, 12)
    assert warmup_counts(s) == [4, 3, 2, 1]
    assert peak_inflight(s) == peak_inflight(deepspeed_1f1b(4, 12)) == [4, 3, 2, 1]
    assert replay(s, c, 12).iteration_ms == 390.0


def test_gpipe_holds_every_microbatch():
    s = gpipe(3, 6)
    validate_schedule(s, 3, 6)
    assert peak_inflight(s) == [6, 6, 6]
