"""How far from optimal are the planners? Heuristic search and the paper's greedy pass vs the MILP.

Random heterogeneous cases (3–5 stages, 6–8 micro-batches, per-stage F/B/W times uniform in
[5, 20] ms, no slow link / one / two slow links of up to 40 ms, per-stage in-flight caps in
[S−s, N]). Per case: the paper's single greedy pass (Alg. 1 warm-up from the caps + list scheduler),
our planner (``plan.sched.search.search``, heuristic part only unless ``--search-exact``), and the exact MILP (``plan.sched.milp.solve_exact``) warm-started
with our plan. Gaps are (heuristic − optimum) / optimum, summarised over the cases the MILP proved
optimal.

    python benchmarks/planner/planner_vs_milp.py --seed 0 --cases 30 --milp-time-limit 60 --budget 1.0
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.bounds import lower_bound_ms
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.milp import solve_exact
from ds_pipemorph.plan.sched.search import search
from ds_pipemorph.plan.sched.warmup import initial_warmup
from ds_pipemorph.plan.sim.simulate import replay
from ds_pipemorph.plan.sim.validate import validate_schedule


@dataclass
class Case:
    stages: int
    microbatches: int
    f: list[float]
    b: list[float]
    w: list[float]
    links: list[float]
    caps: list[int]

    def costs(self) -> Costs:
        return Costs(self.f, self.b, self.w, self.links)


@dataclass
class Row:
    case: Case
    greedy_ms: float
    ours_ms: float
    ours_s: float
    milp_ms: float
    milp_bound_ms: float
    milp_optimal: bool
    milp_status: str
    milp_s: float
    heuristic_bound_ms: float  # bounds.lower_bound_ms, for a cross-check against the MILP

    def gap(self, ms: float) -> float:
        return (ms - self.milp_ms) / self.milp_ms


def random_case(rng: random.Random) -> Case:
    """One case; the slow-link count cycles through 0, 1 and 2 (capped by the number of links)."""
    S, N = rng.randint(3, 5), rng.randint(6, 8)
    draw = lambda: [round(rng.uniform(5.0, 20.0), 1) for _ in range(S)]
    f, b, w = draw(), draw(), draw()
    links = [0.0] * (S - 1)
    for i in rng.sample(range(S - 1), min(rng.choice((0, 1, 2)), S - 1)):
        links[i] = round(rng.uniform(0.0, 40.0), 1)
    caps = [rng.randint(min(S - s, N), N) for s in range(S)]
    return Case(S, N, f, b, w, links, caps)


def run_search(costs: Costs, N: int, caps: list[int], budget_s: float, exact: bool):
    """Our planner; by default its heuristic part only (``search`` would otherwise spend half of the
    budget on this very MILP for small cases, and we want the heuristic's own gap)."""
    kwargs = {} if exact or "exact" not in inspect.signature(search).parameters else {"exact": False}
    return search(costs, N, caps=caps, budget_s=budget_s, seed=0, **kwargs)


def run_case(case: Case, budget_s: float, milp_limit_s: float, search_exact: bool = False) -> Row:
    costs, N, caps = case.costs(), case.microbatches, case.caps
    greedy = list_schedule(costs, N, initial_warmup(caps))
    greedy_ms = replay(greedy, costs, N).iteration_ms
    t0 = time.perf_counter()
    ours = run_search(costs, N, caps, budget_s, search_exact)
    ours_s = time.perf_counter() - t0
    validate_schedule(ours.schedule, case.stages, N, caps=caps)
    exact = solve_exact(costs, N, caps=caps, time_limit_s=milp_limit_s, warm_start=ours.schedule)
    validate_schedule(exact.schedule, case.stages, N, caps=caps)
    return Row(
        case, greedy_ms, ours.iteration_ms, ours_s, exact.iteration_ms, exact.lower_bound_ms,
        exact.optimal, exact.status, exact.seconds, lower_bound_ms(costs, N, caps=caps),
    )


def summary(rows: list[Row]) -> dict:
    opt = [r for r in rows if r.milp_optimal]
    ours = [r.gap(r.ours_ms) for r in opt]
    greedy = [r.gap(r.greedy_ms) for r in opt]
    secs = sorted(r.milp_s for r in rows)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0
    return {
        "cases": len(rows),
        "proved_optimal": len(opt),
        "ours_mean_gap": statistics.fmean(ours) if ours else None,
        "ours_worst_gap": max(ours) if ours else None,
        "ours_optimal_cases": sum(g <= 1e-9 for g in ours),
        "greedy_mean_gap": statistics.fmean(greedy) if greedy else None,
        "greedy_worst_gap": max(greedy) if greedy else None,
        "ours_max_seconds": max((r.ours_s for r in rows), default=0.0),
        "milp_seconds": {
            "min": secs[0] if secs else 0.0,
            "median": statistics.median(secs) if secs else 0.0,
            "p90": pct(secs, 0.9),
            "max": secs[-1] if secs else 0.0,
            "total": sum(secs),
        },
        "heuristic_bound_violations": sum(r.heuristic_bound_ms > r.milp_ms + 1e-6 for r in opt),
    }


def _status(r: Row) -> str:
    if r.milp_optimal:
        return "optimal"
    why = "time limit" if "time" in r.milp_status.lower() else r.milp_status
    return f"{why}, gap {(r.milp_ms - r.milp_bound_ms) / r.milp_ms:.1%}"


def _cells(i: int, r: Row) -> list[str]:
    c = r.case
    delays = ",".join(f"{x:g}" for x in c.links)
    return [
        str(i), str(c.stages), str(c.microbatches), delays, ",".join(map(str, c.caps)),
        f"{r.milp_ms:.1f}", f"{r.gap(r.greedy_ms):.1%}", f"{r.gap(r.ours_ms):.1%}",
        f"{r.ours_s:.2f}", _status(r), f"{r.milp_s:.1f}",
    ]


HEADERS = ["#", "S", "N", "delays ms", "caps", "MILP ms", "greedy gap", "ours gap", "ours s", "MILP status", "MILP s"]


def print_table(rows: list[Row]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(" | ".join(HEADERS))
        for i, r in enumerate(rows):
            print(" | ".join(_cells(i, r)))
        return
    table = Table(title="planner vs MILP")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("delays ms", "caps", "MILP status") else "right")
    for i, r in enumerate(rows):
        table.add_row(*_cells(i, r))
    Console(width=max(140, Console().width)).print(table)


def summary_line(s: dict) -> str:
    if not s["proved_optimal"]:
        return f"MILP proved no case optimal out of {s['cases']}"
    m = s["milp_seconds"]
    return (
        f"{s['proved_optimal']}/{s['cases']} cases proved optimal; "
        f"ours gap mean {s['ours_mean_gap']:.2%} worst {s['ours_worst_gap']:.2%} "
        f"(optimal in {s['ours_optimal_cases']}); "
        f"greedy gap mean {s['greedy_mean_gap']:.2%} worst {s['greedy_worst_gap']:.2%}; "
        f"ours max {s['ours_max_seconds']:.2f} s; "
        f"MILP s median {m['median']:.1f} p90 {m['p90']:.1f} max {m['max']:.1f} total {m['total']:.0f}"
    )


def write_json(path: Path, payload: dict) -> None:
    """Atomic: a temporary file in the same directory, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=2)
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--milp-time-limit", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds for our planner per case")
    ap.add_argument("--search-exact", action="store_true",
                    help="let search() use its default, which runs the MILP inside the budget for small cases")
    ap.add_argument("--out", type=Path, default=Path("out/planner_vs_milp.json"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.cases):
        rows.append(run_case(random_case(rng), args.budget, args.milp_time_limit, args.search_exact))
        r = rows[-1]
        print(f"case {i}: S={r.case.stages} N={r.case.microbatches} ours {r.ours_ms:.1f} greedy {r.greedy_ms:.1f} "
              f"MILP {r.milp_ms:.1f} ({_status(r)}, {r.milp_s:.1f} s)", file=sys.stderr, flush=True)
    print_table(rows)
    s = summary(rows)
    print(summary_line(s))
    write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "summary": s,
                          "cases": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
