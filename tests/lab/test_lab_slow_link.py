"""PipeMorph's §7.2 setting on a real slow link, short (``benchmarks/lab/lab_slow_link.py``): 4 lab nodes x 1
stage, link 1 rate-limited by the kernel; stock 1F1B, zb and PipeMorph each unshaped then shaped in one job.

What must hold whatever the machine's load: every row trains; PipeMorph measures the slow link from
its own messages (about its wire time 8 S / R, nothing injected) and re-plans for link 1 alone; under
gloo, whose sends do not hold the training process, the link stays direct; and stock DeepSpeed's
blocking 1F1B pays for the link far more than PipeMorph does.

With ``--model gpt`` (real compute: the GPT recipe's blocks on 2 nodes), what is checked is the
structure and the training, not the times: every row present on both settings, every row's losses
the same (the same model, data and seed under three engines), PipeMorph's re-plan and prediction
reported, and no namespace left behind.
"""
import json
import math
import sys
from pathlib import Path

import pytest

from ds_pipemorph.lab.names import lab_prefix

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "lab"))

import lab_slow_link  # noqa: E402
from lab_helpers import namespaces  # noqa: E402


@pytest.mark.slow
@pytest.mark.alone  # it compares what the link costs each engine, in milliseconds
@pytest.mark.timeout(600)
def test_pipemorph_reads_a_real_slow_link_re_plans_for_it_and_pays_less_for_it_than_stock(lab_capable, tmp_path):
    out = tmp_path / "slow.json"
    assert lab_slow_link.main(["--iterations", "3", "--warmup", "5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["exit_codes"] == [0] * 4
    # The launcher applied each row's setting before it started: unshaped, shaped, in pairs.
    assert [a["setting"] for a in res["settings_applied"]] == ["unshaped", "shaped"] * 3
    rate = res["rate_bits"]
    assert [a["rate"] for a in res["settings_applied"]] == [None, rate] * 3
    by = {s["row"]: s for s in res["summary"]}
    wire = 8 * res["message_bytes"] / rate * 1e3  # 40 ms
    pm = by["PipeMorph / shaped"]
    assert pm["replans"], "PipeMorph did not re-plan for the slow link"
    first = pm["replans"][0]
    assert first["iteration"] <= 4  # two slow iterations to act: decided well inside the warm-up
    # Its own measurement of link 1: at least the wire time (a loaded machine only lengthens it), and
    # the other links calm.
    assert 0.9 * wire <= first["measured_links_ms"][1] <= 2.5 * wire
    assert max(first["measured_links_ms"][0], first["measured_links_ms"][2]) < 0.25 * wire
    assert pm["slow_link_path"] == "direct"  # gloo: a delegate would add copies and no bandwidth
    # Stock's blocking 1F1B pays the link in every steady-state round trip, PipeMorph's plan absorbs it.
    stock_cost = by["stock 1F1B / shaped"]["median_ms"] - by["stock 1F1B / unshaped"]["median_ms"]
    pm_cost = pm["median_ms"] - by["PipeMorph / unshaped"]["median_ms"]
    assert stock_cost > 2 * max(pm_cost, 0.0) and stock_cost > 2 * wire
    assert pm["speedup_vs_stock"] > 1.3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpt_blocks_on_two_nodes_train_the_same_under_every_engine_and_leave_no_namespace(lab_capable, tmp_path):
    out = tmp_path / "gpt.json"
    assert lab_slow_link.main(["--model", "gpt", "--iterations", "2", "--warmup", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert namespaces(lab_prefix(res["lab"])) == []  # its lab's, not another test's
    assert (res["model"], res["nodes"], res["slow_link"]) == ("gpt", 2, 0)
    assert res["exit_codes"] == [0] * 2
    assert res["message_bytes"] == 4 * 64 * 128 * 4  # 4 windows x 64 bytes x d_model 128, float32
    assert res["wire_ms"] == pytest.approx(40.0, rel=0.01)  # the rate follows from --message-ms
    assert [a["setting"] for a in res["settings_applied"]] == ["unshaped", "shaped"] * 3
    assert all(len(res["op_costs_ms"][k]) == 2 and min(res["op_costs_ms"][k]) > 0 for k in ("F", "W"))
    by = {s["row"]: s for s in res["summary"]}
    assert set(by) == {f"{e} / {s}" for e in ("stock 1F1B", "zb", "PipeMorph") for s in ("unshaped", "shaped")}
    assert all(len(s["iteration_ms_all"]) == 2 for s in res["summary"])
    losses = [[i["loss"] for i in row["iterations"]] for row in res["rows"]]
    assert all(math.isfinite(x) for x in losses[0])
    for other in losses[1:]:
        assert other == pytest.approx(losses[0], rel=1e-4)
    pm = by["PipeMorph / shaped"]
    assert pm["replans"] and pm["planner_predicted_ms"] > 0
    assert by["zb / shaped"]["predicted_ms"] > 0 and by["stock 1F1B / shaped"]["predicted_ms"] > 0
    assert pm["estimated_slow_link_ms"] is not None and by["stock 1F1B / shaped"]["estimated_slow_link_ms"] is None


@pytest.mark.timeout(150)
def test_an_unknown_model_is_refused_in_one_sentence(tmp_path, capsys):
    from _util import exit_on_bad_input

    assert exit_on_bad_input(lambda: lab_slow_link.main(["--model", "bert", "--out", str(tmp_path / "o.json")])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model: unknown 'bert'") and err.strip().count("\n") == 0
    assert not (tmp_path / "o.json").exists()
