"""``pipemorph plan PROFILE``: the best schedule for a profile, with its per-link tolerance."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ds_pipemorph.fileio import dump
from ds_pipemorph.plan.files.kinds import load_kind
from ds_pipemorph.plan.files.planfile import PlanFile
from ds_pipemorph.plan.ir.profile import Profile
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import search
from ds_pipemorph.plan.sched.tolerance import link_tolerances
from ds_pipemorph.plan.sched.warmup import initial_warmup
from ds_pipemorph.plan.sim.listsched_py import Policy
from ds_pipemorph.plan.sim.simulate import replay

from .memory_line import memory_line
from .common import announce, check_outputs, console, print_json, timeline_outputs, user_errors, write_outputs
from .progress import budget_bar


def plan(
    profile: Path = typer.Argument(..., help="Profile file (YAML or JSON, format in docs/design.md)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the plan here (.json = JSON, else YAML)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan object as JSON instead of the summary."),
    budget: float = typer.Option(1.0, "--budget", min=0.0, help="Search time in seconds."),
    seed: int = typer.Option(0, "--seed", help="Seed of the local search (results are deterministic per seed)."),
    exact: Optional[bool] = typer.Option(
        None, "--exact/--no-exact",
        help="Also run the exact MILP (needs the milp extra). Default: on for small cases with --budget >= 3 when installed.",
    ),
    greedy: bool = typer.Option(False, "--greedy", help="Only the paper's single greedy pass (Alg. 1 + Alg. 3/4)."),
    gantt: Optional[Path] = typer.Option(None, "--gantt", help="Write a Gantt picture of the planned timeline (format from the suffix: .png, .pdf, .svg, ...)."),
    chrome: Optional[Path] = typer.Option(None, "--chrome", help="Write the planned timeline as a Chrome/Perfetto trace."),
    microbatches: Optional[int] = typer.Option(None, "--microbatches", min=1, help="Micro-batches per iteration to plan for (default: the profile's, as profile-stages measured them)."),
) -> None:
    """Plan a zero-bubble schedule that absorbs the profile's link delays within its memory caps."""
    with user_errors():
        check_outputs({"--output": output, "--chrome": chrome}, pictures={"--gantt": gantt})
        prof = load_kind(profile, Profile, "profile")
        measured = prof.microbatches
        if microbatches is not None and microbatches != measured:
            prof = Profile.model_validate({**prof.model_dump(mode="json"), "microbatches": microbatches})
        costs, n, caps = prof.costs(), prof.microbatches, prof.caps()
        count = (f"--microbatches; the profile has {measured}" if microbatches is not None and microbatches != measured
                 else "the profile's count")
        units, share = prof.units(), prof.w_share()
        if greedy:
            within = Policy() if units is None else Policy(units=tuple(units), w_share=share)
            sched, lb, note = list_schedule(costs, n, initial_warmup(caps), policy=within), None, "paper's greedy pass"
        else:
            with budget_bar(f"searching plans for {prof.stages} stages x {n} micro-batches", budget):
                res = search(costs, n, caps=caps, budget_s=budget, seed=seed, exact=exact, units=units, w_share=share)
            sched, lb = res.schedule, res.lower_bound_ms
            note = f"searched {res.seconds:.2f} s, {res.evaluated} candidates, best from {res.source}"
        pf = PlanFile.build(sched, prof)
        tl = replay(sched, costs, n)
        greedy_ms = tl.iteration_ms if greedy else res.greedy_ms
        tols = link_tolerances(sched, costs, n)
        outputs = timeline_outputs(tl, gantt and str(gantt), chrome and str(chrome),
                                   f"plan for links_ms={[round(x, 1) for x in costs.links]}", costs.links)
        data = pf.model_dump(mode="json")
        if output:
            outputs[str(output)] = dump(data, output.suffix.lower() == ".json")
        write_outputs(outputs)
    if as_json:
        print_json(data)
        announce(outputs, to_stderr=True)
        return
    p = pf.predicted
    console.print(f"[bold]Plan[/bold] for {prof.stages} stages x {n} micro-batches ({count}; {note})")
    console.print(f"warm-up x_s: {pf.warmup}   peak in-flight: {p.peak_inflight}   caps: {caps}")
    console.print(memory_line(prof, sched))
    bound = f"; lower bound {lb:.1f} ms" if lb is not None else ""
    console.print(
        f"predicted iteration {p.iteration_ms:.1f} ms, bubble rate {p.bubble_rate:.1%}"
        f" (paper's greedy pass: {greedy_ms:.1f} ms{bound})"
    )
    if tols:
        console.print(_tolerance_table(tols))
    announce(outputs)


def _tolerance_table(tols) -> Table:
    t = Table(title="per-link delay tolerance", title_justify="left")
    for col in ("link", "slackness", "Eq. 1 tolerance ms", "replay tolerance ms", "delay ms", "absorbed"):
        t.add_column(col, justify="right")
    for x in tols:
        t.add_row(
            f"{x.link} ({x.link}-{x.link + 1})",
            str(x.slackness),
            f"{x.eq1_ms:.1f}",
            f"{x.replay_ms:.2f}",
            f"{x.current_ms:.1f}",
            "yes" if x.absorbed else "[red]no[/red]",
        )
    return t
