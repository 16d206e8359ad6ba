"""What ``pipemorph bench`` prints from its results: one table per run and the notes under it.

A static-delay table reports each row's median iteration (``statistics.median``: the mean of the
middle two over an even count), a delay-trace table the mean; every line under a table that
compares rows uses the table's statistic and names it.
"""
from __future__ import annotations

from rich.table import Table

from ds_pipemorph.bench.spec import LABELS, NOTES, BenchSpec, budget_text

from .common import console

FEW_ITERATIONS = 3  # below this, a median is no guard against one slow iteration


def statistic(spec: BenchSpec) -> tuple[str, str]:
    """(result key, word) of the statistic the run's table reports."""
    return ("mean_ms", "mean") if any(sc.trace for sc in spec.scenarios) else ("median_ms", "median")


def print_results(spec: BenchSpec, result: dict) -> None:
    if any(sc.trace for sc in spec.scenarios):
        _print_traces(spec, result)
    else:
        _print_static(spec, result)
    if spec.iterations < FEW_ITERATIONS:
        _, word = statistic(spec)
        console.print(f"note: only {spec.iterations} measured iteration{'s' if spec.iterations > 1 else ''} per row; "
                      f"each {word} is over that few (--iterations {FEW_ITERATIONS} or more for a steadier one)",
                      soft_wrap=True)


def _print_static(spec: BenchSpec, result: dict) -> None:
    rows = result["results"]
    t = Table(title=f"{spec.stages} stages x {spec.microbatches} micro-batches, F=B=W={spec.op_ms:g} ms (emulated), "
                    f"median of {spec.iterations} iterations", title_justify="left")
    for col in ("scenario", "schedule", "measured ms", "predicted ms", "speedup vs stock", "memory"):
        t.add_column(col, justify="right")
    for sc in spec.scenarios:
        mine = [r for r in rows if r["scenario"] == sc.name]
        stock = next((r["median_ms"] for r in mine if r["schedule"] == "stock-1f1b"), None)
        for r in mine:
            ratio = f"{stock / r['median_ms']:.2f}x" if stock else "-"
            t.add_row(sc.name, _label(r), f"{r['median_ms']:.0f}", f"{r['predicted_ms']:.0f}", ratio, _memory(r))
    console.print(t)
    _print_notes(spec, rows)
    console.print("predicted: the replay simulator's time for that schedule's plan under the injected delays "
                  "(direct slow links: one message in flight, the sender blocks)"
                  + ("; with --vary, the mean over the measured iterations of the replay of each one's op times, "
                     "ready rows replayed under ready dispatch" if spec.vary or "ready" in spec.dispatches else ""))


def _print_traces(spec: BenchSpec, result: dict) -> None:
    """Delay traces: mean iteration time per schedule and each one's ratio to PipeMorph's."""
    rows = result["results"]
    t = Table(title=f"{spec.stages} stages x {spec.microbatches} micro-batches, F=B=W={spec.op_ms:g} ms (emulated), "
                    f"delay traces, mean of {spec.iterations} iterations", title_justify="left")
    for col in ("scenario", "schedule", "mean ms", "predicted ms", "x / PipeMorph", "memory"):
        t.add_column(col, justify="right")
    for sc in spec.scenarios:
        mine = [r for r in rows if r["scenario"] == sc.name]
        ratios = result.get("ratios", {}).get(sc.name, {})
        for r in mine:
            ratio = ratios.get(r["schedule"]) if r.get("dispatch", "ordered") == "ordered" else None
            t.add_row(sc.name, _label(r), f"{r['mean_ms']:.0f}", f"{r['predicted_ms']:.0f}",
                      "-" if ratio is None else f"{ratio:.2f}x", _memory(r))
    console.print(t)
    for sc in spec.scenarios:
        ratios = result.get("ratios", {}).get(sc.name, {})
        named = [f"{LABELS[k]}/PipeMorph {v:.2f}x" for k, v in ratios.items() if k in ("stock-1f1b", "zb")]
        if named:
            console.print(f"{sc.name}: " + ", ".join(named) + " (means)")
    _print_notes(spec, rows)
    console.print("predicted: the replay simulator's time for that schedule's plan under the trace's mean delays; "
                  "every row replays the trace from its first iteration")


def _memory(r: dict) -> str:
    """The activation memory a row was allowed: stock's own (S - s micro-batches), or the budget."""
    if r["schedule"] == "stock-1f1b":
        return "stock"
    return budget_text(r.get("budget", 1.0))


def _label(r: dict) -> str:
    return LABELS[r["schedule"]] + (", ready" if r.get("dispatch") == "ready" else "")


def _print_dispatch(spec: BenchSpec, rows: list[dict]) -> None:
    """Ordered over ready dispatch of the same schedule, in the table's statistic, and what choosing an op cost."""
    if "ready" not in spec.dispatches:
        return
    key, word = statistic(spec)
    for r in rows:
        if r.get("dispatch") != "ready":
            continue
        o = next((x for x in rows if x["scenario"] == r["scenario"] and x["schedule"] == r["schedule"]
                  and x.get("dispatch") == "ordered"), None)
        vs = f"ordered / ready {o[key] / r[key]:.3f}x ({word}s), " if o else ""
        console.print(f"{r['scenario']}: {LABELS[r['schedule']]}: {vs}choosing the next op "
                      f"{r['choosing_us_per_op']:.1f} us per op")


def _print_notes(spec: BenchSpec, rows: list[dict]) -> None:
    _print_dispatch(spec, rows)
    for r in rows:
        for ev in r["replans"][:3]:
            console.print(f"{r['scenario']}: PipeMorph re-planned after iteration {ev['iteration']} for measured "
                          f"{[None if v is None else round(v, 1) for v in ev['measured_ms']]} ms, warm-up {ev['warmup']}")
        if len(r["replans"]) > 3:
            console.print(f"{r['scenario']}: ... and {len(r['replans']) - 3} more re-plans (see the JSON)")
    for r in rows:
        oh = r.get("profiler_overhead")
        if oh:
            steady = "" if oh["steady_ms_per_iteration"] is None else (
                f"; {oh['steady_ms_per_iteration']:.1f} ms = {oh['steady_pct_of_iteration']:.1f}% without re-plans and the "
                f"delegates' start")
            each = "" if oh["replan_ms_each"] is None else f", {oh['replan_ms_each']:.0f} ms per re-plan"
            start = oh["parts_ms"].get("prewarm", 0.0)
            each += f", the delegates' start {start:.1f} ms per iteration" if start > 0 else ""
            console.print(f"{r['scenario']}: PipeMorph's profiler and control loop cost "
                          f"{oh['ms_per_iteration']:.1f} ms per iteration ({oh['pct_of_iteration']:.1f}% of a "
                          f"{oh['iteration_ms']:.0f} ms iteration, the median of all, warm-up included{steady}; link samples {oh['parts_ms']['links']:.1f} ms, "
                          f"all_gather {oh['parts_ms']['exchange']:.1f} ms{each})")
    for k in spec.schedules:
        console.print(f"{LABELS[k]}: {NOTES[k]}")
