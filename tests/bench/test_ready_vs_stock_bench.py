"""benchmarks/engine/ready_vs_stock.py runs in a short form on the workload written apart from the
package's emulation (``--workload plain-sleep``: plain ``time.sleep`` ops, the heavy quarter carried
in the batch): both engines in one 4-rank job, each with its replay, and where ours' time went."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_ready_vs_stock_plain_sleep_runs_short_and_gives_both_engines_with_their_replays(tmp_path):
    out = tmp_path / "rvs.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "ready_vs_stock.py"), "--workload",
                        "plain-sleep", "--sittings", "1", "--iterations", "2", "--warmup", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=280, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "median over 1 sittings: stock / ours" in p.stdout
    res = json.loads(out.read_text())
    assert res["workload"] == "plain-sleep" and res["vary"] is None
    (s,) = res["sittings"]
    assert s["first"] == "stock-1f1b"
    assert len(s["stock_iterations_ms"]) == len(s["ours_iterations_ms"]) == 2
    # Each iteration runs 12 micro-batches of F, B and W of at least 10 ms on every stage (30 ms on the
    # heavy quarter's first two): no engine can be faster than one stage's own ops.
    least = 12 * 3 * 10.0
    assert min(s["stock_iterations_ms"] + s["ours_iterations_ms"]) >= least
    assert s["stock_predicted_ms"] >= least and s["ours_predicted_ms"] >= least
    assert s["measured_speedup"] == pytest.approx(s["stock_ms"] / s["ours_ms"])
    assert s["predicted_speedup"] == pytest.approx(s["stock_predicted_ms"] / s["ours_predicted_ms"])
    assert len(s["ours_stage_time_ms"]) == 4 and all(row["msg_wait"] >= 0 for row in s["ours_stage_time_ms"])
