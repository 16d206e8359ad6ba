"""``pipemorph paired A B``: two configurations alternated in one run, compared pair by pair.

The ratio B/A is the median of per-pair ratios with a bootstrap 95 % interval, next to the A/A noise
check (``ds_pipemorph.paired``); ``docs/paired.md`` explains the method.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ds_pipemorph.paired import cycles_for
from ds_pipemorph.bench.paired_spec import PairedSpec, check_job_sides, parse_side, share_a_job
from ds_pipemorph.fileio import BadInput, describe, write_atomic

from .bench_cmd import BUDGET_HELP, parse_budget
from .common import announce, check_outputs, console, err_console, parse_floats, stopped_by_signal, user_errors


def paired(
    a: Annotated[str, typer.Argument(help="Side A, the reference: PLAN[+MODIFIER...] with PLAN zb, 1f1b, "
                                          "plan:FILE, stock-1f1b or pipemorph; modifiers ordered, ready, "
                                          "direct, delegated, recvN (N receives of each kind posted ahead "
                                          "under ordered dispatch); e.g. zb+ready, 1f1b+recv2.")],
    b: Annotated[str, typer.Argument(help="Side B, compared with A (B/A > 1: B takes longer).")],
    stages: int = typer.Option(4, min=2, help="Pipeline stages (one rank each)."),
    microbatches: int = typer.Option(12, min=1, help="Micro-batches per iteration."),
    op_ms: float = typer.Option(10.0, min=0.5, help="Emulated time of each F, B and W in ms."),
    links_ms: Annotated[Optional[str], typer.Option(
        "--links-ms", help="Injected one-way delay of every link, S-1 values (e.g. 0,0,30).",
        show_default="no delay")] = None,
    pairs: int = typer.Option(20, min=2, help="B/A pairs to measure (A B A' B gives two, and one A/A pair)."),
    warmup: int = typer.Option(4, min=0, help="Unmeasured iterations first (whole jobs: in each job)."),
    job_iterations: int = typer.Option(5, min=1, help="Whole jobs only: measured iterations per job."),
    seed: int = typer.Option(0, help="Seed of the bootstrap."),
    out: Path = typer.Option(Path("out/paired.json"), "--out", help="Results as JSON."),
    budget: str = typer.Option("1", "--budget", help=BUDGET_HELP),
    timeout_s: float = typer.Option(1800.0, min=1.0, help="Give up on the run after this many seconds."),
) -> None:
    """Alternate A and B every iteration in one job (or whole jobs where they cannot share one) and print B/A."""
    from ds_pipemorph.bench.paired_launch import PairedRunError, run

    with user_errors():
        side_a, side_b = parse_side(a, "A"), parse_side(b, "B")
        limit = parse_budget(budget)
        if not share_a_job(side_a, side_b):
            check_job_sides(side_a, side_b)
        check_outputs({"--out": out})
        delays = parse_floats(links_ms, "--links-ms") if links_ms is not None else [0.0] * (stages - 1)
        work = Path(tempfile.mkdtemp(prefix="pipemorph-paired-"))
        try:
            spec = PairedSpec(a=side_a, b=side_b, stages=stages, microbatches=microbatches, op_ms=op_ms,
                              links_ms=delays, cycles=cycles_for(pairs), warmup=warmup,
                              job_iterations=job_iterations, seed=seed, out=str(work / "iterations.json"),
                              progress_file=str(work / "progress"), budget=limit)
        except ValidationError as e:
            shutil.rmtree(work, ignore_errors=True)
            raise BadInput(describe(e)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting ranks", total=spec.iterations)

        printed, seen_total = [0], [0]

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)
            seen_total[0] = total
            # Not a terminal (a log, CI): no bar is drawn; a line per pair instead (A and B, one each),
            # those the last look skipped included.
            if not console.is_terminal:
                for k in range(printed[0] + 1, done // 2 + 1):
                    print(f"pair {k} of {total // 2} done ({what})", flush=True)
                printed[0] = max(printed[0], done // 2)

        try:
            with stopped_by_signal("pipemorph paired", work):
                result = run(spec, work, timeout_s, progress)
            if seen_total[0]:  # the last pairs may have ended between two looks
                progress(seen_total[0], seen_total[0], "done")
        except PairedRunError as e:
            err_console.print(f"error: {e}", markup=False)
            raise typer.Exit(1) from None
    shutil.rmtree(work, ignore_errors=True)  # kept only when the run failed: its logs are named then
    write_atomic(str(out), json.dumps(result, indent=2) + "\n")
    print_result(spec, result)
    announce([out])


def print_result(spec: PairedSpec, result: dict) -> None:
    c = result["comparison"]
    t = Table(title=f"{spec.stages} stages x {spec.microbatches} micro-batches, F=B=W={spec.op_ms:g} ms (emulated), "
                    f"links {spec.links_ms} ms", title_justify="left")
    for col in ("comparison", "median ratio", "95% interval", "pairs", "median ms"):
        t.add_column(col, justify="right")
    r = c["ratio"]
    t.add_row(f"B/A  {spec.b.text} / {spec.a.text}", f"{r['median']:.3f}", f"[{r['lo']:.3f}, {r['hi']:.3f}]",
              str(r["pairs"]), f"{c['b_median_ms']:.1f} / {c['a_median_ms']:.1f}")
    n = c["noise"]
    if n is not None:
        t.add_row(f"A'/A {spec.a.text} / itself", f"{n['median']:.3f}", f"[{n['lo']:.3f}, {n['hi']:.3f}]",
                  str(n["pairs"]), "")
    console.print(t)
    console.print(f"alternation: {result['mode']}", markup=False)
    console.print(f"verdict: {c['verdict']}", markup=False)
