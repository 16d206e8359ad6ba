"""`pipemorph demo --iterations 2` as a user runs it (the console script, as the README shows it): a
separate process on 4 CPU ranks, progress while it runs, the six-row table, PipeMorph's re-plan for
the slow link, the results file with each row's prediction and memory budget."""
import json
import os
import re
import statistics
import sys

import pytest

from ds_pipemorph.procs import run_group

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "docs"))
from test_readme_runs import command  # noqa: E402  (the README's console script as this interpreter runs it)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_short_demo_shows_progress_prints_the_table_and_writes_results(tmp_path):
    out = tmp_path / "demo.json"
    # A temporary folder of its own, which the command leaves as it found it (no torchrun log folder,
    # no work folder of its own); long, as a scheduler's job folder may be: too long for the socket
    # of the delegates' fork server (``supervision.short_socket_folder``), whatever folder pytest's
    # own temporary folders are in.
    tmp = tmp_path / ("tmp-" + "x" * 80)
    tmp.mkdir()
    # A terminal as rich sees one (progress is drawn only there), wide enough for every line.
    env = {**os.environ, "TTY_COMPATIBLE": "1", "COLUMNS": "160", "DS_ACCELERATOR": "cpu", "TMPDIR": str(tmp)}
    p = run_group([*command("pipemorph"), "demo", "--iterations", "2", "--out", str(out)],
                  timeout=1400, env=env, cwd=tmp_path)
    text = ANSI.sub("", p.stdout)
    assert p.returncode == 0, text + p.stderr
    # Nothing but torch's compile cache (kept there for whatever runs next with this TMPDIR).
    assert [f.name for f in tmp.iterdir() if not f.name.startswith("torchinductor_")] == []
    # Progress: scenario k of 2, the row, warm-up and measured iterations of 4 + 2, elapsed time.
    assert re.search(r"scenario 1/2 no_delay: stock 1F1B \(row 1/6\), (warm-up )?iteration [1-6]/6 .*\d:\d\d:\d\d", text)
    assert re.search(r"scenario 2/2 20ms_link0: \S+.* \(row [4-6]/6\), (warm-up )?iteration [1-6]/6", text)
    for scenario in ("no_delay", "20ms_link0"):
        for schedule in ("stock 1F1B", "static zb", "PipeMorph"):
            assert re.search(rf"│ *{scenario} │ *{schedule} │ *\d+ │ *\d+ │ *[\d.]+x │", text), (scenario, schedule)
    assert re.search(r"^20ms_link0: PipeMorph re-planned after iteration [1-4] ", text, re.M)
    assert "note: only 2 measured iterations per row" in text
    assert text.rstrip().endswith(f"wrote {out}")
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 6
    for r in rows:
        a, b = r["iterations_ms"]
        assert r["median_ms"] == pytest.approx((a + b) / 2) == pytest.approx(statistics.fmean([a, b]))
        # 12 micro-batches of F + B + W = 30 ms on each stage: no iteration is shorter than 360 ms.
        assert min(a, b) >= 360
    res = {(x["scenario"], x["schedule"]): x for x in rows}
    assert set(res) == {(sc, s) for sc in ("no_delay", "20ms_link0") for s in ("stock-1f1b", "zb", "pipemorph")}
    # Within stock 1F1B's memory (the default budget) zb is 1F1B's order with the backward split: the
    # fused 1F1B's (N + S - 1) x 30 ms = 450, less 10 ms on each of the S - 1 hops of the last
    # gradient, which leaves each stage after its B instead of after B + W: 420. Re-planned for the
    # slow link, PipeMorph predicts less than the fixed plan under it.
    assert res[("no_delay", "stock-1f1b")]["predicted_ms"] == pytest.approx(450.0)
    assert res[("no_delay", "zb")]["predicted_ms"] == pytest.approx(420.0)
    assert res[("20ms_link0", "pipemorph")]["predicted_ms"] < res[("20ms_link0", "zb")]["predicted_ms"]
    assert all(x["budget"] == (None if x["schedule"] == "stock-1f1b" else 1.0) for x in rows)
