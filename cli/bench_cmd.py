"""``pipemorph bench``: stock DeepSpeed 1F1B, static zb and PipeMorph on the real engines, one table.

Scenarios are static delays on one or more slow links (``--delays-ms`` x ``--link``/``--links``) or
delay traces (``--trace``, ``--dynamic``); ``ds_pipemorph.bench.scenarios`` builds them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pydantic import ValidationError

from ds_pipemorph.bench.scenarios import dynamic_traces, link_sets, scenarios_for, trace_scenarios
from ds_pipemorph.bench.spec import DISPATCHES, LABELS, NOTES, SCHEDULES, BenchSpec
from ds_pipemorph.fileio import BadInput, describe
from ds_pipemorph.plan.profile import Costs
from ds_pipemorph.plan.variation import vary_tables
from ds_pipemorph.procs import kill_group, versioned_extensions_dir

from .common import console, parse_floats, user_errors


def bench(
    stages: int = typer.Option(4, min=2, help="Pipeline stages (one rank each)."),
    microbatches: int = typer.Option(12, min=1, help="Micro-batches per iteration."),
    op_ms: float = typer.Option(10.0, min=0.5, help="Emulated time of each F, B and W in ms."),
    delays_ms: Annotated[Optional[str], typer.Option(
        "--delays-ms", help="Delays to inject on the slow link(s), one scenario each.", show_default="0,20")] = None,
    link: Annotated[Optional[list[int]], typer.Option(
        "--link", help="A slow link (i joins stage i and i+1; -1 = the last one); repeat it for links slow "
                       "at once.", show_default="0")] = None,
    links: Annotated[Optional[list[str]], typer.Option(
        "--links", help="A set of links slow at once, e.g. 0,-1; repeat it for one scenario group per set.")] = None,
    trace: Annotated[Optional[list[Path]], typer.Option(
        "--trace", help="A delay trace file (make_trace.py's format) replayed from each row's first iteration "
                        "instead of static delays; repeat it for one scenario each.")] = None,
    dynamic: Annotated[bool, typer.Option(
        "--dynamic", help="PipeMorph §7.2: generate its three traces (every link N(30, 10) ms, changed every "
                          "U(50,100), U(100,200), U(200,400) ms; seed 0) next to --out, one scenario each.")] = False,
    iterations: int = typer.Option(5, min=1, help="Measured iterations per schedule."),
    warmup: int = typer.Option(4, min=0, help="Unmeasured iterations per schedule (PipeMorph re-plans in them)."),
    schedules: str = typer.Option(",".join(SCHEDULES), help="Which schedules to run."),
    dispatch: str = typer.Option("ordered", help="ordered, ready or ordered,ready: run our engine's rows with "
                                                 "each (ready: the plan is a hint, each stage runs the first "
                                                 "ready op of it)."),
    vary: Annotated[Optional[str], typer.Option(
        "--vary", help="Per-op time variation, as in simulate --vary: jitter:0.5 (each F and B scaled by a "
                       "factor with mean 1), heavy:frac=0.25,factor=3,stages=2 (heavy micro-batches on the "
                       "first stages), table:FILE; seeded variations are drawn anew each iteration.")] = None,
    out: Path = typer.Option(Path("out/bench.json"), "--out", help="Results as JSON."),
    timeout_s: float = typer.Option(1800.0, help="Give up on the run after this many seconds."),
) -> None:
    """Run the real engines side by side under injected slow links (static or a delay trace) and print one table."""
    with user_errors():
        if (trace or dynamic) and (delays_ms is not None or link or links):
            raise BadInput("--trace/--dynamic replace the static delays: drop --delays-ms, --link and --links")
        if trace or dynamic:
            sets, scenarios = [], trace_scenarios(stages, list(trace or []))
        else:
            sets = link_sets(stages, link, links)
            scenarios = scenarios_for(stages, parse_floats(delays_ms or "0,20", "--delays-ms") or [0.0], sets)
        names = [s.strip() for s in schedules.split(",") if s.strip()]
        dispatches = [d.strip() for d in dispatch.split(",") if d.strip()]
        for d in dispatches:
            if d not in DISPATCHES:
                raise BadInput(f"--dispatch: unknown dispatch '{d}': choose from {', '.join(DISPATCHES)}")
        for opt, vals in (("--dispatch", dispatches), ("--schedules", names)):
            if len(set(vals)) != len(vals):
                raise BadInput(f"{opt}: each value once, got {','.join(vals)}")
        if vary is not None:
            if "stock-1f1b" in names:
                raise BadInput("--vary times the ops of this package's engine; drop stock-1f1b from --schedules")
            vary_tables(vary, Costs.uniform(stages, op_ms), microbatches)  # a spec that does not parse: here
        for name in names:  # before --dynamic writes its traces
            if name not in SCHEDULES:
                raise BadInput(f"--schedules: unknown schedule '{name}': choose from {', '.join(SCHEDULES)}")
        work = Path(tempfile.mkdtemp(prefix="pipemorph-bench-"))
        if dynamic:
            paths = dynamic_traces(out.parent, stages, microbatches, op_ms, warmup + iterations)
            scenarios += trace_scenarios(stages, paths)
        try:
            spec = BenchSpec(stages=stages, microbatches=microbatches, op_ms=op_ms, scenarios=scenarios,
                             schedules=names, dispatches=dispatches or ["ordered"], vary=vary,
                             iterations=iterations, warmup=warmup, progress_file=str(work / "progress"),
                             out=str(out))
        except ValidationError as e:
            raise BadInput(f"--schedules/--delays-ms: {describe(e)}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    result = _run(spec, spec_path, work, timeout_s)
    _print(spec, result)


def _run(spec: BenchSpec, spec_path: Path, work: Path, timeout_s: float) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", versioned_extensions_dir())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec.stages}",
           "-m", "ds_pipemorph.bench.worker", str(spec_path)]
    log = open(work / "ranks.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    total = len(spec.scenarios) * len(spec.rows())
    progress_file = Path(spec.progress_file)
    t0 = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting ranks (DeepSpeed builds its CPU op on first use)", total=total)
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                kill_group(proc)
                raise typer.Exit(_fail(f"the benchmark did not finish within {timeout_s:g} s", work))
            if progress_file.exists():
                lines = progress_file.read_text().split("\n")
                done = [ln for ln in lines if ln.strip()]
                if done:
                    _, _, name, sched = done[-1].split()
                    bar.update(task, completed=len(done), description=f"ran {sched} under {name}")
            time.sleep(0.5)
    log.close()
    if not Path(spec.out).exists():
        raise typer.Exit(_fail(f"the ranks exited with code {proc.returncode} before writing results", work))
    return json.loads(Path(spec.out).read_text())


def _fail(msg: str, work: Path) -> int:
    console.print(f"error: {msg}; see {work / 'ranks.log'}", markup=False)
    return 1


def _print(spec: BenchSpec, result: dict) -> None:
    if any(sc.trace for sc in spec.scenarios):
        return _print_traces(spec, result)
    rows = result["results"]
    t = Table(title=f"{spec.stages} stages x {spec.microbatches} micro-batches, F=B=W={spec.op_ms:g} ms (emulated), "
                    f"median of {spec.iterations} iterations", title_justify="left")
    for col in ("scenario", "schedule", "measured ms", "predicted ms", "speedup vs stock"):
        t.add_column(col, justify="right")
    for sc in spec.scenarios:
        mine = [r for r in rows if r["scenario"] == sc.name]
        stock = next((r["median_ms"] for r in mine if r["schedule"] == "stock-1f1b"), None)
        for r in mine:
            ratio = f"{stock / r['median_ms']:.2f}x" if stock else "-"
            t.add_row(sc.name, _label(r), f"{r['median_ms']:.0f}", f"{r['predicted_ms']:.0f}", ratio)
    console.print(t)
    _print_notes(spec, rows)
    console.print("predicted: the replay simulator's time for that schedule's plan under the injected delays "
                  "(direct slow links: one message in flight, the sender blocks)"
                  + ("; with --vary, the mean over the measured iterations of the replay of each one's op times, "
                     "ready rows replayed under ready dispatch" if spec.vary or "ready" in spec.dispatches else ""))
    console.print(f"results: {spec.out}")


def _print_traces(spec: BenchSpec, result: dict) -> None:
    """Delay traces: mean iteration time per schedule and each one's ratio to PipeMorph's."""
    rows = result["results"]
    t = Table(title=f"{spec.stages} stages x {spec.microbatches} micro-batches, F=B=W={spec.op_ms:g} ms (emulated), "
                    f"delay traces, mean of {spec.iterations} iterations", title_justify="left")
    for col in ("scenario", "schedule", "mean ms", "predicted ms", "x / PipeMorph"):
        t.add_column(col, justify="right")
    for sc in spec.scenarios:
        mine = [r for r in rows if r["scenario"] == sc.name]
        ratios = result.get("ratios", {}).get(sc.name, {})
        for r in mine:
            ratio = ratios.get(r["schedule"]) if r.get("dispatch", "ordered") == "ordered" else None
            t.add_row(sc.name, _label(r), f"{r['mean_ms']:.0f}", f"{r['predicted_ms']:.0f}",
                      "-" if ratio is None else f"{ratio:.2f}x")
    console.print(t)
    for sc in spec.scenarios:
        ratios = result.get("ratios", {}).get(sc.name, {})
        named = [f"{LABELS[k]}/PipeMorph {v:.2f}x" for k, v in ratios.items() if k in ("stock-1f1b", "zb")]
        if named:
            console.print(f"{sc.name}: " + ", ".join(named))
    _print_notes(spec, rows)
    console.print("predicted: the replay simulator's time for that schedule's plan under the trace's mean delays; "
                  "every row replays the trace from its first iteration")
    console.print(f"results: {spec.out}")


def _label(r: dict) -> str:
    return LABELS[r["schedule"]] + (", ready" if r.get("dispatch") == "ready" else "")


def _print_dispatch(spec: BenchSpec, rows: list[dict]) -> None:
    """Ordered over ready dispatch of the same schedule, and what choosing an op cost."""
    if "ready" not in spec.dispatches:
        return
    for r in rows:
        if r.get("dispatch") != "ready":
            continue
        o = next((x for x in rows if x["scenario"] == r["scenario"] and x["schedule"] == r["schedule"]
                  and x.get("dispatch") == "ordered"), None)
        vs = f"ordered / ready {o['mean_ms'] / r['mean_ms']:.3f}x (means), " if o else ""
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
                f"; {oh['steady_ms_per_iteration']:.1f} ms = {oh['steady_pct_of_iteration']:.1f}% without re-plans")
            each = "" if oh["replan_ms_each"] is None else f", {oh['replan_ms_each']:.0f} ms per re-plan"
            console.print(f"{r['scenario']}: PipeMorph's profiler and control loop cost "
                          f"{oh['ms_per_iteration']:.1f} ms per iteration ({oh['pct_of_iteration']:.1f}% of a "
                          f"{oh['iteration_ms']:.0f} ms iteration{steady}; link samples {oh['parts_ms']['links']:.1f} ms, "
                          f"all_gather {oh['parts_ms']['exchange']:.1f} ms{each})")
    for k in spec.schedules:
        console.print(f"{LABELS[k]}: {NOTES[k]}")
