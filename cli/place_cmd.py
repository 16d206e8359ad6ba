"""``pipemorph place MATRIX --pp P --dp D``: the rank placement that keeps slow links out of
data-parallel rings, its predicted iteration time, and the topology file DeepSpeed takes."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ds_pipemorph.fileio import BadInput, dump
from ds_pipemorph.plan.files.kinds import load_kind
from ds_pipemorph.plan.files.linkmatrix import LinkMatrix
from ds_pipemorph.plan.ir.profile import Costs, Profile
from ds_pipemorph.plan.place.predict import Job, PlaceResult, Prediction, place as place_ranks
from ds_pipemorph.plan.place.placement_search import placements_modulo_renaming

from .common import announce, check_outputs, console, parse_compute, parse_floats, print_json, user_errors, write_outputs

MODES = (("baseline", "DeepSpeed's default placement"), ("replacement", "re-placement only (Falcon)"),
         ("orchestrator", "placement + PipeMorph planning"))


def place(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Link matrix file (YAML or JSON, format in docs/placement.md)."),
    pp: int = typer.Option(..., "--pp", min=1, help="Pipeline stages P."),
    dp: int = typer.Option(..., "--dp", min=1, help="Data-parallel replicas D (P x D = the matrix's world size)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the orchestrator's topology file here (.json = JSON, else YAML)."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Take op times, micro-batches and memory caps from this profile (its links_ms are ignored)."),
    compute_ms: Optional[str] = typer.Option(None, "--compute-ms", help="F/B/W ms for all stages (10/10/10, the default) or per stage (10/10/10,12/12/8,...)."),
    microbatches: int = typer.Option(12, "--microbatches", min=1, help="Micro-batches per iteration (without --profile)."),
    grad_mb: str = typer.Option("100", "--grad-mb", help="Gradient MB each stage all-reduces: one value or one per stage."),
    chunk_mb: Optional[float] = typer.Option(None, "--chunk-mb", help="All-reduce message size in MB: each message pays the link latency (default: once per ring step)."),
    activation_mb: float = typer.Option(0.0, "--activation-mb", min=0.0, help="MB of one pipeline message: adds MB / bandwidth to each pipeline link's delay."),
    direct: bool = typer.Option(False, "--direct", help="Slow links are direct (one message in flight, the sender blocks) for the static order; the orchestrator's are delegated."),
    budget: float = typer.Option(1.0, "--budget", min=0.0, help="Planner search seconds per planned pipeline."),
    search_evals: Optional[int] = typer.Option(2000, "--search-evals", min=1, help="Planner search effort per planned pipeline, in replays (reached first: deterministic)."),
    exact: Optional[bool] = typer.Option(None, "--exact/--no-exact", help="Try every placement (default: when there are at most 100,000 up to renaming replicas), else swap local search."),
    search_budget: float = typer.Option(10.0, "--search-budget", min=0.0, help="Seconds of swap local search over placements (when not exact)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the searches."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of the table."),
) -> None:
    """Place ranks on the pipeline x data-parallel grid so that slow links carry pipeline traffic."""
    with user_errors():
        check_outputs({"--output": output})
        matrix = load_kind(matrix_path, LinkMatrix, "link matrix", instead={
            "profile": "give it with --profile {path}, and as MATRIX the links between ranks "
                       "(pipemorph profile-links --all-pairs measures them)"})
        job = _job(profile, compute_ms, microbatches, grad_mb, chunk_mb, activation_mb, direct, pp)
        res = place_ranks(matrix, pp, dp, job, budget_s=budget, max_evals=search_evals, exact=exact, seed=seed,
                          search_budget_s=search_budget)
        topo = topology_file(res)
        outputs = {str(output): dump(topo, output.suffix.lower() == ".json")} if output else {}
        write_outputs(outputs)
    if as_json:
        print_json({"world_size": matrix.world_size, "pp": pp, "dp": dp, "exact": res.exact,
                    **{name: _pred(getattr(res, name)) for name, _ in MODES},
                    "speedup": res.ratios(), "topology": topo})
        announce(outputs, to_stderr=True)
        return
    how = (f"every placement tried: {placements_modulo_renaming(pp, dp):,} up to renaming replicas" if res.exact
           else "swap local search")
    console.print(f"[bold]Placement[/bold] of {matrix.world_size} ranks as {pp} stages x {dp} replicas ({how})")
    console.print(_table(res))
    for name, label in MODES:
        x = getattr(res, name)
        order = "static zb order" if not x.planned_links_ms else f"order planned for links {_fmt(x.planned_links_ms)}"
        console.print(f"{name}: {label}; pipeline links ms per replica {' '.join(_fmt(v) for v in x.links_ms)}; "
                      f"{order}, {x.link_model} links, warm-up {x.warmup}", markup=False)
    r = res.ratios()
    console.print(f"speed-up: re-placement {r['replacement_vs_baseline']:.2f}x over baseline, orchestrator "
                  f"{r['orchestrator_vs_replacement']:.2f}x over re-placement, {r['orchestrator_vs_baseline']:.2f}x over baseline")
    announce(outputs)


def _job(profile, compute_ms, microbatches, grad_mb, chunk_mb, activation_mb, direct, pp) -> Job:
    for what, v in (("--chunk-mb", chunk_mb), ("--activation-mb", activation_mb)):
        if v is not None and not math.isfinite(v):
            raise BadInput(f"{what}: {v} is not a finite number")
    caps = None
    if profile is not None:
        if compute_ms is not None:
            raise BadInput("give either --profile or --compute-ms, not both")
        prof = load_kind(profile, Profile, "profile")
        costs, n = prof.costs(), prof.microbatches
        if prof.memory is not None:
            caps = prof.caps()
    else:
        f, b, w = parse_compute(compute_ms or "10/10/10", pp)
        costs, n = Costs(f, b, w, [0.0] * (pp - 1)), microbatches
    grads = parse_floats(grad_mb, "--grad-mb") or []
    if len(grads) == 1:
        grads = grads * costs.stages
    return Job(costs, n, grads, caps, chunk_mb, activation_mb, direct)


def topology_file(res: PlaceResult) -> dict:
    """The orchestrator's placement as the topology file (docs/placement.md)."""
    o = res.orchestrator
    p = o.placement
    return {
        "version": 1,
        "axes": ["pipe", "data"],
        "dims": [p.pp, p.dp],
        "ranks": p.as_lists(),
        "links_ms": o.links_ms,
        "allreduce_ms": o.allreduce_ms,
        "plan": {"warmup": o.warmup, "planned_links_ms": o.planned_links_ms, "link_model": o.link_model},
        "predicted": {"iteration_ms": o.iteration_ms, "baseline_ms": res.baseline.iteration_ms,
                      "replacement_ms": res.replacement.iteration_ms},
    }


def _pred(x: Prediction) -> dict:
    return {"ranks": x.placement.as_lists(), "iteration_ms": x.iteration_ms, "pipeline_ms": x.pipeline_ms,
            "allreduce_ms": x.allreduce_ms, "links_ms": x.links_ms, "planned_links_ms": x.planned_links_ms,
            "link_model": x.link_model, "warmup": x.warmup, "moved": x.placement.moved()}


def _table(res: PlaceResult) -> Table:
    t = Table(title="predicted iteration", title_justify="left")
    for col in ("", "ranks[stage][replica]", "iteration ms", "pipeline ms", "all-reduce ms", "speed-up"):
        t.add_column(col, justify="left" if col in ("", "ranks[stage][replica]") else "right")
    base = res.baseline.iteration_ms
    for name, _ in MODES:
        x = getattr(res, name)
        t.add_row(name, " ".join(",".join(map(str, row)) for row in x.placement.grid), f"{x.iteration_ms:.1f}",
                  f"{x.pipeline_ms:.1f}", f"{max(x.allreduce_ms):.1f}",
                  f"{base / x.iteration_ms:.2f}x" if x.iteration_ms > 0 else "-")
    return t


def _fmt(v: list[float]) -> str:
    return "[" + ",".join(f"{x:g}" for x in v) + "]"
