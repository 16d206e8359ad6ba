"""`pipemorph bench` scenarios: slow-link sets (any link, several at once), delay traces and the §7.2 preset."""
import json

import pytest
import yaml
from typer.testing import CliRunner

from ds_pipemorph.bench.traces import RATES, make_trace, mean_delays, trace_text
from ds_pipemorph.plan.ir.links import DIRECT
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.inject.delays import DelayTraceFile, load_trace
from ds_pipemorph.runtime.plans import build_plan
from ds_pipemorph_cli.app import app
from ds_pipemorph.bench.scenarios import dynamic_traces, link_sets, scenarios_for, trace_scenarios

runner = CliRunner()


def test_link_sets_take_any_link_and_several_at_once():
    assert link_sets(4, None, None) == [[0]]
    assert link_sets(4, [0], None) == [[0]]
    assert link_sets(4, [0, -1], None) == [[0, 2]]  # --link 0 --link -1: one set, both slow at once
    assert link_sets(4, None, ["0", "-1", "0,-1", "2"]) == [[0], [2], [0, 2]]  # one group per --links


def test_scenarios_put_the_delay_on_every_link_of_a_set_and_one_no_delay():
    scs = scenarios_for(4, [0, 30], [[0], [2], [0, 2]])
    assert [(s.name, s.links_ms) for s in scs] == [
        ("no_delay", [0, 0, 0]), ("30ms_link0", [30, 0, 0]), ("30ms_link2", [0, 0, 30]),
        ("30ms_links0+2", [30, 0, 30])]


def test_trace_scenarios_plan_for_the_time_weighted_mean(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump({"points": [{"t": 0.0, "links_ms": [0, 10]}, {"t": 1.0, "links_ms": [0, 40]},
                                            {"t": 4.0, "links_ms": [0, 0]}]}))
    (sc,) = trace_scenarios(3, [p])
    assert sc.name == "t" and sc.trace == str(p.resolve())
    assert sc.links_ms == [0.0, 32.5]  # (1 s x 10 + 3 s x 40) / 4 s
    assert mean_delays(load_trace(str(p), 2), until_s=2.0) == [0.0, 25.0]


def test_dynamic_preset_writes_the_three_paper_traces_with_a_fixed_seed(tmp_path):
    paths = dynamic_traces(tmp_path, 3, 4, 4.0, rounds=3)
    assert [p.name for p in paths] == ["dynamic_A.yaml", "dynamic_B.yaml", "dynamic_C.yaml"]
    for p, (rate, (a, b)) in zip(paths, RATES.items()):
        tr = load_trace(str(p), 2)
        assert tr.points[-1].t >= 10 - b / 1000  # at least 10 s (runs longer than that keep the last delays)
        for link in (0, 1):
            changes = [q.t for q, prev in zip(tr.points[1:], tr.points) if q.links_ms[link] != prev.links_ms[link]]
            gaps = [y - x for x, y in zip(changes, changes[1:])]
            assert min(gaps) >= a / 1000 - 1e-3 and max(gaps) <= 2 * b / 1000  # U(a, b) ms (a repeat may join two)
        assert 25 <= statistics_mean(mean_delays(tr)) <= 35  # N(30, 10) ms on every link
    again = dynamic_traces(tmp_path / "again", 3, 4, 4.0, rounds=3)
    assert [p.read_text() for p in again] == [p.read_text() for p in paths]


def statistics_mean(xs):
    return sum(xs) / len(xs)


def test_trace_text_round_trips_through_the_injector_model(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text(trace_text(make_trace(2, [1], 2.0, RATES["A"], seed=1), "a test"))
    assert p.read_text().startswith("# a test\n")
    assert isinstance(load_trace(str(p), 2), DelayTraceFile)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--link", "0", "--links", "1"], "--link and --links: give one of them"),
        (["--stages", "3", "--links", "0,x"], "--links: 'x' is not a link index"),
        (["--stages", "3", "--link", "-3"], "--link: -3 is not a link of 3 stages"),
        (["--trace", "nope.yaml"], "--trace: cannot read 'nope.yaml'"),
        (["--dynamic", "--delays-ms", "30"], "--trace/--dynamic replace the static delays"),
        (["--dynamic", "--schedules", "zb,zbb"], "--schedules: unknown schedule 'zbb'"),
    ],
)
def test_bad_scenario_options_get_one_sentence_exit_2_and_write_nothing(tmp_path, args, needle):
    out = tmp_path / "o" / "b.json"
    r = runner.invoke(app, ["bench", *args, "--out", str(out)])
    assert r.exit_code == 2 and needle in r.output, r.output
    assert not (tmp_path / "o").exists()  # not even --dynamic's traces


def test_a_trace_for_another_pipeline_is_refused(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text(trace_text(make_trace(3, [2], 1.0, RATES["A"]), "3 links"))
    r = runner.invoke(app, ["bench", "--stages", "3", "--trace", str(p), "--out", str(tmp_path / "b.json")])
    assert r.exit_code == 2 and "has 3 delays, the job has 2 links" in r.output


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_row_runs_under_the_trace_and_the_table_gives_ratios_to_pipemorph(tmp_path):
    trace = tmp_path / "slow.yaml"  # 2 stages, the link N(12, 4) ms changed every U(50, 100) ms
    trace.write_text(trace_text(make_trace(1, [0], 30.0, RATES["A"], mean_ms=12, sd_ms=4, seed=0), "test"))
    out = tmp_path / "bench.json"
    r = runner.invoke(app, ["bench", "--stages", "2", "--microbatches", "4", "--op-ms", "4", "--trace", str(trace),
                            "--iterations", "2", "--warmup", "2", "--schedules", "stock-1f1b,zb,pipemorph",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    rows = {x["schedule"]: x for x in res["results"]}
    assert set(rows) == {"stock-1f1b", "zb", "pipemorph"}
    mean = mean_delays(load_trace(str(trace), 1))
    for x in rows.values():
        assert x["scenario"] == "slow" and x["trace"] == str(trace.resolve()) and x["links_ms"] == mean
        # 4 micro-batches of F+B+W = 12 ms, plus a link of about 12 ms that every row waits for.
        assert x["mean_ms"] >= 4 * 12 + 8 and x["trace_skew_s"] == 0.0
    ratios = res["ratios"]["slow"]
    assert ratios["pipemorph"] == 1.0
    assert ratios["stock-1f1b"] == pytest.approx(rows["stock-1f1b"]["mean_ms"] / rows["pipemorph"]["mean_ms"], abs=1e-3)
    oh = rows["pipemorph"]["profiler_overhead"]  # the control loop's cost, in the PipeMorph row only
    assert oh["ms_per_iteration"] > 0 and 0 < oh["pct_of_iteration"] < 100
    assert "profiler_overhead" not in rows["zb"]
    assert "x / PipeMorph" in r.output and "stock 1F1B/PipeMorph" in r.output and "static zb/PipeMorph" in r.output
    assert "profiler and control loop cost" in r.output


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_slow_links_at_once_and_the_predicted_column_uses_them(tmp_path):
    out = tmp_path / "bench.json"
    r = runner.invoke(app, ["bench", "--stages", "3", "--microbatches", "4", "--op-ms", "4", "--delays-ms", "10",
                            "--link", "0", "--link", "-1", "--iterations", "2", "--warmup", "1",
                            "--schedules", "zb", "--out", str(out)])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(out.read_text())["results"]
    assert row["scenario"] == "10ms_links0+1" and row["links_ms"] == [10.0, 10.0]
    zb_plan = build_plan(parse_config({"schedule": "zb"}), 3, 4)  # the static zb row's plan, under both delays
    both = replay(zb_plan, Costs.uniform(3, 4.0, [10, 10]), 4, link_model=DIRECT).iteration_ms
    assert row["predicted_ms"] == pytest.approx(both)
    assert both > replay(zb_plan, Costs.uniform(3, 4.0, [10, 0]), 4, link_model=DIRECT).iteration_ms
    assert row["median_ms"] >= 0.9 * both  # both links were slow in the run, too
    assert "10ms_links0+1" in r.output


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dynamic_runs_the_three_paper_cases_in_one_command(tmp_path):
    out = tmp_path / "res" / "bench.json"
    r = runner.invoke(app, ["bench", "--dynamic", "--stages", "2", "--microbatches", "4", "--op-ms", "4",
                            "--iterations", "1", "--warmup", "1", "--schedules", "zb,pipemorph", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert [x["scenario"] for x in res["results"]] == [s for s in ("dynamic_A", "dynamic_B", "dynamic_C")
                                                        for _ in range(2)]
    assert sorted(p.name for p in (tmp_path / "res").glob("dynamic_*.yaml")) == [
        "dynamic_A.yaml", "dynamic_B.yaml", "dynamic_C.yaml"]
    assert set(res["ratios"]) == {"dynamic_A", "dynamic_B", "dynamic_C"}
    assert all(25 <= x["links_ms"][0] <= 35 for x in res["results"])
