"""Long searches show progress on a terminal and stay quiet elsewhere (rich's default)."""
import pytest

from cli_helpers import run, write

# Uneven stages, two slow links and tight caps: no plan reaches the lower bound, so the search
# takes its whole budget (a search that proves its plan best early ends before a bar is drawn).
PROFILE = {"stages": 6, "microbatches": 24, "links_ms": [0, 25, 0, 40, 5],
           "compute_ms": {"forward": [10, 13, 9, 11, 10, 14], "backward_input": [11, 12, 10, 9, 13, 12],
                          "backward_weight": [7, 9, 8, 6, 9, 8]},
           "memory": {"max_inflight": [6, 5, 4, 3, 2, 2]}}
SHOWN = "searching plans for 6 stages x 24 micro-batches (budget 2.5 s)"


@pytest.mark.timeout(120)
def test_plan_with_a_long_budget_shows_a_bar_on_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # what rich takes for a terminal
    r = run("plan", write(tmp_path, "p.yaml", PROFILE), "--budget", "2.5")
    assert r.exit_code == 0, r.output
    assert SHOWN in r.stdout and "predicted iteration" in r.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tty,budget", [("0", "2.5"), ("1", "0.5")])
def test_no_bar_off_a_terminal_or_for_a_short_budget(tmp_path, monkeypatch, tty, budget):
    monkeypatch.setenv("TTY_COMPATIBLE", tty)
    r = run("plan", write(tmp_path, "p.yaml", PROFILE), "--budget", budget)
    assert r.exit_code == 0, r.output
    assert "searching plans" not in r.stdout and "predicted iteration" in r.stdout
