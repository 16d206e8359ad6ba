"""In-run re-mapping (``engine.remap``): ranks take new (stage, replica) coordinates at an
iteration boundary, and training goes on exactly as if they had not.

2 stages x 2 replicas on 4 ranks (a Linear/GELU stack with a tied layer, FusedAdam, gradient
clipping). DeepSpeed's default topology puts stage 0 on ranks 0 and 1; the new one
``ranks[stage][replica] = [[0, 2], [1, 3]]`` moves rank 1 to stage 1 and rank 2 to stage 0, so the
data-parallel groups, the pipelines and the tied-weight groups all change. Losses of every step and
every parameter (each replica's ranks together) must equal a run that never re-mapped within 1e-5.
"""
from __future__ import annotations

import pytest

from .launch import SHARED_CEILING, shared_jobs

TOL = 1e-5
PM = {"schedule": "zb", "timeout_s": 60}
NEW = [[0, 2], [1, 3]]


def _replica_params(run, name: str, ranks) -> dict:
    out = {}
    for r in ranks:
        out.update(run.result(name, r)["params"])
    return out


@shared_jobs("remap", timeout=460)  # run in the session's shared 4-rank launch
def _jobs(files) -> list[dict]:
    base = {"stages": 2, "dp": 2, "micro_batches": 4, "steps": 4, "tied": True, "pipemorph": PM}
    lost = {**PM, "rebalance": {"timeout_s": 3}, "inject": {"migration_drop": [0]}}
    jobs = [{**base, "name": "still"},
            {**base, "name": "remapped", "remap": {"2": NEW}},
            # layers moved first (10 layers: [0, 5, 10] -> [0, 3, 10]), then the ranks: the new engine
            # keeps the moved partition
            {**base, "name": "moved_then_remapped", "migrate": {"1": [0, 3, 10]}, "remap": {"2": NEW}},
            # the first attempt's state never arrives: every rank keeps its engine; the second one moves
            {**base, "name": "retried", "pipemorph": lost, "remap": {"1": NEW, "2": NEW}},
            # dropout with DeepSpeed's seed_layers (14 layers): the new ranks draw the same random numbers
            {**base, "name": "still_dropout", "dropout": 0.2},
            {**base, "name": "remapped_dropout", "dropout": 0.2, "remap": {"2": NEW}},
            # two optimizer groups (weights with decay), the config given as --deepspeed_config
            {**base, "name": "still_groups", "param_groups": True},
            {**base, "name": "remapped_groups", "param_groups": True, "config_via_args": True, "remap": {"2": NEW}},
            # 4 stages x 1 replica for a 2 x 2 job: refused on every rank before anything moved
            {**base, "name": "wrong_size", "steps": 2, "remap": {"1": [[0], [1], [2], [3]]}}]
    return jobs


@pytest.mark.timeout(SHARED_CEILING + 60)  # the first test to ask for the shared launch waits for all of it
def test_ranks_take_new_stages_and_train_as_if_they_had_not(shared4):
    run = shared4["remap"]
    moved = {1: 1, 2: 0}  # rank -> its new stage (ranks 0 and 3 keep theirs)
    for name in ("remapped", "moved_then_remapped", "retried", "remapped_dropout", "remapped_groups"):
        ref = {"remapped_dropout": "still_dropout", "remapped_groups": "still_groups"}.get(name, "still")
        for r in range(4):
            a, b = run.result(ref, r), run.result(name, r)
            assert b["losses"] == pytest.approx(a["losses"], abs=TOL), f"{name} rank {r}: losses differ"
            assert b["stage"] == moved.get(r, a["stage"]), f"{name} rank {r}: stage {b['stage']}"
            assert b["remaps"][-1]["ok"]
        still = _replica_params(run, ref, [0, 2])  # replica 0 before: ranks 0 (stage 0), 2 (stage 1)
        for replica in ([0, 1], [2, 3]):  # after: ranks 0 and 1 are replica 0, ranks 2 and 3 replica 1
            got = _replica_params(run, name, replica)
            assert got.keys() == still.keys()
            worst = max((got[k] - still[k]).abs().max().item() for k in got)
            assert worst <= TOL, f"{name} replica {replica}: parameters differ by {worst:g}"
    assert run.result("moved_then_remapped", 1)["parts"] == [0, 3, 10]
    # Rank 1 gave stage 0's state to rank 2 and got stage 1's from rank 2; ranks 0 and 3 moved nothing.
    r1 = run.result("remapped", 1)["remaps"][0]
    assert r1["sent"] > 0 and r1["received"] > 0 and run.result("remapped", 0)["remaps"][0]["sent"] == 0
    for r in range(4):
        first, second = run.result("retried", r)["remaps"]
        assert not first["ok"] and first["new"] == first["old"] and second["ok"]
        refused = run.result("wrong_size", r)
        assert refused["remaps"][0]["error"] == ("the new topology is 4 stages x 1 replicas; the job runs "
                                                 "2 x 2 on 4 ranks") and len(refused["losses"]) == 2
