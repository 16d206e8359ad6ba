"""Whole-rank memory against stock DeepSpeed: ``benchmarks/engine/rank_memory.py`` runs stock 1F1B and
our engine with the default memory settings, each row its own 4-rank job on the demo's job shape
(4 stages × 12 micro-batches, a slow link 0), and every rank's peak resident set stays within 10 %
of stock's on the same rank. The activations are large (8 MiB a micro-batch: stock's own working
set is about a third of its peak), so a rank keeping an iteration's sends (24 messages on a middle
stage) or posting more receives than the window would show."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ordered_schedules_with_the_default_settings_hold_no_more_than_stock_per_rank(tmp_path):
    out = tmp_path / "rank_memory.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "rank_memory.py"),
                        "--rows", "stock,zb,adaptive-direct", "--act-mib", "8", "--warmup", "2", "--iterations", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=880,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "whole-rank peak resident memory" in p.stdout
    res = json.loads(out.read_text())["results"]
    stock = {r["rank"]: r for r in res["stock"]}
    for rank, r in stock.items():  # the activations dominate what each stock rank adds after initialize
        assert r["peak_mib"] - r["after_init_mib"] > 8 * (4 - rank) - 1, r
    for row in ("zb", "adaptive-direct"):
        for r in res[row]:
            assert r["links"] == ["direct"] * 3
            assert r["peak_mib"] <= 1.10 * stock[r["rank"]]["peak_mib"], (row, r, stock[r["rank"]])
