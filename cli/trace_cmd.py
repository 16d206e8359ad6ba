"""``pipemorph trace inspect|compare``: measured timelines (Nsight Systems SQLite or Chrome JSON)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.files.planfile import PlanFile
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.trace.compare import compare as compare_timelines
from ds_pipemorph.trace.load import load_measured
from ds_pipemorph.trace.measured import analyze, check_iteration, iteration_timeline

from .common import announce, check_outputs, console, err_console, print_json, user_errors, write_outputs

app = typer.Typer(
    help="Read measured timelines: Nsight Systems SQLite exports and Chrome traces of the engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# What the times of a measured timeline are, said with every ``inspect``.
MEASURES = ("host time: each op's range spans what the host spent on it; on a GPU that is the launch of its "
            "kernels, not the kernels (the engine's CUDA events give F, B and W device times: "
            "engine.recorder.device_ms())")


def _f(x: Optional[float], fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _warn(trace) -> None:
    for w in trace.warnings:
        err_console.print(f"warning: {w}", markup=False, soft_wrap=True)


@app.command("inspect")
def inspect(
    report: Path = typer.Argument(..., metavar="REPORT", help="`nsys export --type sqlite` output (or a Chrome trace JSON of the engine)."),
    chrome: Optional[Path] = typer.Option(None, "--chrome", help="Write a Perfetto trace: a process per rank, compute/send/receive tracks, message arrows."),
    gantt: Optional[Path] = typer.Option(None, "--gantt", help="Write a Gantt picture of the compute ops of one iteration (format from the suffix: .png, .pdf, .svg, ...)."),
    iteration: Optional[int] = typer.Option(None, "--iteration", help="Iteration for --gantt (default: the last complete one)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of the tables."),
) -> None:
    """Per-rank iteration times, bubble rates, blocked send/receive time and the slowest links."""
    with user_errors():
        check_outputs({"--chrome": chrome}, pictures={"--gantt": gantt})
        trace = load_measured(report)
        an = analyze(trace)
        k = check_iteration(trace, iteration)
        outputs: dict = {}
        if chrome:
            from ds_pipemorph.trace.measured_chrome import chrome_json

            outputs[str(chrome)] = chrome_json(trace)
        if gantt:
            from ds_pipemorph.trace.gantt import gantt_image, image_format

            tl = iteration_timeline(trace, k)
            outputs[str(gantt)] = gantt_image(tl, f"measured iteration {k} (compute ops)",
                                              fmt=image_format(gantt))
        write_outputs(outputs)
    _warn(trace)
    result = an.to_json()
    if as_json:
        print_json({"source": str(report), "warnings": trace.warnings, "measures": MEASURES, **result})
        announce(outputs, to_stderr=True)
        return
    t = Table(title=f"{report}: {len(trace.ranks)} ranks, {trace.stages} stages, iterations {an.iterations}", title_justify="left")
    for col in ("rank", "stage", "iterations", "mean iter ms", "median iter ms", "bubble rate", "send-blocked ms", "recv-blocked ms"):
        t.add_column(col, justify="right")
    for r in result["ranks"]:
        t.add_row(str(r["rank"]), str(r["stage"]), str(r["iterations"]), _f(r["iteration_ms"]["mean"]),
                  _f(r["iteration_ms"]["median"]), _f(r["bubble_rate"]["mean"], ".1%"),
                  _f(r["send_blocked_ms"]["mean"]), _f(r["recv_blocked_ms"]["mean"]))
    console.print(t)
    pipe = result["pipeline"]
    console.print(f"pipeline: iteration mean {_f(pipe['iteration_ms']['mean'])} ms, median {_f(pipe['iteration_ms']['median'])} ms, "
                  f"bubble rate {_f(pipe['bubble_rate']['mean'], '.1%')}")
    console.print(f"times are {MEASURES}", soft_wrap=True)
    if result["links"]:
        lt = Table(title="links, slowest first (median of RECV end - SEND start)", title_justify="left")
        for col in ("link", "stages", "median one-way ms", "messages"):
            lt.add_column(col, justify="right")
        for ln in result["links"]:
            lt.add_row(str(ln["link"]), f"{ln['link']}-{ln['link'] + 1}", _f(ln["median_ms"], ".2f"), str(ln["messages"]))
        console.print(lt)
    announce(outputs)


@app.command("compare")
def compare(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="Plan file written by `pipemorph plan`."),
    timeline: Path = typer.Argument(..., metavar="TIMELINE", help="Nsight Systems SQLite export or the engine's Chrome trace JSON."),
    iteration: Optional[int] = typer.Option(None, "--iteration", help="Measured iteration to compare (default: the last complete one)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of the tables."),
) -> None:
    """Planned vs measured start offset and duration per op, order divergence and lateness per rank."""
    with user_errors():
        pf, sched = PlanFile.read(plan_path)
        costs = pf.costs()
        if costs is None:
            raise BadInput(f"{plan_path} carries no profile, so its planned op times are unknown")
        planned = replay(sched, costs, pf.microbatches, fused_backward=pf.fused)
        trace = load_measured(timeline)
        k = check_iteration(trace, iteration)
        cmp = compare_timelines(sched, planned, trace, k, str(plan_path))
    _warn(trace)
    if as_json:
        print_json({"plan": str(plan_path), "timeline": str(timeline), **cmp.to_json()})
        return
    t = Table(title=f"iteration {k}: planned {cmp.planned_ms:.1f} ms, measured {cmp.measured_ms:.1f} ms (offsets from the iteration start)",
              title_justify="left")
    for col in ("rank", "stage", "op", "planned start", "measured start", "late ms", "planned ms", "measured ms"):
        t.add_column(col, justify="right")
    for r in cmp.rows:
        t.add_row(str(r.rank), str(r.stage), str(r.op), _f(r.planned_start_ms), _f(r.measured_start_ms), _f(r.late_ms),
                  _f(r.planned_ms), _f(r.measured_ms))
    console.print(t)
    if cmp.divergences:
        for d in cmp.divergences:
            console.print(f"rank {d.rank} (stage {d.stage}): order diverges at position {d.index}: "
                          f"planned {d.planned or '(end)'}, measured {d.measured or '(end)'}")
    else:
        console.print("measured order = planned order on every rank")
    lt = Table(title="lateness per rank (measured start - planned start)", title_justify="left")
    for col in ("rank", "stage", "mean late ms", "worst late ms", "worst op", "missing ops"):
        lt.add_column(col, justify="right")
    for x in cmp.lateness:
        lt.add_row(str(x.rank), str(x.stage), _f(x.mean_ms), _f(x.worst_ms), x.worst_op, str(x.missing))
    console.print(lt)
