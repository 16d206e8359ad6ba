"""Bad settings fail at start-up on every rank with one sentence, before any training step;
a peer that never answers fails with a message naming the rank, the op, the link and the peer."""
from __future__ import annotations

import pytest
import yaml

from ds_pipemorph.plan.baselines import zb_h1
from ds_pipemorph.plan.profile import Costs

from .launch import launch
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
            "ds_config pipemorph: schedule: Input should be '1f1b', 'zb', 'adaptive' or 'plan'")
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
