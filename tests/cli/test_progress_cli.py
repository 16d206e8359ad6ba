"""Long searches show progress on a terminal and stay quiet elsewhere (rich's default)."""
import pytest

from cli_helpers import run, write

PROFILE = {"stages": 4, "microbatches": 12, "compute_ms": 10, "links_ms": [0, 0, 20]}
SHOWN = "searching plans for 4 stages x 12 micro-batches (budget 2.5 s)"


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
