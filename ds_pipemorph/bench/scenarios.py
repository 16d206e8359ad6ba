"""The delay scenarios of ``pipemorph bench``: slow-link sets, static delays, delay traces, the §7.2 preset.

Errors are one sentence naming the command-line option (``BadInput``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from ..fileio import BadInput, load_model
from ..plan.ir.links import DIRECT
from ..plan.ir.profile import Costs
from ..plan.sched.baselines import deepspeed_1f1b
from ..plan.sim.simulate import replay
from .spec import Scenario
from .traces import mean_delays, write_paper_traces


def link_sets(stages: int, link: Optional[list[int]], links: Optional[list[str]]) -> list[list[int]]:
    """The slow-link sets, each one scenario group: every ``--links`` value (``0,2``) is a set of links
    slow at once, so are all ``--link`` values together; negative indices count from the last link."""
    if link and links:
        raise BadInput("--link and --links: give one of them (--link 0 --link -1 makes one set of two slow "
                       "links; each --links 0,-1 is one set)")
    raw: list[tuple[str, list[str]]] = [("--links", v.split(",")) for v in links or []]
    if link:
        raw = [("--link", [str(i) for i in link])]
    out: list[list[int]] = []
    for opt, items in raw or [("--link", ["0"])]:
        chosen = []
        for item in items:
            try:
                i = int(item)
            except ValueError:
                raise BadInput(f"{opt}: '{item}' is not a link index (0..{stages - 2}, or -1 for the last)") from None
            j = i if i >= 0 else stages - 1 + i
            if not 0 <= j < stages - 1:
                raise BadInput(f"{opt}: {i} is not a link of {stages} stages (0..{stages - 2}, or -1 for the last)")
            chosen.append(j)
        if sorted(set(chosen)) not in out:
            out.append(sorted(set(chosen)))
    return out


def scenarios_for(stages: int, delays: list[float], sets: list[list[int]]) -> list[Scenario]:
    """One scenario per delay and slow-link set (the same delay on every link of the set); one no-delay
    scenario for any number of sets."""
    out = []
    for chosen in sets:
        for c in delays:
            links = [0.0] * (stages - 1)
            for i in chosen:
                links[i] = c
            where = f"link{chosen[0]}" if len(chosen) == 1 else "links" + "+".join(map(str, chosen))
            sc = Scenario(name=f"{c:g}ms_{where}" if c else "no_delay", links_ms=links)
            if sc.name not in {x.name for x in out}:
                out.append(sc)
    return out


def trace_scenarios(stages: int, traces: list[Path]) -> list[Scenario]:
    """One scenario per trace file, named after it; ``links_ms`` is its time-weighted mean (what the
    predicted column plans for). A trace that does not fit the pipeline is one sentence."""
    from ..inject.delays import DelayTraceFile  # the runtime imports torch: only when a trace is given

    out: list[Scenario] = []
    for p in traces:
        if not p.is_file():
            raise BadInput(f"--trace: cannot read '{p}'")
        try:
            tr = load_model(p, DelayTraceFile)
        except BadInput as e:
            raise BadInput(f"--trace {e}") from None
        tr.check_links(stages - 1, f"--trace {p}")
        name = p.stem
        while name in {x.name for x in out}:
            name += "+"
        out.append(Scenario(name=name, links_ms=mean_delays(tr), trace=str(p.resolve())))
    return out


def dynamic_traces(out_dir: Path, stages: int, microbatches: int, op_ms: float, rounds: int) -> list[Path]:
    """PipeMorph §7.2's three cases (every link N(30, 10) ms, changed every U(50, 100), U(100, 200) and
    U(200, 400) ms), seed 0, long enough for the slowest row (stock 1F1B at 40 ms per link, x1.5)."""
    slow = replay(deepspeed_1f1b(stages, microbatches), Costs.uniform(stages, op_ms, [40.0] * (stages - 1)),
                  microbatches, fused_backward=True, link_model=DIRECT).iteration_ms
    return write_paper_traces(out_dir, stages, duration_s=math.ceil(1.5 * rounds * slow / 1000.0) + 10, seed=0)
