"""benchmarks/engine/real_compute_ab.py runs (short jobs) and its row is the engine's own comparison:
the log line the engine wrote, parsed, with the replay's prediction from the measured op times; its
stock section alternates whole jobs of stock DeepSpeed and ours, each job's median its own sample."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(420)
def test_real_compute_benchmark_parses_the_engines_comparison_and_predicts_from_measured_times(tmp_path):
    out = tmp_path / "rc.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "real_compute_ab.py"), "--micro-batches", "4",
                        "--steps", "16", "--budgets", "null", "--schedules", "adaptive,zb", "--stock-pairs", "2",
                        "--stock-steps", "6", "--stock-warmup", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=400, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "B/A [95 % CI]" in p.stdout
    payload = json.loads(out.read_text())
    res = payload["results"]
    assert [(r["schedule"], r["micro_batches"], r["budget"]) for r in res] == [("adaptive", 4, None), ("zb", 4, None)]
    for r in res:
        assert r["a"] == "1f1b/ordered" and r["b"] == f"{r['schedule']}/ordered" and r["measured"] == 12
        lo, mid, hi = r["ratio"][1], r["ratio"][0], r["ratio"][2]
        assert 0 < lo <= mid <= hi and r["a_ms"] > 0 and r["b_ms"] > 0
    assert res[0]["predicted"] is None and res[1]["predicted"] > 0  # zb's replay from adaptive's profile
    # One cycle of whole jobs, A B A' B: stock DeepSpeed on the A side, ours on the B side; each sample
    # is the median of the job's 4 iterations after its 2 warm-up ones, so the medians it reports are
    # the medians of those samples, and the B/A pairs (B with the A-side job before it) are two.
    (whole,) = payload["stock_whole_jobs"]
    assert whole["micro_batches"] == 4 and whole["sides"] == ["A", "B", "A'", "B"]
    m = whole["job_medians_ms"]
    assert len(m) == 4 and all(t > 0 for t in m)
    assert whole["ratio"]["pairs"] == 2 and whole["ratio"]["median"] == pytest.approx((m[1] / m[0] + m[3] / m[2]) / 2)
    assert whole["a_median_ms"] == pytest.approx((m[0] + m[2]) / 2) and whole["b_median_ms"] == pytest.approx((m[1] + m[3]) / 2)
    assert whole["noise"]["pairs"] == 1 and whole["noise"]["median"] == pytest.approx(m[2] / m[0])
    assert "stock DeepSpeed 1F1B (A) against our engine" in p.stdout
