"""benchmarks/engine/split_backward.py runs (small) and its memory rows mean what they say: checkpointing
keeps less after F, the split keeps after B what W needs (the store less than the graph), and stock
1F1B's peak is S - s micro-batches."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_split_backward_benchmark_prints_both_tables_and_writes_consistent_bytes(tmp_path):
    out = tmp_path / "sb.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "split_backward.py"), "--dims", "64", "--pairs", "3",
                        "--blocks", "2", "--layers", "block,Linear", "--out", str(out)], capture_output=True,
                       text=True, timeout=280, env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin", **_keep()})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "B+W / fused (store)" in p.stdout and "peak activation MiB per stage" in p.stdout
    assert "page faults fused/store/graph" in p.stdout
    runs = json.loads(out.read_text())["runs"]
    assert sorted(runs) == ["caching", "glibc"]
    for run in runs.values():
        assert [(r["dtype"], r["layer"]) for r in run["speed"]] == [
            ("float32", "block"), ("float32", "Linear"), ("bfloat16", "block"), ("bfloat16", "Linear")]
        for r in run["speed"]:
            assert len(r["fused_ms"]) == len(r["store"]["ms"]) == len(r["graph"]["ms"]) == 3
            # the minor page faults of each backward, one count per round and way
            for faults in (r["fused_faults"], r["store"]["faults"], r["graph"]["faults"]):
                assert len(faults) == 3 and all(isinstance(f, int) and f >= 0 for f in faults)
    assert runs["caching"]["memory"] == []  # bytes do not depend on the allocator: measured once
    for r in runs["glibc"]["memory"]:
        b = r["bytes_per_micro_batch"]
        # 4 x 128 tokens of width 64 in the dtype: the second block's input, which checkpointing keeps (the
        # first block's is the stage input, not counted)
        x = 4 * 128 * 64 * (4 if r["dtype"] == "float32" else 2)
        assert b["ours ckpt"]["after_F"] == b["stock ckpt"]["after_F"] == x
        assert b["graph"]["after_F"] == b["store"]["after_F"] > 10 * x  # a block keeps many activations of that size
        assert b["graph"]["after_B"] >= b["graph"]["after_F"] - x  # the graph split keeps what B could not free
        # The store keeps the layers' inputs and output gradients only: less than the graph and its gradients.
        assert x < b["store"]["after_B"] < b["graph"]["after_B"]
        peaks = r["peak_bytes_per_stage"]
        for s in range(4):
            assert peaks[str(s)]["stock 1F1B"] == (4 - s) * b["graph"]["after_F"]
            assert peaks[str(s)]["zb graph"] >= peaks[str(s)]["stock 1F1B"]
            assert peaks[str(s)]["zb store"] <= peaks[str(s)]["zb graph"]


def _keep() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k in ("HOME", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH")}
