"""What the planner's compiled core saves: the list scheduler and one replay, in C and in Python.

    python benchmarks/planner/plan_core.py [--out out/plan_core.json] [--repeats 20]

On uniform pipelines (10 ms per op, 30 ms on the last link) of 4x12, 8x32 and 16x64 stages x
micro-batches: the best of three timings of ``repeats`` runs each, through the compiled core and
through the pure-Python code it replaces (what a machine without a C compiler runs). The ratio is
what ``plan.sim.native.PYTHON_COST`` tells a user whose core could not be built. Times are wall clock
on a shared machine: the load average is recorded.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, write_json

from ds_pipemorph.plan.ir.links import LATENCY, per_link
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sim.listsched_py import Policy, list_schedule_py
from ds_pipemorph.plan.sim import native
from ds_pipemorph.plan.sim import simulate as sim
from ds_pipemorph.plan.sim.replay_py import run_py

SIZES = ((4, 12), (8, 32), (16, 64))


def best_of_three(fn, repeats: int) -> float:
    """Seconds per call: the fastest of three rounds of ``repeats`` calls."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t) / repeats)
    return best


def measure(S: int, N: int, repeats: int) -> dict:
    costs = Costs.uniform(S, 10.0, [0.0] * (S - 2) + [30.0])
    x = [min(N, S - s + 2) for s in range(S)]
    pol = Policy()
    sched = list_schedule(costs, N, x, policy=pol)
    models = per_link(LATENCY, S - 1)
    row = {"stages": S, "microbatches": N}
    row["replay_c_us"] = best_of_three(lambda: sim.makespan(sched, costs, N), repeats) * 1e6
    row["replay_py_us"] = best_of_three(lambda: run_py(sched, costs, N, False, None, models), repeats) * 1e6
    row["list_c_us"] = best_of_three(
        lambda: native.list_schedule(costs, N, x, pol.priority, pol.w_fits_gap, pol.late_w), repeats) * 1e6
    row["list_py_us"] = best_of_three(lambda: list_schedule_py(costs, N, x, pol), repeats) * 1e6
    row["replay_ratio"] = row["replay_py_us"] / row["replay_c_us"]
    row["list_ratio"] = row["list_py_us"] / row["list_c_us"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out/plan_core.json"))
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.repeats < 1:
        print("--repeats must be at least 1.", file=sys.stderr)
        return 2
    if native.lib() is None:
        print("The planner core is not available here (see the log line above): nothing to compare.", file=sys.stderr)
        return 1
    rows = [measure(S, N, args.repeats) for S, N in SIZES]
    print_table("planner core: C against Python (us per call, best of 3)",
                ["S x N", "replay C", "replay Py", "x", "list sched C", "list sched Py", "x"],
                [[f"{r['stages']}x{r['microbatches']}", f"{r['replay_c_us']:.0f}", f"{r['replay_py_us']:.0f}",
                  f"{r['replay_ratio']:.0f}", f"{r['list_c_us']:.0f}", f"{r['list_py_us']:.0f}",
                  f"{r['list_ratio']:.0f}"] for r in rows])
    print(f"told without the core: {native.PYTHON_COST}")
    write_json(str(args.out), {"rows": rows, "python_cost": native.PYTHON_COST, "repeats": args.repeats,
                               "loadavg": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
