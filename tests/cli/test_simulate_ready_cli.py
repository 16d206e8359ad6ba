"""`pipemorph simulate --dispatch/--vary/--link-trace` through Typer's CliRunner: hand-worked
timelines, the paper's Fig. 5 numbers through a trace file, and one-sentence errors with exit 2."""
import json

import pytest
import yaml

from cli_helpers import run



def write(path, data):
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def small_plan(tmp_path, schedule, links_ms, name="plan.yaml"):
    """A hand-written 2-stage plan whose ops all take 1 ms under its profile."""
    n = len(schedule[0]) // 3
    return write(tmp_path / name, {
        "version": 1, "stages": 2, "microbatches": n,
        "warmup": [next(i for i, op in enumerate(row) if op.startswith("B")) for row in schedule],
        "schedule": schedule,
        "profile": {"stages": 2, "microbatches": n, "links_ms": links_ms,
                    "compute_ms": {"forward": 1, "backward_input": 1, "backward_weight": 1}},
    })


@pytest.fixture
def overtaking(tmp_path):
    """F1 on stage 1 takes 5 ms (table file). Ordered: stage 0 waits for B1's gradient (at 9)
    before W0: F0 0-1, F1 1-2, B0 3-4, B1 9-10, W0 10-11, W1 11-12 -> 12 ms. Ready: W0 runs 4-5
    while it waits, then B1 9-10, W1 10-11 -> 11 ms (stage 1 ends at 11 under both rules)."""
    plan = small_plan(tmp_path, [["F0", "F1", "B0", "B1", "W0", "W1"], ["F0", "B0", "F1", "B1", "W0", "W1"]], [0])
    table = write(tmp_path / "times.yaml", {"forward": [1, [1, 5]]})
    return plan, table


def test_ready_dispatch_json_gives_both_times(overtaking):
    plan, table = overtaking
    r = run("simulate", plan, "--dispatch", "ready", "--vary", f"table:{table}", "--compare", "", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.output)
    assert obj["dispatch"] == "ready"
    assert obj["ordered_ms"] == 12.0 and obj["ready_ms"] == 11.0 and obj["iteration_ms"] == 11.0
    assert obj["ready_caps"] == [2, 1]  # the plan's own peak of activations per stage
    assert obj["vary"] == f"table:{table}" and obj["link_trace"] is None
    r = run("simulate", plan, "--vary", f"table:{table}", "--compare", "", "--json")
    obj = json.loads(r.output)
    assert obj["dispatch"] == "ordered" and obj["iteration_ms"] == obj["ordered_ms"] == 12.0
    assert obj["ready_ms"] is None


def test_ready_dispatch_table_lists_the_plan_under_both_rules(overtaking):
    plan, table = overtaking
    r = run("simulate", plan, "--dispatch", "ready", "--vary", str(table), "--compare", "1f1b")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    plan_row = next(x for x in lines if "plan " in x and "ready" not in x and "12.0" in x)
    ready_row = next(x for x in lines if "plan, ready dispatch" in x)
    assert "11.0" in ready_row and "0.92x" in ready_row and "1.00x" in plan_row
    assert any("1f1b" in x for x in lines)
    assert "ready dispatch: 11.0 ms against 12.0 ms in the plan's order" in r.output


def test_jitter_spec_runs_and_zero_spread_changes_nothing(tmp_path):
    profile = write(tmp_path / "p.yaml", {
        "stages": 4, "microbatches": 12, "links_ms": [0, 0, 0], "memory": {"max_inflight": [7, 5, 3, 1]},
        "compute_ms": {"forward": 10, "backward_input": 10, "backward_weight": 10}})
    plan = tmp_path / "plan.yaml"
    assert run("plan", profile, "-o", plan, "--greedy").exit_code == 0
    r = run("simulate", plan, "--dispatch", "ready", "--vary", "jitter:0,seed=1", "--json")
    obj = json.loads(r.output)
    assert obj["ordered_ms"] == 390.0  # the paper's Fig. 4 ZB time
    assert set(obj["compare"]) == {"1f1b", "zb-h1", "gpipe"}
    a = json.loads(run("simulate", plan, "--dispatch", "ready", "--vary", "jitter:0.3,seed=1", "--json").output)
    b = json.loads(run("simulate", plan, "--dispatch", "ready", "--vary", "jitter:0.3,seed=1", "--json").output)
    assert a == b and a["ordered_ms"] != 390.0 and a["ready_ms"] > 0
    # Fig. 5: 20 ms on link 0 from the start, given as a trace, is --links-ms 20,0,0
    trace = write(tmp_path / "tr.yaml", {"points": [{"t": 0.0, "links_ms": [20, 0, 0]}]})
    obj = json.loads(run("simulate", plan, "--link-trace", trace, "--compare", "", "--json").output)
    assert obj["iteration_ms"] == 440.0 and obj["link_trace"] == str(trace) and obj["links_ms"] is None


def test_link_trace_delay_is_taken_when_a_message_departs(tmp_path):
    """Link 0 is 0 ms, then 10 ms from t = 1 ms: F0 leaves stage 0 at 1 and arrives at 11; stage 1
    runs 11-14 and its gradient leaves at 13, arriving at 23; stage 0 ends B0, W0 at 25 ms."""
    plan = small_plan(tmp_path, [["F0", "B0", "W0"], ["F0", "B0", "W0"]], [0])
    trace = write(tmp_path / "tr.json", json.dumps({"points": [{"t": 0, "links_ms": [0]}, {"t": 0.001, "links_ms": [10]}]}))
    for how in ("ordered", "ready"):
        r = run("simulate", plan, "--dispatch", how, "--link-trace", trace, "--compare", "", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["iteration_ms"] == 25.0


def test_ready_timeline_goes_to_the_chrome_trace(overtaking, tmp_path):
    plan, table = overtaking
    out = tmp_path / "t.json"
    assert run("simulate", plan, "--dispatch", "ready", "--vary", str(table), "--chrome", out).exit_code == 0
    slices = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 2 * 2 * 3
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(11_000)


@pytest.mark.parametrize("args,needle", [
    (["--dispatch", "fast"], "--dispatch: 'fast' is not a dispatch rule; choose ordered or ready"),
    (["--vary", "wobble:1"], "is not a variation"),
    (["--vary", "jitter:2"], "spread is a fraction in [0, 1]"),
    (["--vary", "heavy:stages=3"], "stages=3 should be 1..2"),
    (["--vary", "table:nope.yaml"], "no such file"),
    (["--link-trace", "BAD_ORDER"], "times must not decrease"),
    (["--link-trace", "BAD_LINKS"], "has 2 delays, the pipeline has 1 links"),
    (["--link-trace", "nope.yaml"], "no such file"),
    (["--link-trace", "GOOD", "--links-ms", "5"], "give either --links-ms or --link-trace, not both"),
])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, args, needle):
    plan = small_plan(tmp_path, [["F0", "B0", "W0"], ["F0", "B0", "W0"]], [0])
    files = {
        "BAD_ORDER": {"points": [{"t": 1, "links_ms": [0]}, {"t": 0, "links_ms": [5]}]},
        "BAD_LINKS": {"points": [{"t": 0, "links_ms": [0, 5]}]},
        "GOOD": {"points": [{"t": 0, "links_ms": [5]}]},
    }
    args = [str(write(tmp_path / f"{a}.yaml", files[a])) if a in files else a for a in args]
    r = run("simulate", plan, *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert len(r.output.strip().splitlines()) == 1
