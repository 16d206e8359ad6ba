"""Planner speed and quality at cluster scale: 8x32 and 32x256 against a lower bound, the greedy pass
and a re-plan for a new slow link at 32x256, the bound against the MILP, and ``pipemorph plan`` /
``pipemorph simulate`` as whole processes at 64x1024.

    python benchmarks/planner/planner_scale.py [--out out/planner_scale.json] [--quick]

Targets: search <= 1 s for 8x32 and <= 10 s for 32x256; at 32x256 the greedy plan plus its
replay <= 50 ms, a full re-plan for a new slow link (search, 0.2 s budget) <= 200 ms, and at most
0.5 % above the lower bound on uniform, heterogeneous and capped cases; at 64x1024 each of
``pipemorph plan PROFILE`` and ``pipemorph simulate plan.json`` <= 2 s as a process (``plan -o plan.json``, which also writes the
plan, is timed beside them).
The bound's own tightness: against the MILP's proven optimum on small random cases, against the
known optimum 3·N·t + (S−1)·t on uniform profiles, and where a plan meets it (then both are optimal).
Times are wall clock on a shared machine: the load average is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import exit_on_bad_input, print_table, work_folder, write_json

from ds_pipemorph.plan.sched import listsched

from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.bounds import lower_bound_ms
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import milp_available, search
from ds_pipemorph.plan.sched.warmup import initial_warmup
from ds_pipemorph.plan.sim import native
from ds_pipemorph.plan.sim.simulate import replay

GREEDY_TARGET_S = 0.050
REPLAN_BUDGET_S = 0.2
REPLAN_TARGET_S = 0.200
GAP_TARGET = 0.005
CLI_TARGET_S = 2.0


def cases(seed: int, sizes=((8, 32, 1.0), (32, 256, 10.0))):
    rng = random.Random(seed)
    for S, N, budget in sizes:
        yield f"{S}x{N} uniform", Costs.uniform(S, 10.0), N, None, budget
        links = [0.0] * (S - 1)
        links[-1] = 60.0
        yield f"{S}x{N} uniform, 60 ms on last link", Costs.uniform(S, 10.0, links), N, None, budget
        yield f"{S}x{N} uniform, 1F1B memory", Costs.uniform(S, 10.0), N, [S - s for s in range(S)], budget
        for k in range(2):
            het = Costs(
                [rng.uniform(5, 20) for _ in range(S)],
                [rng.uniform(5, 20) for _ in range(S)],
                [rng.uniform(5, 20) for _ in range(S)],
                [rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 40)]) for _ in range(S - 1)],
            )
            caps = [rng.randint(S - s, N) for s in range(S)]
            yield f"{S}x{N} heterogeneous #{k}", het, N, caps, budget


def cold() -> None:
    """Forget the last schedules and encodings the planner keeps, so that nothing is reused."""
    listsched._LAST.clear()
    native._ENCODED.clear()


def best_of(fn, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def searched(seed: int, quick: bool) -> tuple[list, list]:
    """Section 1: the search with its budget."""
    rows, results = [], []
    for name, costs, n, caps, budget in cases(seed):
        if quick:
            budget = min(budget, 1.0)
        capv = caps or [n] * costs.stages
        t = time.perf_counter()
        greedy = replay(list_schedule(costs, n, initial_warmup(capv)), costs, n).iteration_ms
        greedy_s = time.perf_counter() - t
        res = search(costs, n, caps=caps, budget_s=budget, seed=seed)
        results.append(
            {
                "case": name, "stages": costs.stages, "microbatches": n, "budget_s": budget,
                "greedy_ms": greedy, "greedy_s": greedy_s, "ours_ms": res.iteration_ms, "ours_s": res.seconds,
                "lower_bound_ms": res.lower_bound_ms, "gap_to_bound": res.gap_to_bound, "source": res.source,
                "within_budget": res.seconds <= budget * 1.05,
            }
        )
        rows.append([name, f"{greedy:.1f}", f"{res.iteration_ms:.1f}", f"{res.lower_bound_ms:.1f}",
                     f"{max(0.0, res.gap_to_bound):.2%}", f"{res.seconds:.2f}", f"{budget:.0f}", res.source])
    print_table("planner at scale: ours vs the paper's greedy pass vs a lower bound",
                ["case", "greedy ms", "ours ms", "bound ms", "ours - bound", "ours s", "budget s", "won by"], rows)
    return results


def fast_paths(seed: int) -> list:
    """Section 2, 32x256: the greedy plan + its replay, and a re-plan for a new slow link."""
    rows, results = [], []
    rng = random.Random(seed + 1)
    for name, costs, n, caps, _ in cases(seed, sizes=((32, 256, 0.0),)):
        capv = caps or [n] * costs.stages
        x = initial_warmup(capv)
        greedy_s = best_of(lambda: cold() or replay(list_schedule(costs, n, x), costs, n).iteration_ms)
        # A new slow link: 20-60 ms on a link that had none (or 60 ms more on the slow one).
        links = list(costs.links)
        free = [i for i, c in enumerate(links) if c == 0.0] or [len(links) - 1]
        i = rng.choice(free)
        links[i] += rng.uniform(20.0, 60.0)
        slow = costs.with_links(links)
        t = time.perf_counter()
        res = search(slow, n, caps=caps, budget_s=REPLAN_BUDGET_S, seed=seed)
        replan_s = time.perf_counter() - t
        ok = greedy_s <= GREEDY_TARGET_S and replan_s <= REPLAN_TARGET_S and res.gap_to_bound <= GAP_TARGET
        results.append({
            "case": name, "greedy_plus_replay_s": greedy_s, "new_slow_link": i, "new_delay_ms": links[i],
            "replan_s": replan_s, "replan_ms": res.iteration_ms, "replan_bound_ms": res.lower_bound_ms,
            "replan_gap": res.gap_to_bound, "replan_source": res.source, "meets_targets": ok,
        })
        rows.append([name, f"{greedy_s * 1e3:.1f}", f"{i}: {links[i]:.1f}", f"{replan_s * 1e3:.0f}",
                     f"{res.iteration_ms:.1f}", f"{res.lower_bound_ms:.1f}", f"{max(0.0, res.gap_to_bound):.3%}",
                     "yes" if ok else "NO"])
    print_table(f"32x256: greedy + replay (target {GREEDY_TARGET_S * 1e3:.0f} ms), re-plan for a new slow link "
                f"(budget {REPLAN_BUDGET_S} s, target {REPLAN_TARGET_S * 1e3:.0f} ms, gap <= {GAP_TARGET:.1%})",
                ["case", "greedy+replay ms", "new slow link", "re-plan ms", "re-plan ms (plan)", "bound ms", "gap",
                 "targets"], rows)
    return results


def bound_tightness(seed: int, count: int, limit_s: float) -> dict:
    """Section 3: the lower bound against proven optima (MILP on small random cases; uniform)."""
    out: dict = {"milp": [], "uniform": []}
    for S, N in ((4, 8), (8, 32), (32, 256)):
        c = Costs.uniform(S, 10.0)
        out["uniform"].append({"case": f"{S}x{N}", "bound_ms": lower_bound_ms(c, N), "optimum_ms": 3 * N * 10.0 + (S - 1) * 10.0})
    if milp_available():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from planner_vs_milp import random_case  # noqa: E402 - the held-out benchmark's cases

        from ds_pipemorph.plan.sched.milp import solve_exact

        rng = random.Random(seed + 2)
        for _ in range(count):
            case = random_case(rng)
            costs = case.costs()
            res = solve_exact(costs, case.microbatches, caps=case.caps, time_limit_s=limit_s)
            if res.optimal:
                lb = lower_bound_ms(costs, case.microbatches, caps=case.caps)
                out["milp"].append({"stages": case.stages, "microbatches": case.microbatches, "bound_ms": lb,
                                    "optimum_ms": res.iteration_ms, "gap": (res.iteration_ms - lb) / res.iteration_ms})
    gaps = [r["gap"] for r in out["milp"]]
    rows = [[f"uniform {r['case']}", f"{r['bound_ms']:.1f}", f"{r['optimum_ms']:.1f}",
             f"{(r['optimum_ms'] - r['bound_ms']) / r['optimum_ms']:.2%}"] for r in out["uniform"]]
    if gaps:
        out["milp_summary"] = {"cases": len(gaps), "mean_gap": statistics.fmean(gaps), "max_gap": max(gaps),
                               "violations": sum(g < -1e-9 for g in gaps), "exact": sum(abs(g) <= 1e-9 for g in gaps)}
        m = out["milp_summary"]
        rows.append([f"MILP, {m['cases']} small random cases", "", "",
                     f"mean {m['mean_gap']:.2%}, max {m['max_gap']:.2%}, exact in {m['exact']}, above optimum {m['violations']}"])
    print_table("the lower bound's tightness: (optimum - bound) / optimum", ["case", "bound ms", "optimum ms", "gap"], rows)
    return out


def pipemorph() -> list[str]:
    script = Path(sys.executable).parent / "pipemorph"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ds_pipemorph_cli.app"]


def profile_64x1024(kind: str, seed: int) -> dict:
    S, N = 64, 1024
    if kind == "uniform":
        return {"stages": S, "microbatches": N, "compute_ms": {"forward": 10.0, "backward_input": 10.0, "backward_weight": 10.0}}
    rng = random.Random(seed + 3)
    draw = lambda: [round(rng.uniform(5, 20), 2) for _ in range(S)]  # noqa: E731
    links = [0.0] * (S - 1)
    if kind == "heterogeneous":
        links = [rng.choice([0.0, 0.0, 0.0, round(rng.uniform(0, 40), 2)]) for _ in range(S - 1)]
        caps = [rng.randint(S - s, N) for s in range(S)]
        return {"stages": S, "microbatches": N, "links_ms": links, "memory": {"max_inflight": caps},
                "compute_ms": {"forward": draw(), "backward_input": draw(), "backward_weight": draw()}}
    links[S // 2] = 60.0  # uniform with one slow link
    return {"stages": S, "microbatches": N, "links_ms": links,
            "compute_ms": {"forward": 10.0, "backward_input": 10.0, "backward_weight": 10.0}}


def cli_64x1024(seed: int, runs: int) -> list:
    """Section 4: ``pipemorph plan`` and ``pipemorph simulate`` at 64x1024 as whole processes."""
    cli = pipemorph()
    work = work_folder("pipemorph-scale-")
    rows, results = [], []
    for kind in ("uniform", "uniform, 60 ms on link 32", "heterogeneous"):
        prof = work / f"profile-{kind.split(',')[0]}-{len(results)}.json"
        prof.write_text(json.dumps(profile_64x1024(kind.split(",")[0], seed)))
        plan = work / f"plan-{len(results)}.json"
        timings = {}
        for name, cmd in (("plan", [*cli, "plan", str(prof)]), ("plan -o", [*cli, "plan", str(prof), "-o", str(plan)]),
                          ("simulate", [*cli, "simulate", str(plan)])):
            walls = []
            for _ in range(runs):
                t = time.perf_counter()
                p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                walls.append(time.perf_counter() - t)
                if p.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed: {p.stderr.strip()[-500:]}")
            timings[name] = {"median_s": statistics.median(walls), "min_s": min(walls), "runs": walls}
        results.append({"case": f"64x1024 {kind}", **timings,
                        "meets_target": max(timings[k]["median_s"] for k in ("plan", "simulate")) <= CLI_TARGET_S})
        cell = lambda k: f"{timings[k]['median_s']:.2f} (min {timings[k]['min_s']:.2f})"  # noqa: E731
        rows.append([f"64x1024 {kind}", cell("plan"), cell("plan -o"), cell("simulate"),
                     "yes" if results[-1]["meets_target"] else "NO"])
    print_table(f"64x1024 as whole processes, median of {runs} (target {CLI_TARGET_S:.0f} s for plan and simulate; "
                "plan -o also writes the JSON plan simulate reads)",
                ["profile", "plan s", "plan -o plan.json s", "simulate plan.json s", "target"], rows)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/planner_scale.json")
    ap.add_argument("--quick", action="store_true", help="search budgets of at most 1 s in section 1")
    ap.add_argument("--milp-cases", type=int, default=12, help="small random cases for the bound's tightness")
    ap.add_argument("--milp-time-limit", type=float, default=20.0)
    ap.add_argument("--cli-runs", type=int, default=3)
    ap.add_argument("--skip-search", action="store_true", help="leave out section 1 (the budgeted searches)")
    args = ap.parse_args()
    native.lib()  # built (once per source version) before anything is timed
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    payload = {"benchmark": "planner_scale", "seed": args.seed, "compiled_core": native.lib() is not None,
               "load_average_1min_at_start": load}
    payload["results"] = searched(args.seed, args.quick) if not args.skip_search else []
    payload["fast_paths_32x256"] = fast_paths(args.seed)
    payload["bound_tightness"] = bound_tightness(args.seed, args.milp_cases, args.milp_time_limit)
    payload["cli_64x1024"] = cli_64x1024(args.seed, args.cli_runs)
    payload["load_average_1min_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    write_json(args.out, payload)


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
