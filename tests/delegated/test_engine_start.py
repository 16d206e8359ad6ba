"""The staging op is built (or loaded from the cache) when the engine starts if delegation can happen, not when
the first link goes delegated; one line says so when it really compiles, none when the cache holds it. With
delegation off it is never loaded. The fork server delegates come from (a process importing torch) starts
with the engine only when a link is delegated from the start: under "auto" with every link direct nothing
runs beside training."""
import json
import os
import sys
from pathlib import Path

import pytest

from ds_pipemorph.procs import run_group

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_auto_mode_loads_the_staging_op_at_engine_start(tmp_path):
    from ds_pipemorph.staging.builder import StagingRingBuilder, needs_build

    builds = needs_build(StagingRingBuilder())  # a fresh machine's first job compiles it; later ones load it
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(REPO / "tests" / "runtime" / "forkrun.py"), "2",
           str(HERE / "engine_start_worker.py"), str(tmp_path), "off", "auto", "always"]
    p = run_group(cmd, 840, cwd=REPO, env=env)
    output = p.stdout + p.stderr
    assert p.returncode == 0, output[-6000:]
    modes = ("off", "auto", "always")
    res = {(m, r): json.loads((tmp_path / f"{m}.rank{r}.json").read_text()) for m in modes for r in (0, 1)}

    def server(m, r, when):  # the fork server delegates come from, among the rank's child processes
        return [c for c in res[(m, r)][f"children_{when}"] if "forkserver" in c]

    for r in (0, 1):
        assert res[("off", r)]["loaded_at_start"] is False  # delegation off: the op is never needed
        assert res[("auto", r)]["loaded_at_start"] is True  # mapped before the first train_batch
        for m in ("off", "auto"):
            assert res[(m, r)]["delegated_sent"] == {}  # no link was slow: nothing went through delegates
            # ... and nothing ran beside training to be ready for delegates: no fork server importing torch
            assert server(m, r, "at_start") == server(m, r, "after") == [], res[(m, r)]
        # every link delegated from the start: the server runs before the first train_batch
        assert len(server("always", r, "at_start")) == 1, res[("always", r)]
        assert sum(res[("always", r)]["delegated_sent"].values()) > 0
    # Both modes trained the same model on the same data over direct links: same losses (stage 1 has them).
    assert res[("auto", 1)]["losses"] == res[("off", 1)]["losses"]
    lines = [ln for ln in output.splitlines() if "building the staging ring op" in ln]
    assert len(lines) == (1 if builds else 0), lines  # rank 0 only, only where delegation can happen
    if builds:
        assert "pipemorph_staging_cpu_" in lines[0] and "first start only" in lines[0]  # the CPU variant only
