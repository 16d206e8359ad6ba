"""`pipemorph paired` on the real engines: what ran in each iteration, and that training stays exact.

One job alternates two plans, two dispatches, two transports and two receive windows at once (A =
zb, ordered, direct, 2 receives of each kind posted ahead; B = 1f1b, ready, delegated); each
iteration's record says what every stage ran. A second job runs A
against itself: both plans compute the same gradients, so every iteration's loss must agree within
1e-5 with it. Whole-job alternation (stock DeepSpeed against this engine) is checked for its order
and bookkeeping. No assertion is about how long anything took.
"""
from __future__ import annotations

import json
from statistics import median

import pytest
from typer.testing import CliRunner

from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.runtime.plans import build_plan
from ds_pipemorph_cli.app import app

runner = CliRunner()

# DeepSpeed's 1F1B on 2 stages x 4 micro-batches, each backward as B then W (written out by hand):
# stage 0 runs one forward ahead, stage 1 (the last) does each micro-batch's F, B, W in turn.
ONE_F_ONE_B = {
    "0": "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3".split(),
    "1": "F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3".split(),
}
COMMON = ["--stages", "2", "--microbatches", "4", "--op-ms", "1", "--pairs", "4", "--warmup", "2"]


def _run(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    r = runner.invoke(app, ["paired", *args, *COMMON, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "B/A" in r.output and "A'/A" in r.output and "verdict:" in r.output
    # Not a terminal here: a line per pair instead of a bar, each pair once, in order.
    pairs = [ln.split(" done")[0] for ln in r.output.splitlines() if ln.startswith("pair ")]
    assert pairs and pairs == [f"pair {k} of {len(pairs)}" for k in range(1, len(pairs) + 1)], r.output
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_one_job_alternates_plan_dispatch_and_transport_and_trains_as_a_alone(tmp_path):
    # Without a memory limit zb defers Ws and differs from 1F1B even at 2 x 4 (within stock's memory
    # the two orders are the same there).
    mixed = _run(tmp_path, "mixed", "zb+recv2", "1f1b+ready+delegated", "--budget", "none")
    alone = _run(tmp_path, "alone", "zb", "zb", "--budget", "none")
    rows = mixed["iterations"]
    # Two warm-up iterations (the cycle's end), then two cycles of A B A' B.
    assert [r["side"] for r in rows] == ["A'", "B", "A", "B", "A'", "B", "A", "B", "A'", "B"]
    assert [r["measured"] for r in rows] == [False, False] + [True] * 8
    zb = build_plan(parse_config({"schedule": "zb", "memory": {"budget": None}}), 2, 4)
    zb_ops = {str(s): [str(op) for op in zb[s]] for s in range(2)}
    assert zb_ops != ONE_F_ONE_B  # the two sides really are different orders
    for r in rows:
        b = r["side"] == "B"
        assert r["config"] == ("1f1b+ready+delegated" if b else "zb+recv2")
        for stage, ran in r["stages"].items():
            if b:  # ready dispatch may run a ready op early: each op once, in dependency order
                assert sorted(ran["ops"]) == sorted(ONE_F_ONE_B[stage]), (r["index"], stage, ran["ops"])
                assert all(ran["ops"].index(f"B{m}") < ran["ops"].index(f"W{m}") for m in range(4))
            else:
                assert ran["ops"] == zb_ops[stage], (r["index"], stage, ran["ops"])
            assert ran["dispatch"] == ("ready" if b else "ordered")
            assert ran["links"] == (["delegated"] if b else ["direct"])
            if not b:  # two receives of stage 0's gradients and of stage 1's activations up front
                assert ran["posted_first"] == ({"RECV_F": 0, "RECV_B": 2} if stage == "0"
                                               else {"RECV_F": 2, "RECV_B": 0}), (r["index"], stage, ran)
    # Ordered 1F1B would run exactly the hand-written order; under ready dispatch at least the last
    # stage has a single order that respects its dependencies, and it is 1F1B's.
    assert all(r["stages"]["1"]["ops"] == ONE_F_ONE_B["1"] for r in rows if r["side"] == "B")
    # Both plans compute the same gradients: the alternating job trains exactly as A alone.
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in alone["iterations"]], abs=1e-5)
    # A alone ran with the default window: one receive up front
    assert all(ran["posted_first"] == ({"RECV_F": 0, "RECV_B": 1} if stage == "0" else {"RECV_F": 1, "RECV_B": 0})
               for r in alone["iterations"] for stage, ran in r["stages"].items())
    assert len({round(r["loss"], 6) for r in rows}) == len(rows)  # the model did train (losses move)
    c = mixed["comparison"]
    assert c["ratio"]["pairs"] == 4 and c["noise"]["pairs"] == 2
    assert c["ratio"]["lo"] <= c["ratio"]["median"] <= c["ratio"]["hi"]
    measured = [r for r in rows if r["measured"]]
    assert c["b_median_ms"] == pytest.approx(median(r["ms"] for r in measured if r["side"] == "B"))
    assert "one job" in mixed["mode"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # four jobs, each starting its ranks anew
def test_stock_deepspeed_against_this_engine_alternates_whole_jobs(tmp_path):
    out = tmp_path / "jobs.json"
    r = runner.invoke(app, ["paired", "stock-1f1b", "zb", "--stages", "2", "--microbatches", "2", "--op-ms", "1",
                            "--pairs", "2", "--warmup", "1", "--job-iterations", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    rows = res["iterations"]
    assert [(x["side"], x["config"]) for x in rows] == [("A", "stock-1f1b"), ("B", "zb"), ("A'", "stock-1f1b"),
                                                        ("B", "zb")]
    for x in rows:  # each job's sample is the median of its own measured iterations
        assert len(x["job_iterations_ms"]) == 3 and x["ms"] == median(x["job_iterations_ms"])
    assert "whole jobs alternating" in res["mode"] and "whole jobs alternating" in r.output
    assert res["comparison"]["ratio"]["pairs"] == 2 and "too few pairs to judge" in res["comparison"]["verdict"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["zb", "zbb"], "B: 'zbb' is not a plan"),
        (["zb", "1f1b+fast"], "B: unknown modifier 'fast'"),
        (["zb", "1f1b+recv0"], "B: 'recv0' in '1f1b+recv0': recvN takes a whole number N >= 1"),
        (["zb+ready+recv2", "zb"], "A: '+recv2' applies to ordered dispatch"),
        (["stock-1f1b", "zb+recv2"], "B: 'zb+recv2' cannot be run in whole alternating jobs"),
        (["zb+recv1+recv2", "zb"], "A: 'zb+recv1+recv2' sets the recv_window twice"),
        (["zb", "pipemorph+recv2"], "B: '+recv2' sets the receive window of this package's zb and 1f1b sides "
                                    "only (pipemorph runs its own control loop in whole jobs)"),
        (["zb+ready+ordered", "zb"], "A: 'zb+ready+ordered' sets the dispatch twice"),
        (["stock-1f1b+ready", "zb"], "A: stock-1f1b runs DeepSpeed's own engine"),
        (["stock-1f1b", "1f1b"], "B: '1f1b' cannot be run in whole alternating jobs"),
        (["zb", "plan:missing.yaml"], "B: cannot read the plan file 'missing.yaml'"),
        (["zb", "1f1b", "--stages", "2", "--links-ms", "1,2"], "--links-ms: 2 delays for 1 links"),
        (["zb", "1f1b", "--links-ms", "0,x,0"], "--links-ms: '0,x,0' is not a comma-separated list"),
        (["zb", "1f1b", "--out", "/proc/p.json"], "--out: cannot write '/proc/p.json'"),
    ],
)
def test_bad_paired_options_get_one_sentence_and_exit_2(tmp_path, args, needle):
    out = [] if "--out" in args else ["--out", str(tmp_path / "p.json")]
    r = runner.invoke(app, ["paired", *args, *out])
    assert r.exit_code == 2 and needle in r.output, r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "p.json").exists()
