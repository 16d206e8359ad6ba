"""``pipemorph bench``: stock DeepSpeed 1F1B, static zb and PipeMorph on the real engines, one table.

Scenarios are static delays on one or more slow links (``--delays-ms`` x ``--link``/``--links``) or
delay traces (``--trace``, ``--dynamic``); ``ds_pipemorph.bench.scenarios`` builds them. The work is
``run_bench(BenchArgs)``, a plain function that ``pipemorph demo`` calls too; ``bench`` only reads
the command line into a ``BenchArgs``.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from ds_pipemorph.bench.launch import JobFailed, run_job
from ds_pipemorph.bench.scenarios import dynamic_traces, link_sets, scenarios_for, trace_scenarios
from ds_pipemorph.bench.spec import DISPATCHES, LABELS, SCHEDULES, BenchSpec, Scenario
from ds_pipemorph.bench.traces import paper_trace_paths
from ds_pipemorph.fileio import BadInput, describe
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sim.variation import vary_tables

from .bench_table import print_results
from .common import announce, check_outputs, console, err_console, parse_floats, stopped_by_signal, user_errors
from .progress import bar


@dataclass(frozen=True)
class BenchArgs:
    """Everything one benchmark run takes, as plain values (the defaults are ``pipemorph bench``'s)."""

    stages: int = 4
    microbatches: int = 12
    op_ms: float = 10.0
    delays_ms: Optional[str] = None  # "0,20" unless a trace is given
    link: tuple[int, ...] = ()  # slow at once; () = link 0 unless --links
    links: tuple[str, ...] = ()  # one scenario group per "0,-1"
    trace: tuple[Path, ...] = ()
    dynamic: bool = False
    iterations: int = 5
    warmup: int = 4
    schedules: str = ",".join(SCHEDULES)
    dispatch: str = "ordered"
    vary: Optional[str] = None
    budget: str = "1"  # our rows' memory.budget: a factor over stock 1F1B's activation memory, or "none"
    out: Path = Path("out/bench.json")
    timeout_s: float = 1800.0
    command: str = "pipemorph bench"  # what a stopped run names


D = BenchArgs()
BUDGET_HELP = ("Our engine's activation memory per stage as a multiple of stock 1F1B's (memory.budget): 1 (the "
               "default, what stock holds), 2, ..., or none (no limit).")


def parse_budget(text: str) -> Optional[float]:
    """``--budget``: a number of at least 1, or ``none``."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadInput(f"--budget: expected a number such as 1.5, or none, not '{text}'") from None
    if value < 1.0:
        raise BadInput(f"--budget {text} leaves the last stage less than one micro-batch's activations: use at least 1")
    return value


def bench(
    stages: int = typer.Option(D.stages, min=2, help="Pipeline stages (one rank each)."),
    microbatches: int = typer.Option(D.microbatches, min=1, help="Micro-batches per iteration."),
    op_ms: float = typer.Option(D.op_ms, min=0.5, help="Emulated time of each F, B and W in ms."),
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
    iterations: int = typer.Option(D.iterations, min=1, help="Measured iterations per schedule."),
    warmup: int = typer.Option(D.warmup, min=0, help="Unmeasured iterations per schedule (PipeMorph re-plans in them)."),
    schedules: str = typer.Option(D.schedules, help="Which schedules to run."),
    dispatch: str = typer.Option(D.dispatch, help="ordered, ready or ordered,ready: run our engine's rows with "
                                                  "each (ready: the plan is a hint, each stage runs the first "
                                                  "ready op of it)."),
    vary: Annotated[Optional[str], typer.Option(
        "--vary", help="Per-op time variation, as in simulate --vary: jitter:0.5 (each F and B scaled by a "
                       "factor with mean 1), heavy:frac=0.25,factor=3,stages=2 (heavy micro-batches on the "
                       "first stages), table:FILE; seeded variations are drawn anew each iteration.")] = None,
    budget: str = typer.Option(D.budget, "--budget", help=BUDGET_HELP),
    out: Path = typer.Option(D.out, "--out", help="Results as JSON."),
    timeout_s: float = typer.Option(D.timeout_s, help="Give up on the run after this many seconds."),
) -> None:
    """Run the real engines side by side under injected slow links (static or a delay trace) and print one table."""
    run_bench(BenchArgs(stages=stages, microbatches=microbatches, op_ms=op_ms, delays_ms=delays_ms,
                        link=tuple(link or ()), links=tuple(links or ()), trace=tuple(trace or ()), dynamic=dynamic,
                        iterations=iterations, warmup=warmup, schedules=schedules, dispatch=dispatch, vary=vary,
                        budget=budget, out=out, timeout_s=timeout_s))


def run_bench(args: BenchArgs) -> None:
    """Check everything, run the ranks with progress shown, print the table, say what was written.
    Bad input: one sentence and exit code 2 before any rank starts; a failed job: exit code 1."""
    with user_errors():
        fields = _checked(args)
        if args.dynamic:
            written = dynamic_traces(args.out.parent, args.stages, args.microbatches, args.op_ms,
                                     args.warmup + args.iterations)
            announce(written)
            fields["scenarios"] += trace_scenarios(args.stages, written)
    work = Path(tempfile.mkdtemp(prefix="pipemorph-bench-"))
    spec = BenchSpec(progress_file=str(work / "progress"), out=str(args.out), **fields)
    spec_path = work / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    try:
        with stopped_by_signal(args.command, work):
            result = _run_with_progress(spec, spec_path, work, args.timeout_s)
    except JobFailed as e:  # the ranks' log stays for the message to point at
        err_console.print(f"error: {e}", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    shutil.rmtree(work, ignore_errors=True)
    print_results(spec, result)
    announce([args.out])


def _checked(args: BenchArgs) -> dict:
    """Every option checked and every output writable, before anything runs or is written: the
    spec's fields (scenarios without the ones of the traces --dynamic writes)."""
    if (args.trace or args.dynamic) and (args.delays_ms is not None or args.link or args.links):
        raise BadInput("--trace/--dynamic replace the static delays: drop --delays-ms, --link and --links")
    dynamic_paths = paper_trace_paths(args.out.parent) if args.dynamic else []
    check_outputs({"--out": args.out, **{f"--dynamic ({p.name})": p for p in dynamic_paths}})
    if args.trace or args.dynamic:
        scenarios = trace_scenarios(args.stages, list(args.trace))
    else:
        sets = link_sets(args.stages, list(args.link), list(args.links))
        scenarios = scenarios_for(args.stages, parse_floats(args.delays_ms or "0,20", "--delays-ms") or [0.0], sets)
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    dispatches = [d.strip() for d in args.dispatch.split(",") if d.strip()]
    for d in dispatches:
        if d not in DISPATCHES:
            raise BadInput(f"--dispatch: unknown dispatch '{d}': choose from {', '.join(DISPATCHES)}")
    for opt, vals in (("--dispatch", dispatches), ("--schedules", names)):
        if len(set(vals)) != len(vals):
            raise BadInput(f"{opt}: each value once, got {','.join(vals)}")
    for name in names:
        if name not in SCHEDULES:
            raise BadInput(f"--schedules: unknown schedule '{name}': choose from {', '.join(SCHEDULES)}")
    if args.vary is not None:
        vary_tables(args.vary, Costs.uniform(args.stages, args.op_ms), args.microbatches)  # a spec that does not parse
    fields = dict(stages=args.stages, microbatches=args.microbatches, op_ms=args.op_ms, schedules=names,
                  dispatches=dispatches or ["ordered"], vary=args.vary, iterations=args.iterations, warmup=args.warmup,
                  budget=parse_budget(args.budget))
    try:  # the spec's own checks, on a stand-in for the trace scenarios --dynamic adds later
        stand_in = [Scenario(name="-", links_ms=[0.0] * (args.stages - 1))]
        BenchSpec(scenarios=scenarios or stand_in, progress_file="-", out=str(args.out), **fields)
    except ValidationError as e:
        raise BadInput(f"--schedules/--delays-ms: {describe(e)}") from None
    return dict(fields, scenarios=scenarios)


def _run_with_progress(spec: BenchSpec, spec_path: Path, work: Path, timeout_s: float) -> dict:
    """The job, with a bar over every iteration of every row: scenario k of n, schedule, iteration i
    of m (warm-up ones marked), elapsed time."""
    per_row = spec.warmup + spec.iterations
    total = len(spec.scenarios) * len(spec.rows()) * per_row
    with bar() as progress:
        task = progress.add_task(f"starting {spec.stages} ranks (DeepSpeed builds its CPU op on first use)", total=total)

        def show(line: Optional[dict]) -> None:
            if line is None:
                return
            sched = line["schedule"].split("/")
            label = LABELS.get(sched[0], sched[0]) + (", ready" if sched[1:] else "")
            what = "warm-up iteration" if line["warmup"] else "iteration"
            progress.update(task, completed=(line["row"] - 1) * per_row + line["iteration"],
                            description=f"scenario {line['scenario']}/{line['scenarios']} {line['name']}: "
                                        f"{label} (row {line['row']}/{line['rows']}), {what} "
                                        f"{line['iteration']}/{line['iterations']}")

        return run_job(spec, spec_path, work, timeout_s, show)
