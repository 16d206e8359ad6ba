"""benchmarks/engine/varlen_real.py runs in a short form (one job, tiny model) and its rows parse: stock,
ours ordered and ready with both hints, each with the replay's time from the measured op times and
the engine's own paired ready/ordered comparison."""
from __future__ import annotations

import json
import os
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
                        "--blocks", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=220, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "replay: stock / row" in p.stdout
    (res,) = json.loads(out.read_text())["results"]
    assert (res["workload"], res["ranks"]) == ("multimodal", 2)
    rows = res["rows"]
    assert list(rows) == ["stock 1F1B", "ours ordered 1f1b", "ours ready 1f1b (BF)", "ours ordered zb",
                          "ours ready zb (BFW)"]
    # 12 measured iterations per engine: stock's all, ours split 6 ordered (A, A') and 6 ready (B).
    assert [r["iterations"] for r in rows.values()] == [12, 6, 6, 6, 6]
    for r in rows.values():
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
    assert rows["stock 1F1B"]["measured_speedup"] == rows["stock 1F1B"]["predicted_speedup"] == 1.0
    for hint in ("zb", "1f1b"):
        (pair,) = res["ready_over_ordered"][hint]
        assert pair["pairs"] == 6 and 0 < pair["lo"] <= pair["median"] <= pair["hi"]
    (sitting,) = res["sittings"]
    assert sitting["order"] == ["stock", "zb", "1f1b"]
    heavy = [[t for t in shapes if t > 8] for shapes in sitting["shapes"]]
    assert all(h == [32] for h in heavy)  # one of 4 micro-batches 4x longer, every iteration
