"""Long searches show progress on a terminal and stay quiet elsewhere (rich's default).

Each case is its own process: rich decides at start-up whether its console is interactive.
"""
import os
import subprocess
import sys

import pytest

from cli_helpers import write

# Uneven stages, two slow links and tight caps: no plan reaches the lower bound, so the search
# takes its whole budget (a search that proves its plan best early ends before a bar is drawn).
PROFILE = {"stages": 6, "microbatches": 24, "links_ms": [0, 25, 0, 40, 5],
           "compute_ms": {"forward": [10, 13, 9, 11, 10, 14], "backward_input": [11, 12, 10, 9, 13, 12],
                          "backward_weight": [7, 9, 8, 6, 9, 8]},
           "memory": {"max_inflight": [6, 5, 4, 3, 2, 2]}}
SHOWN = "searching plans for 6 stages x 24 micro-batches (budget 2.5 s)"


def plan(tmp_path, tty: str, budget: str) -> subprocess.CompletedProcess:
    # TTY_COMPATIBLE=1: what rich takes for a terminal; 0: never one.
    env = {**os.environ, "TTY_COMPATIBLE": tty, "COLUMNS": "200"}
    p = subprocess.run([sys.executable, "-m", "ds_pipemorph_cli.app", "plan", str(write(tmp_path, "p.yaml", PROFILE)),
                        "--budget", budget], capture_output=True, text=True, env=env, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "predicted iteration" in p.stdout
    return p


@pytest.mark.timeout(120)
def test_plan_with_a_long_budget_shows_a_bar_on_a_terminal(tmp_path):
    assert SHOWN in plan(tmp_path, "1", "2.5").stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tty,budget", [("0", "2.5"), ("1", "0.5")])
def test_no_bar_off_a_terminal_or_for_a_short_budget(tmp_path, tty, budget):
    assert "searching plans" not in plan(tmp_path, tty, budget).stdout
