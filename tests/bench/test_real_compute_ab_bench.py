"""benchmarks/engine/real_compute_ab.py runs (one short job) and its row is the engine's own comparison:
the log line the engine wrote, parsed, with the replay's prediction from the measured op times."""
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
                        "--steps", "16", "--budgets", "null", "--schedules", "adaptive,zb", "--out", str(out)],
                       capture_output=True, text=True, timeout=400, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "B/A [95 % CI]" in p.stdout
    res = json.loads(out.read_text())["results"]
    assert [(r["schedule"], r["micro_batches"], r["budget"]) for r in res] == [("adaptive", 4, None), ("zb", 4, None)]
    for r in res:
        assert r["a"] == "1f1b/ordered" and r["b"] == f"{r['schedule']}/ordered" and r["measured"] == 12
        lo, mid, hi = r["ratio"][1], r["ratio"][0], r["ratio"][2]
        assert 0 < lo <= mid <= hi and r["a_ms"] > 0 and r["b_ms"] > 0
    assert res[0]["predicted"] is None and res[1]["predicted"] > 0  # zb's replay from adaptive's profile
