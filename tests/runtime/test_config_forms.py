"""Under the deepspeed launcher on CPU: ``ds_pipemorph.initialize`` trains from every config form
``deepspeed.initialize`` accepts, exactly alike, and gives each rank its share of the cores as
intra-op threads when ``OMP_NUM_THREADS`` is unset."""
from __future__ import annotations

import json
import os
import sys

import pytest

from ds_pipemorph.procs import free_port, run_group

from .launch import HERE, REPO


@pytest.mark.timeout(400)
def test_every_config_form_trains_alike_under_the_deepspeed_launcher_with_one_thread_share_per_rank(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(HERE / "config_forms_worker.py"), str(tmp_path)]
    p = run_group(cmd, 380, cwd=REPO, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cores = len(os.sched_getaffinity(0))
    for seen in ranks:
        reference = seen["dict"]["losses"]
        for form in ("path", "pathlike", "base64", "args"):
            assert seen[form]["losses"] == reference, form  # the same config, read five ways
            assert (seen[form]["gas"], seen[form]["schedule"]) == (4, "1f1b"), form
            assert seen[form]["threads"] == max(1, cores // 2), form
        # DeepSpeed itself, given the same base64 string, trains the same job (its own 1F1B).
        assert seen["stock"]["gas"] == 4 and seen["stock"]["schedule"] is None
        assert seen["stock"]["losses"] == pytest.approx(reference, rel=1e-5)
    # Rank 0 says so once (later engines in the same process change nothing), if the count changed.
    note = "OMP_NUM_THREADS is unset on a CPU accelerator: each of the 2 ranks on this host (LOCAL_SIZE) uses"
    assert (p.stdout + p.stderr).count(note) == (1 if max(1, cores // 2) != cores else 0)
