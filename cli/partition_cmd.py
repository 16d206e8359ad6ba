"""``pipemorph partition PROFILE``: stage boundaries for a layer profile, against DeepSpeed's own."""
from __future__ import annotations

from math import comb, isfinite
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ds_pipemorph.fileio import BadInput, dump
from ds_pipemorph.plan.files.planfile import PlanFile
from ds_pipemorph.plan.ir.ops import format_stage, warmup_counts
from ds_pipemorph.plan.partition.layer_profile import LayerProfile, read_layer_profile
from ds_pipemorph.plan.partition.partition import evaluate, partition as search_partition
from ds_pipemorph.plan.partition.parts import PartsFile, PartsPredicted, StageMs, balanced_parts, uniform_parts
from ds_pipemorph.plan.sched.bounds import cap_bound_ms, lower_bound_ms
from ds_pipemorph.plan.sched.search import search

from .common import announce, check_outputs, console, print_json, user_errors, write_outputs
from .progress import budget_bar


def partition(
    profile: Path = typer.Argument(..., help="Layer profile (YAML or JSON, format in docs/partition.md)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the parts file here (.json = JSON, else YAML)."),
    stages: Optional[int] = typer.Option(None, "--stages", min=1, help="Stage count (default: the profile's)."),
    microbatches: Optional[int] = typer.Option(
        None, "--microbatches", min=1, help="Micro-batches per iteration (default: the profile's)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the parts file and the comparison as JSON instead of the table."),
    time_limit: float = typer.Option(
        1.0, "--time-limit", min=0.0,
        help="Seconds for the partition search; it ends sooner once it has proved its partition best.",
    ),
    budget: float = typer.Option(0.3, "--budget", min=0.0, help="Planning seconds for each partition in the table."),
    plan_out: Optional[Path] = typer.Option(None, "--plan", help="Also write the plan of the chosen parts (plan file format)."),
    slowdown: Optional[list[str]] = typer.Option(
        None, "--slowdown", metavar="STAGE=FACTOR",
        help="Stage STAGE runs every layer it holds FACTOR times as long as profiled (e.g. 1=2.0); repeat it for "
             "several stages.",
    ),
) -> None:
    """Choose pipeline stage boundaries that minimise the planned iteration time, within memory."""
    with user_errors():
        check_outputs({"--output": output, "--plan": plan_out})
        lp = read_layer_profile(profile, stages=stages, microbatches=microbatches)
        L, S, N = lp.num_layers, lp.stages, lp.microbatches
        factors = parse_slowdown(slowdown, S)
        with budget_bar(f"searching partitions of {L} layers into {S} stages", time_limit):
            res = search_partition(lp, time_limit_s=time_limit, slowdown=factors)
        rows: dict[str, dict] = {}
        planned: dict[tuple, tuple] = {}  # parts -> (search result, stage profile)
        for name, parts in (("searched", res.parts), ("uniform", uniform_parts(L, S)),
                            ("parameters", balanced_parts(lp.layers.param_count, S))):
            rows[name] = _row(lp, parts, budget, planned, factors)
        # Write the search's partition, unless a baseline planned faster.
        name = "searched"
        for other in ("uniform", "parameters"):
            t = rows[other]["iteration_ms"]
            if t is not None and t < rows[name]["iteration_ms"] - 1e-9:
                name = other
        chosen = rows[name]["parts"]
        plan_res, prof = planned[tuple(chosen)]
        caps = prof.caps()
        costs = prof.costs()
        pf = PartsFile(
            parts=chosen, microbatches=N,
            predicted=PartsPredicted(iteration_ms=round(plan_res.iteration_ms, 6), search_ms=round(rows[name]["search_ms"], 6),
                                     lower_bound_ms=round(res.lower_bound_ms, 6), complete=res.complete),
            stage_ms=StageMs(forward=costs.f, backward_input=costs.b, backward_weight=costs.w),
            links_ms=costs.links, max_inflight=caps, memory_mb=[round(x, 6) for x in lp.stage_memory_mb(chosen)],
            warmup=warmup_counts(plan_res.schedule), schedule=[format_stage(r) for r in plan_res.schedule],
        )
        data = pf.model_dump(mode="json", exclude_none=True)
        outputs: dict = {}
        if output:
            outputs[str(output)] = dump(data, output.suffix.lower() == ".json")
        if plan_out:
            plan = PlanFile.build(plan_res.schedule, prof).model_dump(mode="json")
            outputs[str(plan_out)] = dump(plan, plan_out.suffix.lower() == ".json")
        write_outputs(outputs)
    search_info = {"seconds": round(res.seconds, 4), "complete": res.complete, "replayed": res.replayed,
                   "leaves": res.leaves, "partitions": comb(L - 1, S - 1), "parts": res.parts,
                   "search_ms": res.iteration_ms, "lower_bound_ms": res.lower_bound_ms, "slowdown": factors}
    if as_json:
        print_json(dict(data, chosen=name, compare=rows, search=search_info))
        announce(outputs, to_stderr=True)
        return
    console.print(f"[bold]Partition[/bold] of {L} layers into {S} stages, {N} micro-batches")
    done = "proved best" if res.complete else f"stopped at the {time_limit:g} s limit"
    if factors is not None:
        slower = ", ".join(f"stage {s} x{x:g}" for s, x in enumerate(factors) if x != 1.0)
        console.print(f"stage times scaled: {slower or 'none'}")
    console.print(f"searched {res.seconds:.2f} s: {res.replayed} of {comb(L - 1, S - 1)} partitions replayed, {done}")
    console.print(_table(rows, name))
    console.print(
        f"lower bound over every partition and plan: {res.lower_bound_ms:.1f} ms; "
        f"chosen {rows[name]['iteration_ms']:.1f} ms is {_gap(rows[name]['iteration_ms'], res.lower_bound_ms)} above it"
    )
    if name != "searched":
        console.print(f"the {name} partition planned faster than the search's choice: it is the one written")
    announce(outputs)


def parse_slowdown(items: Optional[list[str]], stages: int) -> Optional[list[float]]:
    """``--slowdown STAGE=FACTOR`` options as one factor per stage (1.0 for stages not named), or
    None without any; BadInput naming the option at fault."""
    if not items:
        return None
    factors: list[float] = [1.0] * stages
    named: set[int] = set()
    for item in items:
        stage, _, value = item.partition("=")
        try:
            s, x = int(stage), float(value)  # without '=', value is '' and float('') fails
        except ValueError:
            raise BadInput(f"--slowdown: '{item}' is not STAGE=FACTOR (e.g. 1=2.0)") from None
        if not 0 <= s < stages:
            raise BadInput(f"--slowdown: stage {s} does not exist (the pipeline has stages 0..{stages - 1})")
        if s in named:
            raise BadInput(f"--slowdown: stage {s} is given twice; give each stage one factor")
        if not (isfinite(x) and x > 0):
            raise BadInput(f"--slowdown: stage {s}'s factor must be a finite number above 0, got {value}")
        named.add(s)
        factors[s] = x
    return factors


def _row(lp: LayerProfile, parts: list[int], budget: float, planned: dict, slowdown: Optional[list[float]]) -> dict:
    """One partition of the table: its greedy (search) time, planned time and lower bound, with
    stage times scaled by ``slowdown``."""
    row = {"parts": parts, "fits_memory": True, "search_ms": None, "iteration_ms": None, "lower_bound_ms": None, "gap": None}
    if any(c is None for c in lp.caps(parts)):
        row["fits_memory"] = False
        return row
    key = tuple(parts)
    if key not in planned:
        prof = lp.stage_profile(parts, slowdown)
        planned[key] = (search(prof.costs(), prof.microbatches, caps=prof.caps(), budget_s=budget, seed=0), prof)
    res, prof = planned[key]
    costs, caps = prof.costs(), prof.caps()
    lb = max(lower_bound_ms(costs, prof.microbatches, caps=caps), cap_bound_ms(costs, prof.microbatches, caps))
    row.update(search_ms=evaluate(lp, parts, slowdown=slowdown), iteration_ms=res.iteration_ms, lower_bound_ms=lb,
               gap=0.0 if lb <= 0 else (res.iteration_ms - lb) / lb)
    return row


def _gap(t: float, lb: float) -> str:
    return "0.00%" if lb <= 0 else f"{max(0.0, (t - lb) / lb):.2%}"


def _table(rows: dict, chosen: str) -> Table:
    t = Table(title="partitions, each planned", title_justify="left")
    t.add_column("partition")
    t.add_column("parts")
    for col in ("iteration ms", "greedy ms", "bound ms", "gap to bound"):
        t.add_column(col, justify="right")
    for name, r in rows.items():
        label = f"{name} (chosen)" if name == chosen else name
        if not r["fits_memory"]:
            t.add_row(label, str(r["parts"]), "does not fit memory", "", "", "")
            continue
        t.add_row(label, str(r["parts"]), f"{r['iteration_ms']:.1f}", f"{r['search_ms']:.1f}",
                  f"{r['lower_bound_ms']:.1f}", _gap(r["iteration_ms"], r["lower_bound_ms"]))
    return t
