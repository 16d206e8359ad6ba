"""What `pipemorph bench` prints from its results: the true median, one statistic in the table and the
lines under it, and a note when a row has fewer than 3 measured iterations."""
import pytest

from ds_pipemorph.bench.spec import BenchSpec, Scenario
from ds_pipemorph.bench.summary import summarize
from ds_pipemorph_cli.bench_table import print_results


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two():
    s = summarize([500.0, 400.0, 430.0, 410.0])
    # sorted 400, 410, 430, 500: median (410 + 430) / 2 = 420; mean 1740 / 4 = 435
    assert s["median_ms"] == 420.0 and s["mean_ms"] == 435.0
    assert summarize([30.0, 10.0, 20.0])["median_ms"] == 20.0
    assert summarize([7.0])["median_ms"] == 7.0


def spec(iterations: int) -> BenchSpec:
    return BenchSpec(stages=2, microbatches=4, op_ms=4, scenarios=[Scenario(name="no_delay", links_ms=[0.0])],
                     schedules=["zb"], dispatches=["ordered", "ready"], iterations=iterations, warmup=1,
                     progress_file="-", out="out/bench.json")


def row(dispatch: str, times: list[float]) -> dict:
    r = {"scenario": "no_delay", "schedule": "zb", "dispatch": dispatch, "links_ms": [0.0], "trace": None,
         "predicted_ms": 60.0, "replans": [], **summarize(times)}
    if dispatch == "ready":
        r["choosing_us_per_op"] = 5.0
    return r


def test_table_and_the_line_under_it_report_medians(capsys):
    # ordered: median 420 (mean 435); ready [380, 390, 410, 600]: median (390 + 410) / 2 = 400 (mean 445).
    result = {"results": [row("ordered", [400, 410, 430, 500]), row("ready", [380, 390, 410, 600])]}
    print_results(spec(4), result)
    out = capsys.readouterr().out
    assert "median of 4 iterations" in out
    cells = [[c.strip() for c in ln.split("│")[1:-1]] for ln in out.splitlines() if "│" in ln and "no_delay" in ln]
    assert [c[2] for c in cells] == ["420", "400"]
    # 420 / 400 = 1.050 by medians (by means it would be 435 / 445 = 0.978)
    assert "ordered / ready 1.050x (medians)" in out
    assert "only" not in out


@pytest.mark.parametrize("iterations,note", [(1, True), (2, True), (3, False)])
def test_fewer_than_three_iterations_are_said_in_one_line(capsys, iterations, note):
    times = [400.0, 420.0, 410.0][:iterations]
    print_results(spec(iterations), {"results": [row("ordered", times), row("ready", times)]})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note: only")]
    assert len(lines) == (1 if note else 0)
    if note:
        assert f"only {iterations} measured iteration" in lines[0] and "--iterations 3" in lines[0]
