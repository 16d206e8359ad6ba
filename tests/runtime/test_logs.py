"""What a training run says: rank 0 logs one start-up line (schedule, dispatch, plan, predicted
iteration time) and one line at every re-plan, migration and re-mapping; the other ranks say none.

One launch of 4 ranks (2 stages x 2 replicas), two jobs: a ``zb`` job that moves layers
[0, 5, 10] -> [0, 3, 10] after step 1 and re-maps its ranks to ``[[0, 2], [1, 3]]`` after step 2, then
an ``adaptive`` job with 40 ms injected on its one link, which re-plans while it trains. Each job's
lines are told apart by what they say: the start line names its schedule, and only the first job
migrates and re-maps, only the second re-plans.
"""
from __future__ import annotations

import re

import pytest

from .launch import launch

START = re.compile(r"^pipemorph: schedule '(\w+)' \(.*\), dispatch '(\w+)', plan for (\d+) stages x (\d+) "
                   r"micro-batches with warm-up \[([\d, ]+)\], predicted iteration ([\d.]+) ms", re.M)
MIGRATION = re.compile(r"^pipemorph: migration 0: moved layers \[3, 4\] \(\[0, 5, 10\] -> \[0, 3, 10\]\) in \d+ ms$",
                       re.M)
REMAP = re.compile(r"^pipemorph: re-mapping to ranks \[\[0, 2\], \[1, 3\]\] \(per stage, per replica\): done in \d+ ms$",
                   re.M)
REPLAN = re.compile(r"^pipemorph: after iteration (\d+) measured link delays .* predicted [\d.]+ ms$", re.M)


JOBS = [{"stages": 2, "dp": 2, "micro_batches": 4, "tied": True, "name": "moved_then_remapped", "steps": 3,
         "pipemorph": {"schedule": "zb", "timeout_s": 60}, "migrate": {"1": [0, 3, 10]},
         "remap": {"2": [[0, 2], [1, 3]]}},
        {"stages": 2, "dp": 2, "micro_batches": 4, "tied": True, "name": "replanned", "steps": 8,
         "pipemorph": {"schedule": "adaptive", "timeout_s": 60, "adapt": {"replan": "inline"},
                       "delegation": {"mode": "off"}, "inject": {"links": {"0": {"delay_ms": 40}}}}}]
TIMEOUT = 1800  # the two jobs' ceilings when each was a launch of its own (900 s each)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # Under torchrun, as a user starts ranks: the worker's jobs end as a script that simply returns.
    run = launch(4, JOBS, tmp_path_factory.mktemp("logs"), timeout=TIMEOUT, torchrun=True)
    assert run.returncode == 0, run.output[-4000:]
    # One start line per job, from rank 0: the re-mapping's new engine announces nothing.
    assert sorted(s[0] for s in START.findall(run.output)) == ["adaptive", "zb"], run.output[-4000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)  # the first test to ask for the launch waits for all of it
def test_rank_0_logs_the_start_the_migration_and_the_remapping_once(run):
    starts = [s for s in START.findall(run.output) if s[0] == "zb"]  # the first job's
    assert [s[:5] for s in starts] == [("zb", "ordered", "2", "4", "2, 1")], run.output[-4000:]  # ZB-H1: S - s
    # 4 micro-batches x (F + B + W) is 120 ms of work per stage at 10 ms an op, and the last stage cannot
    # start before the first F ends: >= 130 ms. 1F1B with a fused backward leaves one F + B + W of
    # bubble on 2 stages: no plan needs more than its 150 ms.
    assert 130.0 <= float(starts[0][5]) <= 150.0
    assert len(MIGRATION.findall(run.output)) == 1, run.output[-4000:]
    assert len(REMAP.findall(run.output)) == 1, run.output[-4000:]
    for r in range(4):
        assert run.result("moved_then_remapped", r)["remaps"][-1]["ok"]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)
def test_rank_0_logs_one_line_per_replan(run):
    starts = [s for s in START.findall(run.output) if s[0] == "adaptive"]  # the second job's
    assert [s[:4] for s in starts] == [("adaptive", "ordered", "2", "4")], run.output[-4000:]
    assert 130.0 <= float(starts[0][5]) <= 150.0  # as above: the same work, no slower than 1F1B
    replans = run.result("replanned", 0)["replans"]
    assert replans, "the 40 ms link was never re-planned for"
    assert [int(i) for i in REPLAN.findall(run.output)] == replans
