"""`pipemorph bench` / `pipemorph demo`: the real engines run side by side and the table is written."""
import json

import pytest
from typer.testing import CliRunner

from ds_pipemorph.bench.spec import BenchSpec, Scenario
from ds_pipemorph_cli.app import app

runner = CliRunner()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_runs_stock_zb_and_pipemorph_on_two_stages_with_a_slow_link(tmp_path):
    out = tmp_path / "bench.json"
    r = runner.invoke(app, ["bench", "--stages", "2", "--microbatches", "4", "--op-ms", "4", "--delays-ms", "0,12",
                            "--iterations", "2", "--warmup", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())["results"]
    assert {(x["scenario"], x["schedule"]) for x in res} == {
        (sc, s) for sc in ("no_delay", "12ms_link0") for s in ("stock-1f1b", "zb", "zb-delegated", "pipemorph")}
    for x in res:
        assert len(x["iterations_ms"]) == 2 and all(t > 0 for t in x["iterations_ms"])
        # Each iteration runs 4 micro-batches of F+B+W = 12 ms on every stage, at least.
        assert x["median_ms"] >= 4 * 12
    slow = {x["schedule"]: x for x in res if x["scenario"] == "12ms_link0"}
    # PipeMorph's plan, whatever its control loop chose, is predicted no slower than static zb's.
    assert slow["pipemorph"]["predicted_ms"] <= slow["zb"]["predicted_ms"]
    assert all(x["replans"] == [] for x in res if x["schedule"] != "pipemorph")
    assert "speedup vs stock" in r.output and r.output.rstrip().endswith(f"wrote {out}")
    # Not a terminal: no progress drawn (rich's default); 2 iterations per row is said once.
    assert "scenario 1/2" not in r.output
    assert r.output.count("note: only 2 measured iterations per row") == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_runs_stock_ordered_and_ready_dispatch_under_heavy_micro_batches(tmp_path):
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sim.variation import vary_tables

    out = tmp_path / "bench.json"
    vary = "heavy:frac=0.5,factor=3,stages=1,seed=4"
    r = runner.invoke(app, ["bench", "--stages", "2", "--microbatches", "4", "--op-ms", "4", "--delays-ms", "0",
                            "--iterations", "2", "--warmup", "1", "--schedules", "stock-1f1b,zb",
                            "--dispatch", "ordered,ready", "--vary", vary, "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())["results"]
    assert [(x["schedule"], x["dispatch"]) for x in res] == [
        ("stock-1f1b", "ordered"), ("zb", "ordered"), ("zb", "ready")]
    tables = vary_tables(vary, Costs.uniform(2, 4.0), 4)
    for x in res:
        for k, ms in enumerate(x["iterations_ms"], start=1):  # after one warm-up iteration
            # Stage 0 runs F, B and W of every micro-batch, each as long as iteration k's table says.
            busy = sum(tables(k)(0, kind, m) for kind in "FBW" for m in range(4))
            assert ms >= busy, (x["dispatch"], k, ms, busy)
        assert x["predicted_ms"] >= 4 * 12
    assert res[2]["choosing_us_per_op"] > 0 and "ordered / ready" in r.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--dispatch", "sideways"], "--dispatch: unknown dispatch 'sideways'"),
        (["--dispatch", "ordered,ordered"], "--dispatch: each value once"),
        (["--schedules", "zb", "--vary", "jitter"], "give the spread"),
        (["--stages", "4", "--link", "5"], "--link: 5 is not a link of 4 stages"),
        (["--delays-ms", "0,-3"], "--delays-ms: -3.0 is negative"),
        (["--delays-ms", "nan"], "--delays-ms: nan is not a finite number"),
        (["--schedules", "zbb"], "unknown schedule 'zbb'"),
        (["--budget", "0.5"], "--budget 0.5 leaves the last stage less than one micro-batch's activations"),
        (["--budget", "lots"], "--budget: expected a number such as 1.5, or none, not 'lots'"),
    ],
)
def test_bad_bench_options_get_one_sentence_and_exit_2(tmp_path, args, needle):
    r = runner.invoke(app, ["bench", *args, "--out", str(tmp_path / "b.json")])
    assert r.exit_code == 2 and needle in r.output
    assert not (tmp_path / "b.json").exists()


def test_spec_rejects_wrong_delay_counts():
    with pytest.raises(ValueError, match="2 delays for 3 links"):
        BenchSpec(stages=4, microbatches=4, op_ms=1, scenarios=[Scenario(name="x", links_ms=[0, 1])],
                  schedules=["zb"], iterations=1, warmup=0, progress_file="p", out="o")


@pytest.mark.parametrize("args", [["--iterations", "0"], ["--delay-ms", "-5"], ["--budget", "0"]])
def test_bad_demo_options_exit_2(tmp_path, args):
    r = runner.invoke(app, ["demo", *args, "--out", str(tmp_path / "d.json")])
    assert r.exit_code == 2 and not (tmp_path / "d.json").exists()
