"""Planner speed and quality where the MILP is out of reach: 8x32 and 32x256, gap to the lower bound.

    python benchmarks/planner_scale.py [--out out/planner_scale.json]

Targets (issue 2): <= 1 s for 8 stages x 32 micro-batches, <= 10 s for 32 x 256; the bound is
reached exactly on uniform profiles with no delay and no cap.
"""
from __future__ import annotations

import argparse
import random
import time

from _util import print_table, write_json

from ds_pipemorph.plan.listsched import list_schedule
from ds_pipemorph.plan.profile import Costs
from ds_pipemorph.plan.search import search
from ds_pipemorph.plan.simulate import replay
from ds_pipemorph.plan.warmup import initial_warmup


def cases(seed: int):
    rng = random.Random(seed)
    for S, N, budget in ((8, 32, 1.0), (32, 256, 10.0)):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/planner_scale.json")
    args = ap.parse_args()
    rows, results = [], []
    for name, costs, n, caps, budget in cases(args.seed):
        capv = caps or [n] * costs.stages
        t = time.perf_counter()
        greedy = replay(list_schedule(costs, n, initial_warmup(capv)), costs, n).iteration_ms
        greedy_s = time.perf_counter() - t
        res = search(costs, n, caps, budget_s=budget, seed=args.seed)
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
    write_json(args.out, {"benchmark": "planner_scale", "seed": args.seed, "results": results})


if __name__ == "__main__":
    main()
