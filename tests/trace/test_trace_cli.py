"""`pipemorph trace inspect|compare` through Typer's CliRunner: tables, JSON, Chrome/Gantt outputs, bad input.

On hand-written nsys rows (``nsys_rows.py``); ``tests/nvtx`` runs `trace inspect` on a real job's capture.
"""
import json
import sqlite3

import pytest
import yaml
from nsys_rows import START_END, Rows, three_stage, two_stage
from typer.testing import CliRunner

from ds_pipemorph.trace.measured_chrome import slices_nest_per_track

from ds_pipemorph_cli.app import app

pytestmark = pytest.mark.timeout(60)
runner = CliRunner()

PLAN = {
    "version": 1,
    "stages": 2,
    "microbatches": 2,
    "warmup": [2, 1],
    "schedule": [["F0", "F1", "B0", "W0", "B1", "W1"], ["F0", "B0", "F1", "B1", "W0", "W1"]],
    "profile": {
        "stages": 2,
        "microbatches": 2,
        "compute_ms": {"forward": [10, 10], "backward_input": [10, 10], "backward_weight": [10, 10]},
        "links_ms": [0],
        "memory": {"max_inflight": [2, 1]},
    },
}


def run(*args):
    return runner.invoke(app, ["trace", *[str(a) for a in args]])


def one_error_line(r, *fragments):
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def write_plan(tmp_path, **changes):
    p = tmp_path / "plan.yaml"
    p.write_text(yaml.safe_dump({**PLAN, **changes}))
    return p


# ------------------------------------------------------------------------------------------ inspect


def test_inspect_prints_rank_and_link_tables(tmp_path):
    r = run("inspect", two_stage(tmp_path / "r.sqlite"))
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "2 ranks, 2 stages, iterations [0, 1]" in " ".join(out.split())  # rich wraps a long path's line
    # rank, stage, iterations, mean, median, bubble rate, send-blocked, recv-blocked
    assert "│    0 │     0 │          2 │         87.5 │           87.5 │       31.4% │             4.0 │            18.0 │" in out
    assert "│    1 │     1 │          2 │         87.5 │           87.5 │       31.4% │             7.0 │            14.0 │" in out
    # The pipeline spans its ranks' ITER ranges, 85 and 90 ms; bubble (25/85 + 30/90) / 2 = 31.4 %.
    assert "pipeline: iteration mean 87.5 ms, median 87.5 ms, bubble rate 31.4%" in out
    assert "│    0 │    0-1 │              5.00 │        8 │" in out


def test_inspect_json_and_warnings_on_stderr(tmp_path):
    r = run("inspect", three_stage(tmp_path / "r.sqlite"), "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert [ln["link"] for ln in obj["links"]] == [1, 0]
    assert [ln["median_ms"] for ln in obj["links"]] == [6.0, 2.5]
    assert [x["iteration_ms"]["mean"] for x in obj["ranks"]] == [73.0, 62.0, 42.0]
    assert obj["pipeline"]["iteration_ms"]["mean"] == 73.0
    assert r.stderr.startswith("warning: no stage category")


def test_inspect_chrome_is_a_valid_trace_with_matched_flows(tmp_path):
    out = tmp_path / "t.json"
    r = run("inspect", two_stage(tmp_path / "r.sqlite"), "--chrome", out)
    assert r.exit_code == 0, r.output
    trace = json.loads(out.read_text())
    ev = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 1)"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads[(0, 0)] == "compute" and threads[(0, 1)] == "sends" and threads[(0, 2)] == "receives"
    assert threads[(0, 3)] == "iterations"
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in ev if e["ph"] == "X")
    assert slices_nest_per_track(ev)
    x = [e for e in ev if e["ph"] == "X"]
    assert {e["name"] for e in x if e["tid"] == 0} == {"F0", "F1", "B0", "B1", "W0", "W1"}
    assert all(e["name"].startswith("SEND_") for e in x if e["tid"] == 1)
    f3 = next(e for e in x if e["pid"] == 1 and e["name"] == "F1" and e["args"]["iteration"] == 1)
    assert f3["ts"] == 139000.0 and f3["dur"] == 10000.0 and f3["args"] == {"stage": 1, "microbatch": 1, "iteration": 1}
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    finishes = {e["id"]: e for e in ev if e["ph"] == "f"}
    assert len(starts) == 8 and starts.keys() == finishes.keys()
    assert all(f["bp"] == "e" for f in finishes.values())
    for i, s in starts.items():
        f = finishes[i]
        send = next(e for e in x if e["pid"] == s["pid"] and e["tid"] == s["tid"] and e["ts"] == s["ts"])
        recv = next(e for e in x if e["pid"] == f["pid"] and e["tid"] == f["tid"] and e["ts"] == f["ts"])
        assert send["name"].startswith("SEND_") and recv["name"] == "RECV_" + send["name"][5:]
        assert send["args"]["iteration"] == recv["args"]["iteration"] and s["pid"] != f["pid"]


def test_overlapping_ranges_on_one_track_go_to_separate_lanes(tmp_path):
    db = Rows(tmp_path / "r.sqlite", registered=False)
    for pid, rows in ((100, [("F0", 0, 10), ("SEND_F0", 10, 20), ("F1", 11, 15), ("SEND_F1", 15, 25)]),
                      (101, [("RECV_F0", 0, 21), ("F0", 21, 30), ("RECV_F1", 30, 31), ("F1", 31, 40)])):
        db.domain(pid, 1)
        db.category(pid, 1, 1, f"stage{pid - 100}")
        for name, a, b in rows:
            db.range(pid, 1, name, a, b, category=1, event_type=START_END)
    out = tmp_path / "t.json"
    r = run("inspect", db.close(), "--chrome", out)
    assert r.exit_code == 0, r.output
    ev = json.loads(out.read_text())["traceEvents"]
    assert slices_nest_per_track(ev)
    sends = {e["name"]: e["tid"] for e in ev if e["ph"] == "X" and e["pid"] == 0 and e["name"].startswith("SEND")}
    assert sends == {"SEND_F0": 1, "SEND_F1": 5}


def test_inspect_gantt_writes_a_png_of_the_chosen_iteration(tmp_path):
    png = tmp_path / "g.png"
    r = run("inspect", two_stage(tmp_path / "r.sqlite"), "--gantt", png, "--iteration", "0")
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_writes_a_pdf_gantt_and_the_chrome_trace_and_says_so(tmp_path):
    pdf, chrome = tmp_path / "g.pdf", tmp_path / "t.json"
    r = run("inspect", two_stage(tmp_path / "r.sqlite"), "--gantt", pdf, "--chrome", chrome)
    assert r.exit_code == 0, r.output
    assert pdf.read_bytes().startswith(b"%PDF") and json.loads(chrome.read_text())["traceEvents"]
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("wrote ")] == [f"wrote {chrome}", f"wrote {pdf}"]
    r = run("inspect", two_stage(tmp_path / "r2.sqlite"), "--json", "--chrome", tmp_path / "t2.json")
    assert json.loads(r.stdout)["pipeline"] and r.stderr.strip() == f"wrote {tmp_path / 't2.json'}"


def test_chrome_output_reads_back_with_the_same_figures(tmp_path):
    out = tmp_path / "t.json"
    assert run("inspect", two_stage(tmp_path / "r.sqlite"), "--chrome", out).exit_code == 0
    a = json.loads(run("inspect", two_stage(tmp_path / "r2.sqlite"), "--json").stdout)
    b = json.loads(run("inspect", out, "--json").stdout)
    for key in ("iterations", "pipeline", "links"):
        assert a[key] == b[key]
    assert [x["per_iteration"] for x in a["ranks"]] == [x["per_iteration"] for x in b["ranks"]]


def test_inspect_bad_inputs_are_one_line_with_exit_2_and_write_nothing(tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "g.png"
    one_error_line(run("inspect", tmp_path / "missing.sqlite", "--chrome", out), "missing.sqlite: no such file")
    text = tmp_path / "x.sqlite"
    text.write_text("not a database")
    one_error_line(run("inspect", text, "--chrome", out), "neither an Nsight Systems SQLite export nor a Chrome trace JSON")
    empty = tmp_path / "e.sqlite"
    con = sqlite3.connect(empty)
    con.execute("CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)")
    con.commit()
    con.close()
    one_error_line(run("inspect", empty, "--chrome", out), "e.sqlite: no NVTX_EVENTS table")
    notrace = tmp_path / "n.json"
    notrace.write_text('{"hello": 1}')
    one_error_line(run("inspect", notrace, "--chrome", out), "n.json: not a Chrome trace")
    one_error_line(run("inspect", two_stage(tmp_path / "r.sqlite"), "--chrome", out, "--gantt", png, "--iteration", "7"),
                   "no iteration 7; the trace holds iterations 0, 1")
    assert not out.exists() and not png.exists()


# ------------------------------------------------------------------------------------------ compare


def test_compare_json_reports_offsets_lateness_and_no_divergence(tmp_path):
    r = run("compare", write_plan(tmp_path), two_stage(tmp_path / "r.sqlite"), "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["iteration"] == 1 and obj["planned_iteration_ms"] == 70.0 and obj["measured_iteration_ms"] == 82.0
    ops = {(o["rank"], o["op"]): o for o in obj["ops"]}
    assert ops[(0, "B0")] == {"rank": 0, "stage": 0, "op": "B0", "planned_start_ms": 30.0, "planned_ms": 10.0,
                              "measured_start_ms": 40.0, "measured_ms": 10.0, "late_ms": 10.0}
    assert ops[(1, "F1")]["planned_start_ms"] == 30.0 and ops[(1, "F1")]["measured_start_ms"] == 39.0
    assert obj["divergences"] == []
    late = {x["rank"]: x for x in obj["lateness"]}
    assert late[0]["mean_ms"] == pytest.approx(46 / 6, abs=1e-9) and late[0]["worst_ms"] == 12.0 and late[0]["worst_op"] == "B1"
    assert late[1]["mean_ms"] == pytest.approx(46 / 6, abs=1e-9) and late[1]["worst_ms"] == 11.0 and late[1]["worst_op"] == "W0"


def test_compare_names_the_first_divergent_op_and_reads_chrome_timelines(tmp_path):
    chrome = tmp_path / "t.json"
    assert run("inspect", two_stage(tmp_path / "r.sqlite"), "--chrome", chrome).exit_code == 0
    plan = write_plan(tmp_path, schedule=[PLAN["schedule"][0], ["F0", "B0", "F1", "W0", "B1", "W1"]])
    r = run("compare", plan, chrome, "--iteration", "0")
    assert r.exit_code == 0, r.output
    assert "rank 1 (stage 1): order diverges at position 3: planned W0, measured B1" in r.stdout
    assert "iteration 0: planned 80.0 ms, measured 82.0 ms" in r.stdout
    r = run("compare", write_plan(tmp_path), chrome)
    assert "measured order = planned order on every rank" in r.stdout
    assert "│    0 │     0 │ B1 │          50.0 │           62.0 │    12.0 │       10.0 │        10.0 │" in r.stdout


def test_compare_against_the_planners_own_simulated_trace_is_on_time(tmp_path):
    plan, sim = write_plan(tmp_path), tmp_path / "sim.json"
    r = runner.invoke(app, ["simulate", str(plan), "--compare", "", "--chrome", str(sim)])
    assert r.exit_code == 0, r.output
    r = run("compare", plan, sim, "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["iteration"] == 0 and obj["measured_iteration_ms"] == obj["planned_iteration_ms"] == 70.0
    assert obj["divergences"] == [] and len(obj["ops"]) == 12
    assert all(o["late_ms"] == 0.0 and o["measured_ms"] == o["planned_ms"] for o in obj["ops"])


def test_compare_bad_inputs_are_one_line_with_exit_2(tmp_path):
    trace = two_stage(tmp_path / "r.sqlite")
    one_error_line(run("compare", tmp_path / "nope.yaml", trace), "nope.yaml: no such file")
    one_error_line(run("compare", write_plan(tmp_path), tmp_path / "nope.sqlite"), "nope.sqlite: no such file")
    three = {
        "stages": 3, "warmup": [2, 2, 1],
        "schedule": [["F0", "F1", "B0", "W0", "B1", "W1"], ["F0", "F1", "B0", "W0", "B1", "W1"], ["F0", "B0", "F1", "B1", "W0", "W1"]],
        "profile": {**PLAN["profile"], "stages": 3, "links_ms": [0, 0],
                    "compute_ms": {"forward": [10] * 3, "backward_input": [10] * 3, "backward_weight": [10] * 3},
                    "memory": {"max_inflight": [2, 2, 1]}},
    }
    one_error_line(run("compare", write_plan(tmp_path, **three), trace), "is a plan for 3 stages but", "holds 2")
    one_error_line(run("compare", write_plan(tmp_path, profile=None), trace), "carries no profile")
    nvtx_less = tmp_path / "n.sqlite"
    con = sqlite3.connect(nvtx_less)
    con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, text TEXT,"
                " globalTid INTEGER, textId INTEGER, domainId INTEGER, category INTEGER)")
    con.commit()
    con.close()
    one_error_line(run("compare", write_plan(tmp_path), nvtx_less), "no NVTX ranges in domain 'pipemorph'")
    notrace = tmp_path / "x.json"
    notrace.write_text("[1, 2]")
    one_error_line(run("compare", write_plan(tmp_path), notrace), "not a Chrome trace")
