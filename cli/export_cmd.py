"""``pipemorph export PLAN --format torch-csv -o FILE``: a plan lowered to per-rank streams, as a file
another runtime loads (torch pipelining's ``_PipelineScheduleRuntime``, ``format="compute_comms"``)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.files.planfile import PlanFile
from ds_pipemorph.plan.files.torch_csv import check_torch_runnable, torch_csv

from .common import check_outputs, console, user_errors, write_outputs

FORMATS = ("torch-csv",)


def export(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="Plan file written by `pipemorph plan`."),
    fmt: str = typer.Option("torch-csv", "--format", help="Output format: torch-csv (torch pipelining's compute+comms schedule CSV, one row per rank)."),
    output: Path = typer.Option(..., "-o", "--output", help="Write the exported schedule here."),
    ranks: Optional[int] = typer.Option(None, "--ranks", help="Pipeline ranks the file is for; must equal the plan's stages (one stage per rank)."),
) -> None:
    """Lower a plan (communication placed, checked deadlock-free) and write it for another runtime."""
    with user_errors():
        check_outputs({"--output": output})
        if fmt not in FORMATS:
            raise BadInput(f"--format: unknown format '{fmt}'; choose from {', '.join(FORMATS)}")
        pf, sched = PlanFile.read(plan_path)
        if ranks is not None and ranks != pf.stages:
            raise BadInput(f"--ranks {ranks}: the plan has {pf.stages} stages, and each rank runs one stage")
        check_torch_runnable(sched)
        # the engine's ordered lowering, dry-run with messages matched in order (as torch does)
        streams = pf.lowering.lower(sched)
        write_outputs({str(output): torch_csv(streams)})
    console.print(f"wrote {output}: {pf.stages} ranks, one row each (torch pipelining, format=\"compute_comms\")", markup=False)
