"""``pipemorph simulate PLAN``: replay a fixed plan under other delays or op times, next to baselines."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.files.planfile import PlanFile
from ds_pipemorph.plan.files.torch_csv import read_torch_plan
from ds_pipemorph.plan.ir.links import DIRECT, LATENCY
from ds_pipemorph.plan.ir.lower import DISPATCHES
from ds_pipemorph.plan.ir.nccl import grouped_lines, nccl_groups
from ds_pipemorph.plan.ir.nccl_lowering import NcclLowering
from ds_pipemorph.plan.ir.memory import peak_units
from ds_pipemorph.plan.ir.ops import peak_inflight
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import BASELINES, baseline
from ds_pipemorph.plan.sim.ready import replay_varying
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.plan.sim.variation import link_trace, parse_vary

from .memory_line import memory_line
from .common import announce, check_outputs, console, parse_compute, parse_floats, print_json, timeline_outputs, user_errors, write_outputs


def simulate(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="Plan file written by `pipemorph plan`, or a torch pipelining schedule CSV (.csv, one row per rank)."),
    links_ms: Optional[str] = typer.Option(None, "--links-ms", help="Delay per link in ms, e.g. 10,0,0."),
    compute_ms: Optional[str] = typer.Option(None, "--compute-ms", help="F/B/W ms for all stages (10/10/10) or per stage (10/10/10,12/12/8,...)."),
    compare: str = typer.Option(",".join(BASELINES), "--compare", help="Baselines planned for the plan's profile (a torch CSV: --compute-ms with free links), replayed the same way ('' for none)."),
    direct: bool = typer.Option(False, "--direct", help="Model slow links as direct ones: one message in flight, the sender blocks."),
    dispatch: str = typer.Option("ordered", "--dispatch", metavar="[ordered|ready]", help="ordered: each stage runs the plan's order as written; ready: the order is a hint, each stage runs the first ready op in it, holding no more activations than the plan does (docs/ready_dispatch.md). With ready, both times are printed."),
    vary: Optional[str] = typer.Option(None, "--vary", metavar="SPEC", help="Vary op times per micro-batch: jitter:SPREAD[,seed=K][,kinds=FB], heavy:frac=F,factor=X,stages=K[,seed=S] or table:FILE. Applies to every row."),
    link_trace_path: Optional[Path] = typer.Option(None, "--link-trace", metavar="FILE", help="Per-link delay over time, YAML/JSON: points: [{t: seconds, links_ms: [...]}, ...] (the inject.trace format); instead of --links-ms."),
    lowered: bool = typer.Option(False, "--lowered", help="Print the per-rank instruction streams with communication placed (one line per rank), as the engine runs them under --dispatch, instead of replaying."),
    nccl: bool = typer.Option(False, "--nccl", help="With --lowered: the streams the engine runs under NCCL's point-to-point rules (NcclLowering, docs/nccl.md), each group issued as one batch_isend_irecv, shown between square brackets."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of the table."),
    gantt: Optional[Path] = typer.Option(None, "--gantt", help="Write a Gantt picture of the replayed plan (format from the suffix: .png, .pdf, .svg, ...)."),
    chrome: Optional[Path] = typer.Option(None, "--chrome", help="Write the replayed timeline as a Chrome/Perfetto trace."),
) -> None:
    """Replay a plan under the given delays and compute times and compare it with baselines."""
    with user_errors():
        check_outputs({"--chrome": chrome}, pictures={"--gantt": gantt})
        pf, sched = read_torch_plan(plan_path) if plan_path.suffix.lower() == ".csv" else PlanFile.read(plan_path)
        S, N = pf.stages, pf.microbatches
        if dispatch not in DISPATCHES:
            raise BadInput(f"--dispatch: '{dispatch}' is not a dispatch rule; choose ordered or ready")
        if nccl and not lowered:
            raise BadInput("--nccl shows the lowered streams: give --lowered too")
        if nccl and dispatch != "ordered":
            raise BadInput("--nccl runs ordered dispatch only: ready dispatch posts every receive of an iteration "
                           "up front, which NCCL's in-order point-to-point cannot run; drop --dispatch ready")
        if lowered:  # the engine's lowering of this plan under this dispatch (NCCL's: groups bracketed)
            if nccl:
                streams = NcclLowering(pf.lowering.fused).lower(sched)
                lines = grouped_lines(streams, nccl_groups(streams))
            else:
                lines = pf.lowering.for_dispatch(dispatch).lines(sched)
            if as_json:
                print_json({"lowered": lines})
            else:
                console.print("\n".join(lines), markup=False, soft_wrap=True)
            return
        planned = pf.costs()
        comp = parse_compute(compute_ms, S)
        if planned is None and comp is None:
            raise BadInput(f"{plan_path} carries no profile: give --compute-ms")
        f, b, w = comp if comp else (planned.f, planned.b, planned.w)
        if links_ms is not None and link_trace_path is not None:
            raise BadInput("give either --links-ms or --link-trace, not both")
        links = parse_floats(links_ms, "--links-ms")
        if links is None:
            links = planned.links if planned else [0.0] * (S - 1)
        if len(links) != S - 1:
            raise BadInput(f"--links-ms: expected {S - 1} values (one per link of {S} stages), got {len(links)}")
        costs = Costs(list(f), list(b), list(w), list(links))
        # The baselines are planned for the plan's profile; a plan without one (a torch CSV) gets the
        # op times given, with free links: what a static schedule knows before any link slows down.
        plan_costs = planned or Costs(list(f), list(b), list(w), [0.0] * (S - 1))
        names = [x.strip() for x in compare.split(",") if x.strip()]
        model = DIRECT if direct else LATENCY
        op_times = parse_vary(vary, costs, N) if vary is not None else None
        curves = link_trace(link_trace_path, S - 1) if link_trace_path is not None else None
        varied = op_times is not None or curves is not None

        def run(order, fused, how="ordered", caps=None):
            if not varied and how == "ordered":
                return replay(order, costs, N, fused_backward=fused, link_model=model)
            return replay_varying(order, costs, N, dispatch=how, caps=caps, op_times=op_times, link_delays=curves,
                                  fused_backward=fused, link_model=model)

        caps = peak_inflight(sched)  # ready dispatch holds no more activations than the plan does
        rows = {"plan": run(sched, pf.fused)}
        if dispatch == "ready":
            rows["plan, ready dispatch"] = run(sched, pf.fused, "ready", caps)
        for name in names:
            if name not in BASELINES:
                raise BadInput(f"--compare: unknown baseline '{name}'; choose from {', '.join(BASELINES)}")
            rows[name] = run(baseline(name, plan_costs, N), name != "zb-h1")
        ordered = rows["plan"]
        tl = rows["plan, ready dispatch"] if dispatch == "ready" else ordered
        under = f"link trace {link_trace_path.name}" if curves else f"links_ms={[round(x, 1) for x in links]}"
        under += f", {vary}" if vary else ""
        title = f"{plan_path.name} replayed ({dispatch} dispatch), {under}"
        outputs = timeline_outputs(tl, gantt and str(gantt), chrome and str(chrome), title, None if curves else links)
        write_outputs(outputs)
    result = {
        "dispatch": dispatch,
        "iteration_ms": tl.iteration_ms,
        "bubble_rate": tl.bubble_rate,
        "stage_bubble_rate": tl.stage_bubble_rate,
        "peak_inflight": tl.peak_inflight,
        "peak_activations": peak_units(sched, pf.profile.w_share() if pf.profile else 1.0),
        "predicted_ms": pf.predicted.iteration_ms if pf.predicted else None,
        "ordered_ms": ordered.iteration_ms,
        "ready_ms": tl.iteration_ms if dispatch == "ready" else None,
        "ready_caps": caps if dispatch == "ready" else None,
        "vary": vary,
        "link_trace": str(link_trace_path) if link_trace_path is not None else None,
        "links_ms": None if curves else links,
        "compute_ms": {"forward": list(f), "backward_input": list(b), "backward_weight": list(w)},
        "compare": {k: {"iteration_ms": v.iteration_ms, "bubble_rate": v.bubble_rate}
                    for k, v in rows.items() if k not in ("plan", "plan, ready dispatch")},
    }
    if as_json:
        print_json(result)
        announce(outputs, to_stderr=True)
        return
    t = Table(title=f"replay under {under}", title_justify="left")
    for col in ("schedule", "iteration ms", "bubble rate", "vs plan"):
        t.add_column(col, justify="right")
    for k, v in rows.items():
        t.add_row(k, f"{v.iteration_ms:.1f}", f"{v.bubble_rate:.1%}", f"{v.iteration_ms / ordered.iteration_ms:.2f}x")
    console.print(t)
    if dispatch == "ready":
        console.print(f"ready dispatch: {tl.iteration_ms:.1f} ms against {ordered.iteration_ms:.1f} ms in the "
                      f"plan's order ({tl.iteration_ms / ordered.iteration_ms:.2f}x), holding no more "
                      "activations per stage than the plan")
    if pf.predicted:
        console.print(f"planned for its profile: {pf.predicted.iteration_ms:.1f} ms")
    if pf.profile is not None:
        console.print(memory_line(pf.profile, sched))
    announce(outputs)
