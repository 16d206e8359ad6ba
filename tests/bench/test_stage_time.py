"""Where a ready stage's time goes (``bench.stage_time``) and the plain-sleep workload (``bench.plain_sleep``)."""
from __future__ import annotations

import time

import pytest
import torch

from ds_pipemorph.bench import plain_sleep, stage_time
from ds_pipemorph.bench.spec import BenchSpec, Scenario
from ds_pipemorph.plan.ir.ops import Op
from ds_pipemorph.plan.sim.timeline import Slot, Timeline

MS = 1_000_000


def _timeline(slots, iteration_ms):
    busy = [sum(s.end - s.start for s in slots if s.stage == k) for k in range(2)]
    return Timeline(2, 1, slots, iteration_ms, busy, [1, 1])


def test_two_stages_one_microbatch_split_into_op_overrun_message_wait_and_idle_with_the_message_in():
    # replay: stage 0 F0 0-10, B0 30-40 (grad from stage 1's B0 ending at 30), W0 40-50;
    # stage 1 F0 10-20, B0 20-30, W0 30-40.
    rep = _timeline([Slot(0, Op("F", 0), 0, 10), Slot(1, Op("F", 0), 10, 20), Slot(1, Op("B", 0), 20, 30),
                     Slot(0, Op("B", 0), 30, 40), Slot(1, Op("W", 0), 30, 40), Slot(0, Op("W", 0), 40, 50)], 50)
    # measured: stage 0's F0 lasts 11 ms; stage 1 gets F0 at 12, starts it at 13 (1 ms idle with it in),
    # its B0 ends at 33; stage 0 has the gradient at 34, starts B0 at 35.
    s0 = stage_time.StageIteration([("F", 0, 0, 11 * MS), ("B", 0, 35 * MS, 45 * MS), ("W", 0, 45 * MS, 55 * MS)],
                                   {("B", 0): 34 * MS}, 0, 0, {"post": MS // 2})
    s1 = stage_time.StageIteration([("F", 0, 13 * MS, 23 * MS), ("B", 0, 23 * MS, 33 * MS),
                                    ("W", 0, 33 * MS, 43 * MS)], {("F", 0): 12 * MS}, 0, 0, {})
    a, b = stage_time.account([s0, s1], rep, [0.0])
    assert a["busy_over"] == pytest.approx(1.0) and a["over_F"] == pytest.approx(1.0)
    assert a["idle"] == pytest.approx(55 - 31) and a["replay_idle"] == pytest.approx(20)
    assert a["msg_wait"] == pytest.approx(34 - 11) and a["replay_msg_wait"] == pytest.approx(20)
    assert a["beyond_replay"] == pytest.approx(3) and a["msg_in"] == pytest.approx(1)
    assert a["posting"] == pytest.approx(0.5)
    assert b["msg_wait"] == pytest.approx(12) and b["msg_in"] == pytest.approx(1)
    assert b["replay_msg_wait"] == pytest.approx(10) and b["beyond_replay"] == pytest.approx(2)
    assert a["msg_latency"] == pytest.approx(34 - 33) and b["msg_latency"] == pytest.approx(12 - 11)
    assert stage_time.link_latency([s0, s1]) == [pytest.approx(1.0)]
    times = stage_time.measured_op_times([s0, s1])
    assert times(0, "F", 0) == pytest.approx(11) and times(1, "W", 0) == pytest.approx(10)


def test_plain_sleep_draws_a_quarter_per_iteration_and_the_batch_flags_them():
    sets = [plain_sleep.heavy_set(k, 12) for k in range(6)]
    assert all(len(s) == 3 for s in sets) and len(set(sets)) > 1
    assert sets[2] == plain_sleep.heavy_set(2, 12)
    data = plain_sleep.batch(2, 12)
    assert {m for m, (x, y) in enumerate(data) if x[0, plain_sleep.FLAG] == 1.0} == sets[2]
    times = plain_sleep.op_times(2, 4, 12, 10.0)
    m = min(sets[2])
    assert times(1, "B", m) == 30.0 and times(2, "B", m) == 10.0


def test_plain_sleep_stage_sleeps_three_times_longer_on_a_flagged_microbatch_and_passes_the_flag_on():
    stage = plain_sleep.PlainSleepStage(op_ms=5.0, heavy=True)
    for flag, least_ms in ((0.0, 5.0), (1.0, 15.0)):
        x = torch.cat([torch.randn(1, plain_sleep.WIDTH), torch.tensor([[flag]])], 1).requires_grad_(True)
        t = time.perf_counter()
        y = stage(x)
        assert (time.perf_counter() - t) * 1000 >= least_ms
        assert y[0, plain_sleep.FLAG] == flag
        y.sum().backward()
        assert stage.weight.grad is not None and x.grad.shape == x.shape


def test_a_workload_and_a_variation_are_refused_together():
    with pytest.raises(ValueError, match="leave vary out"):
        BenchSpec(stages=2, microbatches=2, op_ms=1, scenarios=[Scenario(name="a", links_ms=[0])],
                  schedules=["zb"], iterations=1, warmup=0, progress_file="p", out="o", vary="jitter:0.5",
                  workload="plain-sleep")


def test_plain_sleep_stage_whose_input_needs_no_gradient_pays_b_in_its_weight_backward():
    stage = plain_sleep.PlainSleepStage(op_ms=5.0, heavy=False)
    x = torch.cat([torch.randn(1, plain_sleep.WIDTH), torch.tensor([[0.0]])], 1)
    y = stage(x)
    t = time.perf_counter()
    y.sum().backward()
    assert (time.perf_counter() - t) * 1000 >= 10.0
