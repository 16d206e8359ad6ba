"""The control loop's profile export (``profile_out``) and its overhead report, on the real engine and
in isolation."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ds_pipemorph.fileio import load_model
from ds_pipemorph.plan.ir.profile import Profile
from ds_pipemorph.procs import run_group
from ds_pipemorph.runtime.config import PipeMorphConfigError, parse_config, pending_notes
from ds_pipemorph.runtime.overhead import OVERHEAD_FIELDS, OverheadBook
from ds_pipemorph.runtime.profile_export import ProfileExport
from ds_pipemorph_cli.app import app

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_profile_out_holds_the_measured_op_times_and_link_delays_and_plans(tmp_path):
    spec = {"iterations": 8, "op_ms": 6, "microbatches": 4, "links_ms": [0, 30]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(REPO / "tests" / "runtime" / "forkrun.py"), "3",
           str(HERE / "export_worker.py"), str(tmp_path / "spec.json"), str(tmp_path)]
    p = run_group(cmd, 170, cwd=REPO, env=env)
    log = p.stdout + p.stderr
    assert (tmp_path / "export.json").exists(), log[-4000:]
    res = json.loads((tmp_path / "export.json").read_text())
    assert res["replans"] and res["replans"][0]["target_ms"][1] >= 30  # the loop saw the slow link itself

    for name in ("profile.replan.yaml", "profile.yaml"):  # written at the re-plan, then at the end
        prof = load_model(tmp_path / name, Profile)
        assert prof.stages == 3 and prof.microbatches == 4
        # Emulated ops take 6 ms, link 1 carries 30 ms: a sleep wakes late, never early, so these are
        # lower bounds (a busy machine lengthens every time); link 1 is the slow one.
        for key in ("forward", "backward_input", "backward_weight"):
            assert all(v >= 5.0 for v in getattr(prof.compute_ms, key)), (name, prof.compute_ms)
        assert prof.links_ms[1] >= 24.0 and prof.links_ms[0] < prof.links_ms[1], (name, prof.links_ms)
        # What the first iteration measured, in MB; the default budget: stock 1F1B's S - s micro-batches.
        m = prof.memory
        assert all(a > 0 for a in m.activation_mb) and all(0 < w <= a for w, a in zip(m.weight_mb, m.activation_mb))
        assert m.capacity_mb == pytest.approx([(3 - s) * a for s, a in enumerate(m.activation_mb)], rel=1e-3)
        assert prof.caps() == [3, 2, 1]
    text = (tmp_path / "profile.yaml").read_text()
    assert text.startswith("# measured by the pipemorph control loop: end of training, after 8 iterations")
    assert not list(tmp_path.glob(".profile.yaml.*"))  # written atomically: no temporary left

    out = tmp_path / "plan.yaml"  # the exported profile is a valid input of `pipemorph plan`
    r = CliRunner().invoke(app, ["plan", str(tmp_path / "profile.yaml"), "-o", str(out), "--budget", "0.3"])
    assert r.exit_code == 0, r.output
    plan = yaml.safe_load(out.read_text())
    assert plan["profile"]["links_ms"] == prof.links_ms and plan["stages"] == 3

    # The overhead: the spans from the second exchange to the last, every part measured on every rank.
    oh, exchanges = res["overhead"], res["exchanges"]
    assert oh["exchanges"] == len(exchanges) - 2 and oh["iterations"] == exchanges[-1] - exchanges[1], exchanges
    assert 0 < oh["ms_per_iteration"] < oh["iteration_ms"] and 0 < oh["pct_of_iteration"] < 100
    assert oh["ms_per_iteration"] == pytest.approx(
        sum(v for k, v in oh["parts_ms"].items() if k != "sync"), rel=0.01)  # the costliest rank's parts
    # Link delays come from the op records (no probe crosses the 30 ms link); what the steady cost
    # comes to in milliseconds is measured by `pipemorph bench` (its overhead row), not bounded here.
    assert oh["steady_ms_per_iteration"] > 0
    assert oh["parts_ms"]["stamps"] > 0 and oh["stamp_ns_per_op"] > 0
    assert oh["replans"] == len(res["replans"]) and oh["max_ms"] >= oh["parts_ms"]["replan"] > 0
    assert all(o["links"] > 0 and o["exchange"] > 0 for o in res["own"])
    assert "pipemorph: profiler overhead" in log and "ms per iteration" in log  # rank 0's line at the end


def test_export_smooths_with_running_medians_and_refuses_before_any_measurement(tmp_path):
    ex = ProfileExport(2, 4, [4, 2])
    with pytest.raises(ValueError, match="nothing to export"):
        ex.profile()
    for d in (0.0, 31.0, 29.0, 300.0):  # one hiccup among the last three does not show
        ex.add([10, 11], [10, -1 if d == 300 else 12], [5, 5], [d])
    prof = ex.profile()
    assert prof.links_ms == [31.0]
    assert prof.compute_ms.forward == [10, 11] and prof.compute_ms.backward_input == [10, 12]
    ex.add([10, 11], [10, 12], [5, 5], [None])  # no probe: the previous values stay
    assert ex.profile().links_ms == [31.0]
    ex.write(str(tmp_path / "p.yaml"), "a test")
    assert load_model(tmp_path / "p.yaml", Profile).memory.max_inflight == [4, 2]


def test_profile_out_key_is_validated_and_named_when_it_would_not_be_written():
    assert parse_config({"profile_out": "out/p.yaml"}).profile_out == "out/p.yaml"
    with pytest.raises(PipeMorphConfigError, match="profile_out must be a file path"):
        parse_config({"profile_out": " "})
    with pytest.raises(PipeMorphConfigError, match="profile_out"):
        parse_config({"profile_out": 3})
    notes = pending_notes(parse_config({"schedule": "zb", "delegation": {"mode": "off"}, "profile_out": "p.yaml"}))
    assert notes == ["pipemorph.profile_out is written by the control loop, which runs with schedule 'adaptive' "
                     "and adapt.enabled only: p.yaml will not be written"]


def test_overhead_report_counts_the_costliest_rank_per_boundary_and_not_the_wait_for_the_last_rank():
    book = OverheadBook()
    n = len(OVERHEAD_FIELDS)

    def row(**parts):
        vals = [parts.get(k, 0.0) for k in OVERHEAD_FIELDS]
        return vals + [parts.get("period", 100.0), 1.0]  # one iteration per span: an exchange every iteration

    book.add(torch.tensor([row(links=99.0), row()]))  # the first boundary sets up the exchange: left out
    book.add(torch.tensor([row(links=1.0, exchange=3.0, sync=50.0), row(links=3.0, exchange=0.5, replan=2.0)]))
    book.add(torch.tensor([row(links=1.0, exchange=1.0, period=200.0), row(stats=1.0, period=190.0)]))
    r = book.report(replans=1, stamp_ns=500.0)
    # boundary 1: rank 1 costs 5.5 ms (rank 0: 4 ms; its 50 ms of waiting are not counted); boundary 2: rank 0, 2 ms
    assert r["iterations"] == 2 and r["ms_per_iteration"] == pytest.approx(3.75)
    assert r["steady_ms_per_iteration"] == pytest.approx(2.0) and r["max_ms"] == pytest.approx(5.5)
    assert r["replan_ms_each"] == pytest.approx(2.0)
    assert r["iteration_ms"] == pytest.approx(150.0) and r["pct_of_iteration"] == pytest.approx(2.5)
    assert r["steady_pct_of_iteration"] == pytest.approx(2.0 / 150 * 100, abs=0.01)
    assert r["parts_ms"]["links"] == pytest.approx(2.0) and r["parts_ms"]["sync"] == 0.0
    assert len(r["parts_ms"]) == n
    line = OverheadBook.describe(r)
    assert "profiler overhead 3.75 ms per iteration (2.50% of a 150 ms iteration); without re-plans and the delegates' start 2.00 ms" in line
    assert "2 ms per re-plan" in line and "over 2 iterations (2 exchanges)" in line
    assert OverheadBook().report(0, 1.0) is None


def test_an_exchange_every_few_iterations_is_charged_per_iteration_over_the_span():
    book = OverheadBook()

    def row(iterations: float, period: float, **parts):
        return [parts.get(k, 0.0) for k in OVERHEAD_FIELDS] + [period, iterations]

    book.add(torch.tensor([row(1, 100.0, exchange=50.0)] * 2))  # the first span sets up the exchange: left out
    # 4 iterations of 100 ms: one exchange (4 ms) and the stamps of 4 iterations (0.1 ms each)
    book.add(torch.tensor([row(4, 400.0, exchange=4.0, stamps=0.4), row(4, 404.0, exchange=3.0, stamps=0.4)]))
    # 1 iteration that re-planned (something changed: the next exchange came at once)
    book.add(torch.tensor([row(1, 110.0, exchange=4.0, replan=6.0, stamps=0.1)] * 2))
    # 8 iterations: one exchange and 8 iterations' stamps
    book.add(torch.tensor([row(8, 800.0, exchange=4.0, stamps=0.8)] * 2))
    r = book.report(replans=1, stamp_ns=500.0)
    assert r["iterations"] == 13 and r["exchanges"] == 3
    assert r["ms_per_iteration"] == pytest.approx((4.4 + 10.1 + 4.8) / 13, abs=1e-3)
    assert r["steady_ms_per_iteration"] == pytest.approx((4.4 + 4.8) / 12, abs=1e-3)
    assert r["parts_ms"]["stamps"] == pytest.approx(1.3 / 13, abs=1e-3)  # 0.1 ms per iteration, as stamped
    assert r["parts_ms"]["exchange"] == pytest.approx(12.0 / 13, abs=1e-3)
    assert r["iteration_ms"] == pytest.approx(101.0)  # median of 101, 110 and 100 ms per iteration
    assert r["max_ms"] == pytest.approx(10.1) and r["replan_ms_each"] == pytest.approx(6.0)


def test_the_span_that_started_the_delegates_counts_in_the_total_but_not_in_the_steady_cost():
    """Starting the delegates' fork server ahead of a switch is a once-off cost, like a re-plan: it
    counts in the cost per iteration and is named apart, but a short job's steady cost does not carry it."""
    book = OverheadBook()

    def row(iterations: float, period: float, **parts):
        return [parts.get(k, 0.0) for k in OVERHEAD_FIELDS] + [period, iterations]

    book.add(torch.tensor([row(1, 100.0, exchange=50.0)] * 2))  # the first span sets up the exchange: left out
    book.add(torch.tensor([row(1, 100.0, exchange=2.0)] * 2))
    book.add(torch.tensor([row(1, 100.0, exchange=2.0, prewarm=60.0), row(1, 100.0, exchange=2.0)]))
    book.add(torch.tensor([row(2, 200.0, exchange=2.0)] * 2))
    r = book.report(replans=0, stamp_ns=500.0)
    assert r["ms_per_iteration"] == pytest.approx((2.0 + 62.0 + 2.0) / 4)
    assert r["steady_ms_per_iteration"] == pytest.approx((2.0 + 2.0) / 3, abs=1e-3)  # the prewarm span left out
    assert r["parts_ms"]["prewarm"] == pytest.approx(60.0 / 4) and r["replan_ms_each"] is None
    assert "without re-plans and the delegates' start 1.33 ms" in OverheadBook.describe(r)
