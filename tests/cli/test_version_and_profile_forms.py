"""`pipemorph --version`, and the short profile forms README promises (`compute_ms: 10`)."""
import json
import subprocess
import sys

import pytest

from cli_helpers import run, write
from ds_pipemorph.version import __version__

LONG = {"stages": 4, "microbatches": 12, "links_ms": [0, 0, 20],
        "compute_ms": {"forward": [10] * 4, "backward_input": [10] * 4, "backward_weight": [10] * 4}}


def test_version_prints_the_package_version():
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"pipemorph {__version__}"
    # The console script too, and the version is the one ds_pipemorph/version.py holds.
    p = subprocess.run([sys.executable, "-m", "ds_pipemorph_cli.app", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"pipemorph {__version__}"
    assert __version__.count(".") == 2


@pytest.mark.parametrize("short", [10, 10.0, {"forward": 10, "backward_input": 10, "backward_weight": 10}])
def test_one_number_for_compute_ms_plans_as_the_per_stage_lists(tmp_path, short):
    long = run("plan", write(tmp_path, "long.yaml", LONG), "--json", "--greedy")
    brief = run("plan", write(tmp_path, "short.yaml", dict(LONG, compute_ms=short)), "--json", "--greedy")
    assert long.exit_code == 0 and brief.exit_code == 0, brief.output
    a, b = json.loads(long.stdout), json.loads(brief.stdout)
    assert a["schedule"] == b["schedule"] and a["predicted"] == b["predicted"]
    assert b["profile"]["compute_ms"]["forward"] == [10.0] * 4
    # Every stage runs 12 x (F + B + W) = 360 ms of work: no plan is shorter.
    assert b["predicted"]["iteration_ms"] >= 360


@pytest.mark.parametrize("bad", [True, "ten", -5])
def test_a_compute_ms_that_is_no_time_is_one_sentence(tmp_path, bad):
    r = run("plan", write(tmp_path, "p.yaml", dict(LONG, compute_ms=bad)))
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "compute_ms" in lines[0], r.stderr
