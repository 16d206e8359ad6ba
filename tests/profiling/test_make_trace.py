"""recipes/stragglers/make_trace.py: PipeMorph §7.2 dynamic traces that `load_trace` accepts."""
import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ds_pipemorph.inject.delays import DelaySchedule, load_trace

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "stragglers" / "make_trace.py"
spec = importlib.util.spec_from_file_location("make_trace", SCRIPT)
make_trace_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_trace_mod)
make_trace = make_trace_mod.make_trace


def _changes(points, link):
    """Times at which ``link`` got a new draw (a repeated equal value is vanishingly unlikely)."""
    out, last = [], None
    for p in points:
        if p["links_ms"][link] != last:
            out.append(p["t"])
            last = p["links_ms"][link]
    return out


@pytest.mark.timeout(60)
def test_rate_b_trace_on_all_links_loads_and_follows_the_paper_distribution(tmp_path):
    out = tmp_path / "trace.yaml"
    r = subprocess.run([sys.executable, str(SCRIPT), "--stages", "4", "--slow", "all", "--rate", "B",
                        "--duration-s", "30", "--seed", "7", "-o", str(out)], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    tr = load_trace(str(out), 3)
    pts = [p.model_dump() for p in tr.points]
    assert pts[0]["t"] == 0.0 and pts[-1]["t"] < 30.0
    draws = [c for p in pts for c in p["links_ms"]]
    assert min(draws) >= 0.0
    for link in range(3):
        times = _changes(pts, link)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert 100 < len(times) < 310  # 30 s / U(100, 200) ms
        assert min(gaps) >= 0.1 - 1e-3 and max(gaps) <= 0.2 + 1e-3
        values = [p["links_ms"][link] for p in pts if p["t"] in set(times)]
        assert 27 < statistics.mean(values) < 33 and 7 < statistics.pstdev(values) < 13
    # The injector replays it: the delay at t is the last point's at or before t.
    sched = DelaySchedule([0, 0, 0], tr)
    assert sched.delay_ms(2) == pts[0]["links_ms"][2]


@pytest.mark.timeout(60)
def test_only_the_chosen_links_are_slow_and_the_seed_fixes_the_trace():
    a = make_trace(3, [2], 10.0, (500, 1000), seed=3)
    assert all(p["links_ms"][:2] == [0.0, 0.0] for p in a["points"])
    assert len({p["links_ms"][2] for p in a["points"]}) > 5
    assert a == make_trace(3, [2], 10.0, (500, 1000), seed=3)
    assert a != make_trace(3, [2], 10.0, (500, 1000), seed=4)


@pytest.mark.timeout(60)
def test_bad_arguments_give_one_sentence_and_exit_2(tmp_path):
    out = tmp_path / "t.yaml"
    r = subprocess.run([sys.executable, str(SCRIPT), "--stages", "4", "--slow", "5", "-o", str(out)],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and r.stderr.strip() == "error: slow link 5 does not exist: links are 0..2"
    assert not out.exists()
    with pytest.raises(ValueError, match=r"U\(200, 100\)"):
        make_trace(3, [0], 1.0, (200, 100))
