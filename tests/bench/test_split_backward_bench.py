"""benchmarks/split_backward.py runs (small) and its memory rows mean what they say: checkpointing
keeps less after F, the split keeps after B what W needs, and stock 1F1B's peak is S - s micro-batches."""
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
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "split_backward.py"), "--dims", "64", "--pairs", "3",
                        "--blocks", "2", "--out", str(out)], capture_output=True, text=True, timeout=280,
                       env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin", **_keep()})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "B+W / fused" in p.stdout and "peak activation MiB per stage" in p.stdout
    res = json.loads(out.read_text())["results"]
    assert [(r["dtype"], r["d_model"]) for r in res] == [("float32", 64), ("bfloat16", 64)]
    for r in res:
        b = r["bytes_per_micro_batch"]
        # 4 x 128 tokens of width 64 in the dtype: the second block's input, which checkpointing keeps (the
        # first block's is the stage input, not counted)
        x = 4 * 128 * 64 * (4 if r["dtype"] == "float32" else 2)
        assert b["ours"]["after_F"] == b["stock"]["after_F"] == x
        assert b["none"]["after_F"] > 10 * x  # a block keeps many activations of that size
        assert b["none"]["after_B"] >= b["none"]["after_F"] - x  # W needs what B could not free
        peaks = r["peak_bytes_per_stage"]
        for s in range(4):
            assert peaks[str(s)]["stock 1F1B"] == (4 - s) * b["none"]["after_F"]
            assert peaks[str(s)]["zb"] >= peaks[str(s)]["stock 1F1B"]


def _keep() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k in ("HOME", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH")}
