"""`pipemorph profile-links` on 4 real gloo ranks (torchrun) with 30 ms injected on link 2: the
written files must show link 2 about 30 ms slower than the others, in under a minute."""
import json
import os
import statistics
import sys

import pytest
import yaml
from ds_pipemorph.procs import run_group

INJECT_MS = 30.0
PROFILE = {
    "stages": 4,
    "microbatches": 12,
    "compute_ms": {"forward": 10, "backward_input": [10, 10, 10, 10], "backward_weight": 10},
    "links_ms": [0, 0, 0],
    "memory": {"max_inflight": [7, 5, 3, 1]},
}


@pytest.mark.slow
@pytest.mark.alone  # one-way medians within 3 ms of the latency's: no other job on the cores
@pytest.mark.timeout(150)
def test_four_ranks_find_the_injected_30ms_on_link_2(tmp_path):
    base = tmp_path / "profile.yaml"
    base.write_text(yaml.safe_dump(PROFILE))
    out, report = tmp_path / "measured.yaml", tmp_path / "report.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TERMINAL_WIDTH="200", COLUMNS="200")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "-m", "ds_pipemorph_cli.app", "profile-links", "--inject-links-ms", "0,0,30",
           "--sizes", "4K,256K,4M", "--reps", "5", "--merge", str(base), "--out", str(out), "--report", str(report)]
    proc = run_group(cmd, 140, env=env, cwd=tmp_path)  # its timeout is the only bound on time
    assert out.exists() and report.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]

    measured = yaml.safe_load(out.read_text())
    links = measured["links_ms"]
    assert len(links) == 3
    assert abs(links[2] - INJECT_MS) <= 0.1 * INJECT_MS, links
    assert links[0] < 3.0 and links[1] < 3.0, links
    # --merge keeps every other key of the profile as written.
    assert {k: v for k, v in measured.items() if k != "links_ms"} == {k: v for k, v in PROFILE.items() if k != "links_ms"}
    assert yaml.safe_load(base.read_text())["links_ms"] == [0, 0, 0]  # --out given: the base is untouched

    rep = json.loads(report.read_text())
    assert rep["backend"] == "gloo" and rep["inject_links_ms"] == [0, 0, 30] and rep["links_ms"] == links
    bandwidths = []
    for e in rep["links"]:
        assert len(e["latency_ms"]["samples"]) == 10
        for d in ("down", "up"):
            got = e["directions"][d]
            assert sorted(got["samples_ms"], key=int) == ["4096", "262144", "4194304"]
            assert all(len(v) == 5 for v in got["samples_ms"].values())
            assert got["fit"]["latency_ms"] >= 0
            med = {k: statistics.median(v) for k, v in got["samples_ms"].items()}
            bandwidths.append((got["fit"]["bandwidth_gbps"], med["4194304"] > med["4096"]))
    # A fitted bandwidth is positive; a size dependence (4 MB slower than 4 KB) is visible on most of
    # the 6 link directions (the fit itself may give up on a direction whose small-message times
    # drown in scheduling noise on a loaded 2-core machine).
    assert all(b is None or b > 0 for b, _ in bandwidths)
    assert sum(bigger for _, bigger in bandwidths) >= 4, bandwidths
    slow = rep["links"][2]
    assert "latency" in slow["slow"]
    # One-way times include the injected delay in both directions.
    for d in ("down", "up"):
        assert abs(slow["directions"][d]["median_ms"]["4096"] - slow["latency_ms"]["median"]) < 3
    assert all("latency" not in e["slow"] for e in rep["links"][:2])
    assert "SLOW" in proc.stdout and "links_ms" in proc.stdout
