"""``pipemorph bench``: stock DeepSpeed 1F1B, static zb and PipeMorph on the real engines, one table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ds_pipemorph.bench.spec import LABELS, NOTES, SCHEDULES, BenchSpec, Scenario
from pydantic import ValidationError

from ds_pipemorph.fileio import BadInput, describe
from ds_pipemorph.procs import kill_group, versioned_extensions_dir

from .common import console, parse_floats, user_errors


def scenarios_for(stages: int, delays: list[float], link: int) -> list[Scenario]:
    out = []
    for c in delays:
        links = [0.0] * (stages - 1)
        links[link] = c
        out.append(Scenario(name=f"{c:g}ms_link{link}" if c else "no_delay", links_ms=links))
    return out


def bench(
    stages: int = typer.Option(4, min=2, help="Pipeline stages (one rank each)."),
    microbatches: int = typer.Option(12, min=1, help="Micro-batches per iteration."),
    op_ms: float = typer.Option(10.0, min=0.5, help="Emulated time of each F, B and W in ms."),
    delays_ms: str = typer.Option("0,20", "--delays-ms", help="Delays to inject on the slow link, one scenario each."),
    link: int = typer.Option(0, help="The slow link (i joins stage i and i+1); -1 = the last one."),
    iterations: int = typer.Option(5, min=1, help="Measured iterations per schedule."),
    warmup: int = typer.Option(4, min=0, help="Unmeasured iterations per schedule (PipeMorph re-plans in them)."),
    schedules: str = typer.Option(",".join(SCHEDULES), help="Which schedules to run."),
    out: Path = typer.Option(Path("out/bench.json"), "--out", help="Results as JSON."),
    timeout_s: float = typer.Option(1800.0, help="Give up on the run after this many seconds."),
) -> None:
    """Run the real engines side by side under an injected slow link and print one table."""
    with user_errors():
        link = link if link >= 0 else stages - 2
        if not 0 <= link < stages - 1:
            raise BadInput(f"--link: {link} is not a link of {stages} stages (0..{stages - 2})")
        delays = parse_floats(delays_ms, "--delays-ms") or [0.0]
        work = Path(tempfile.mkdtemp(prefix="pipemorph-bench-"))
        try:
            spec = BenchSpec(stages=stages, microbatches=microbatches, op_ms=op_ms,
                             scenarios=scenarios_for(stages, delays, link),
                             schedules=[s.strip() for s in schedules.split(",") if s.strip()],
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
    total = len(spec.scenarios) * len(spec.schedules)
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
            t.add_row(sc.name, LABELS[r["schedule"]], f"{r['median_ms']:.0f}", f"{r['predicted_ms']:.0f}", ratio)
    console.print(t)
    for r in rows:
        for ev in r["replans"]:
            console.print(f"{r['scenario']}: PipeMorph re-planned after iteration {ev['iteration']} for measured "
                          f"{[None if v is None else round(v, 1) for v in ev['measured_ms']]} ms, warm-up {ev['warmup']}")
    for k in spec.schedules:
        console.print(f"{LABELS[k]}: {NOTES[k]}")
    console.print("predicted: the replay simulator's time for that schedule's plan under the injected delays "
                  "(direct slow links: one message in flight, the sender blocks)")
    console.print(f"results: {spec.out}")
