"""The orchestrator on a real slow data-parallel link (``benchmarks/lab/lab_orchestrator.py`` runs it):
8 lab nodes x 1 rank, 2 replicas x 4 stages on DeepSpeed's default placement, the pair of nodes that
holds stage 1's two replicas rate-limited by the kernel. The link matrix is measured
(``profile-links --all-pairs``) and must show that pair; the engine, given the matrix, must see the
slow all-reduce in its own ``ReduceGrads`` times and re-map so that no data-parallel ring crosses the
pair; the all-reduce and the iteration get faster, and training stays what it was without the
re-mapping (same losses, same parameters as the row that never re-maps).
"""
import json
import sys
from pathlib import Path

import pytest

from lab_helpers import namespaces

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "lab"))

import lab_orchestrator  # noqa: E402

PAIR = (2, 3)


@pytest.mark.slow
@pytest.mark.alone  # it compares all-reduce and iteration times across rows run one after another
@pytest.mark.timeout(1500)
def test_engine_moves_a_measured_slow_data_parallel_link_into_the_pipeline_and_trains_unchanged(lab_capable, tmp_path):
    out = tmp_path / "lab_orchestrator.json"
    code = lab_orchestrator.main(["--pair", f"{PAIR[0]}-{PAIR[1]}", "--rate", "100mbit", "--iters", "8",
                                  "--sizes", "1M,4M", "--reps", "3", "--out", str(out), "--work", str(tmp_path / "work")])
    r = json.loads(out.read_text())
    assert not [ns for ns in namespaces() if r["lab_id"] in ns], "the lab's namespaces were left behind"
    assert code == 0, r["summary"]

    # The measured matrix names the shaped pair, and only it, as slow.
    found = r["shaped_pair"]
    assert found["found"] and found["slowest_pair"] == list(PAIR), found
    assert abs(found["shaped_error"]) <= 0.25, found

    rows = {row["name"]: row for row in r["rows"]}
    default, run = rows[lab_orchestrator.DEFAULT], rows[lab_orchestrator.IN_RUN]
    assert not default["remaps"] and not default["decisions"]
    # The engine decided once, from its own measurement, and every rank re-mapped.
    assert len(run["remaps"]) == 1 and all(x["ok"] for x in run["remaps"][0]["reports"]), run["remaps"]
    assert len(r["decision_lines"]) == 1 and "re-mapping to" in r["decision_lines"][0]
    d = run["decisions"][0]
    assert d["measured_allreduce_ms"][1] > 3 * max(d["measured_allreduce_ms"][s] for s in (0, 2, 3)), d
    s = r["summary"][lab_orchestrator.IN_RUN]
    assert s["ranks_before"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s["ranks_after"] == d["ranks"]
    assert not any(set(PAIR) <= set(ring) for ring in s["ranks_after"]), s["ranks_after"]
    assert s["after_iterations"], s

    # Stage 1's all-reduce was the slow one before; after, no stage's is anywhere near it, and the
    # iteration is faster. The shaped pair's wire time for stage 1's gradients bounds the before value.
    wire_ms = 8 * r["grad_mb"] * 1e6 / r["rate_bit_s"] * 1e3 * (r["replicas"] - 1) / r["replicas"] * 2
    assert s["before_allreduce_ms"][1] >= 0.9 * wire_ms, (s, wire_ms)
    assert max(s["after_allreduce_ms"]) < s["before_allreduce_ms"][1] / 2, s
    baseline = r["summary"][lab_orchestrator.DEFAULT]  # the same placement as before, all its iterations but the first
    assert s["after_ms"] < baseline["before_ms"] and s["after_ms"] < s["before_ms"], (s, baseline)

    # Training is unchanged by the re-mapping: same losses and parameters as the row that never re-mapped.
    assert r["loss_diff"] <= 1e-6
    assert max(run["params_vs_first_row"]["per_stage"]) <= 1e-6, run["params_vs_first_row"]
    assert max(run["params_vs_first_row"]["replicas"]) == 0.0, run["params_vs_first_row"]
