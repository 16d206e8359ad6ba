"""benchmarks/engine/varlen_real.py runs in a short form (one job per setting, tiny model) and its rows
parse: stock, ours ordered and ready with both hints (the 1f1b hint with B and W as one pass and apart), each paired with stock per iteration and with the replay's
time from the op times measured in that iteration, and the engine's own paired ready/ordered
comparison on the same batches; the three engines, trained side by side on the same batches, stay equal."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_varlen_benchmark_runs_short_and_gives_every_row_a_replay_and_the_paired_comparison(tmp_path):
    out = tmp_path / "vr.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "varlen_real.py"), "--workloads",
                        "multimodal", "--ranks", "2", "--sittings", "1", "--iterations", "12", "--warmup", "0",
                        "--micro-batches", "4", "--batch", "2", "--seq", "8", "--d-model", "16", "--heads", "2",
                        "--blocks", "2", "--malloc", "caching", "--out", str(out)],
                       capture_output=True, text=True, timeout=220, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "stock DeepSpeed 1F1B against ours" in p.stdout and "wrote" in p.stdout
    written = json.loads(out.read_text())
    assert written["args"]["malloc"] == "caching"
    (res,) = written["results"]
    assert (res["workload"], res["ranks"]) == ("multimodal", 2)
    rows = res["rows"]
    assert list(rows) == ["stock 1F1B", "ours ordered 1f1b, fused", "ours ready 1f1b, fused (BF)",
                          "ours ordered 1f1b, split", "ours ready 1f1b, split", "ours ordered zb", "ours ready zb (BFW)"]
    # 12 measured iterations per engine and job: stock's all (three jobs), ours' 6 ordered (A, A') and 6 ready (B).
    assert [r["iterations"] for r in rows.values()] == [36, 6, 6, 6, 6, 6, 6]
    for r in rows.values():
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
    for name, r in rows.items():
        if name != "stock 1F1B":
            lo, hi = r["measured_interval"]
            assert lo <= r["measured_speedup"] <= hi and r["predicted_speedup"] > 0
            m, pr = r["measured_speedup"], r["predicted_speedup"]
            assert r["speedup_quotient"] == m / pr
            # the part of the predicted gain measured: all of it at m == pr, none at m == 1; none
            # where the replay predicts less than 1 %
            assert r["share"] is None if pr < 1.01 else r["share"] == pytest.approx((m - 1) / (pr - 1))
            assert len(r["iterations_detail"]) == 6
            assert r["predicted_speedup_own_ops"] > 0 and r["ops_over_stock_ops"] > 0
            own = r["predicted_speedup_own_ops"]  # the same share against the replay on each engine's own ops
            assert r["share_own_ops"] is None if own < 1.01 else r["share_own_ops"] == pytest.approx((m - 1) / (own - 1))
    assert res["max_loss_difference"] <= 1e-5  # every engine trains as stock does
    control = res["stock_second_over_first"]  # stock's second run of each draw over its first
    assert control["pairs"] == 18 and 0 < control["lo"] <= control["median"] <= control["hi"]
    times = {job["rows"][1].get("backward", "") + job["rows"][1]["row"]: job for job in res["sittings"]}
    for variant, key in (("zb", "splitzb"), ("1f1b-fused", "fused1f1b"), ("1f1b-split", "split1f1b")):
        (pair,) = res["ready_over_ordered"][variant]
        assert pair["pairs"] == 6 and 0 < pair["lo"] <= pair["median"] <= pair["hi"]
        # net of stock: each ready iteration over the ordered one before it, over stock's same two iterations
        (net,) = res["ready_over_ordered_net"][variant]
        stock_t, ours_t = (r["times_ms"] for r in times[key]["rows"])
        ours = [ours_t[k] / ours_t[k - 1] for k in range(1, 12, 2)]
        stock = [stock_t[k] / stock_t[k - 1] for k in range(1, 12, 2)]
        assert net["ours"]["median"] == pytest.approx(statistics.median(ours))
        assert net["stock"]["median"] == pytest.approx(statistics.median(stock))
        assert net["net"]["median"] == pytest.approx(statistics.median(o / s for o, s in zip(ours, stock)))
        assert all(net[k]["pairs"] == 6 and net[k]["lo"] <= net[k]["median"] <= net[k]["hi"] for k in net)
    # One job per hint, each stock and ours side by side; which goes first alternates with each draw.
    assert [[r["row"] for r in job["rows"]] for job in res["sittings"]] == [["stock", "zb"], ["stock", "1f1b"],
                                                                          ["stock", "1f1b"]]
    # BF runs B and W in one pass (RRFP's BF, stock's backward), BFW apart; 1F1B both ways
    assert [job["rows"][1]["backward"] for job in res["sittings"]] == ["split", "fused", "split"]
    for job in res["sittings"]:
        assert job["rows"][0]["first"] == [k // 2 % 2 for k in range(12)]
        assert job["rows"][1]["first"] == [1 - k // 2 % 2 for k in range(12)]
        # Each A, B pair of ours trains one draw: iterations 2j (ordered) and 2j + 1 (ready) trained the
        # same lengths (as each engine received them), and stock trained what ours did.
        ours = job["rows"][1]
        assert ours["sides"][:4] == ["A", "B", "A'", "B"]
        assert ours["lengths"][0::2] == ours["lengths"][1::2] and ours["lengths"] == job["rows"][0]["lengths"]
        assert ours["lengths"] == job["shapes"]
        heavy = [[t for t in shapes if t > 8] for shapes in job["shapes"]]
        assert all(h == [32] for h in heavy)  # one of 4 micro-batches 4x longer, every iteration
