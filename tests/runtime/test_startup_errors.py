"""Bad settings fail at start-up on every rank with one sentence, before any training step;
a peer that never answers fails with a message naming the rank, the op, the link and the peer."""
from __future__ import annotations

import pytest
import yaml

from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import zb_h1

from .launch import REPO as REPO_ROOT, launch
from .plans_io import write_plan


@pytest.mark.timeout(200)
def test_unknown_schedule_wrong_stage_count_missing_w_and_unknown_interface_fail_on_every_rank(tmp_path):
    three = write_plan(tmp_path / "three_stages.yaml", zb_h1(Costs.uniform(3), 8), 8)
    four = tmp_path / "missing_w5.yaml"
    write_plan(four, zb_h1(Costs.uniform(4), 8), 8)
    data = yaml.safe_load(four.read_text())
    data["schedule"][1].remove("W5")
    four.write_text(yaml.safe_dump(data))
    base = {"stages": 4, "micro_batches": 8, "expect_error": True}
    jobs = [
        {**base, "name": "zbb", "pipemorph": {"schedule": "zbb"}},
        {**base, "name": "three", "pipemorph": {"schedule": "plan", "plan_file": three}},
        {**base, "name": "missing_w5", "pipemorph": {"schedule": "plan", "plan_file": str(four)}},
        {**base, "name": "no_such_nic", "pipemorph": {"schedule": "zb", "delegation": {"interfaces": ["lo", "nic9"]}}},
    ]
    run = launch(4, jobs, tmp_path, timeout=180)
    assert run.returncode != 0
    for r in range(4):
        assert run.error("zbb", r) == (
            "ds_config pipemorph: schedule: Input should be '1f1b', 'zb', 'adaptive' or 'plan', got the string 'zbb'")
        assert run.error("three", r) == f"plan file {three} is for 3 stages but the job has 4 pipeline stages"
        assert run.error("missing_w5", r) == f"plan file {four} is invalid: stage 1: W5 is missing"
        assert run.error("no_such_nic", r).startswith(
            "ds_config pipemorph.delegation.interfaces names 'nic9', which does not exist on this host")
    assert not list(tmp_path.glob("*.pt")), "a job trained although its config is bad"


@pytest.mark.timeout(120)
def test_a_stage_that_starts_late_makes_its_neighbour_time_out_naming_rank_op_and_link(tmp_path):
    jobs = [{"name": "late", "stages": 2, "micro_batches": 2, "stall": {"rank": 0, "seconds": 4},
             "pipemorph": {"schedule": "zb", "timeout_s": 1, "delegation": {"mode": "off"}}}]
    run = launch(2, jobs, tmp_path, timeout=100)
    assert run.error("late", 1) == "rank 1: timed out after 1 s waiting for RECV_F0 on link 0 from stage 0"
    # gloo closes a link whose wait timed out: the late rank then fails naming its op and link.
    assert run.error("late", 0).startswith("rank 0: RECV_B0 on link 0 from stage 1 failed: ")


# A DeepSpeed without the hooks the engine runs through: refused before any process group exists,
# naming the version needed (DeepSpeed 0.19.7's PipelineEngine builds its TrainSchedule inside
# train_batch; 0.19.8 asks self._train_schedule for it).
NEEDS = "ds_pipemorph needs DeepSpeed >= 0.19.8 (installed: {version}): its PipelineEngine lacks {what}, " \
        "so DeepSpeed's own 1F1B would train instead of the PipeMorph schedule"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["_train_schedule", "_exec_schedule", "_INSTRUCTION_MAP", "_reserve_pipe_buffers",
                                  "_next_batch", "_scale_loss_by_gas", "reset_activation_shape"])
def test_a_deepspeed_without_an_engine_hook_is_refused_before_the_process_group(monkeypatch, name):
    import deepspeed
    import torch.distributed
    from deepspeed.runtime.pipe.engine import PipelineEngine

    import ds_pipemorph
    from ds_pipemorph.runtime.ds_compat import UnsupportedDeepSpeedError

    owner = next(cls for cls in PipelineEngine.__mro__ if name in vars(cls))  # some live on DeepSpeedEngine
    monkeypatch.delattr(owner, name)
    with pytest.raises(UnsupportedDeepSpeedError) as e:
        ds_pipemorph.initialize(model=None, config={"pipemorph": {"schedule": "zb"}})
    assert str(e.value) == NEEDS.format(version=deepspeed.__version__, what=name)
    assert not torch.distributed.is_initialized()


@pytest.mark.timeout(60)
def test_a_train_batch_that_builds_its_own_1f1b_is_refused(monkeypatch):
    import deepspeed
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    import ds_pipemorph
    from ds_pipemorph.runtime.ds_compat import UnsupportedDeepSpeedError

    def train_batch(self, data_iter=None):  # DeepSpeed 0.19.7's shape: no _train_schedule hook
        sched = schedule.TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                       stage_id=self.stage_id)
        self._exec_schedule(sched)
        return self.agg_train_loss

    monkeypatch.setattr(PipelineEngine, "train_batch", train_batch)
    monkeypatch.delattr(PipelineEngine, "_train_schedule")
    with pytest.raises(UnsupportedDeepSpeedError) as e:
        ds_pipemorph.initialize(model=None, config={})
    what = "_train_schedule and a train_batch that calls _train_schedule"
    assert str(e.value) == NEEDS.format(version=deepspeed.__version__, what=what)


@pytest.mark.timeout(60)
def test_a_missing_reduction_handler_is_refused(monkeypatch):
    import deepspeed
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from ds_pipemorph.runtime.ds_compat import UnsupportedDeepSpeedError, require_pipeline_hooks

    handlers = {k: v for k, v in PipelineEngine._INSTRUCTION_MAP.items() if k is not schedule.ReduceGrads}
    monkeypatch.setattr(PipelineEngine, "_INSTRUCTION_MAP", handlers)
    with pytest.raises(UnsupportedDeepSpeedError) as e:
        require_pipeline_hooks()
    assert str(e.value) == NEEDS.format(version=deepspeed.__version__, what="a ReduceGrads handler in _INSTRUCTION_MAP")


def test_the_installed_deepspeed_has_every_hook_and_setup_asks_for_the_version_that_has_them():
    import re

    from ds_pipemorph.runtime.ds_compat import REQUIRED_DEEPSPEED, missing_hooks

    assert missing_hooks() == []
    setup = (REPO_ROOT / "setup.py").read_text()
    assert re.search(r'"deepspeed>=([\d.]+),', setup).group(1) == REQUIRED_DEEPSPEED == "0.19.8"
