"""Partition search speed and quality: 48 layers x 8 stages against a lower bound, and the branch
and bound against exhaustive search on small cases.

    python benchmarks/planner/partition_scale.py [--out out/partition_scale.json] [--small-cases 200]

Targets: the whole search (no time limit) <= 1 s at 48 layers x 8 stages (C(47, 7) = 62.9 million
partitions) on uniform and heterogeneous layers with and without a slow boundary link and memory
limits; gap 0 to exhaustive search of the same objective on every small case. Reported beside them:
the proven gap of the chosen partition's greedy plans to the least lower bound over every
partition, the uniform (``partition_method="uniform"``) and parameter-balanced
(``"parameters"``) partitions under the same objective, and all three planned by the full planner.
The same 48 x 8 profiles are searched again with per-stage slowdown factors (stage 1 at 2x; on
the memory-capped ones also stages 0, 3 and 6 at 1.5x, 1.2x and 2x), and half of the small cases
get random factors. A last section shows where the search may not finish within 1 s (as many
micro-batches as stages, where the lower bound is loosest): what the 1 s limit of
``pipemorph partition`` returns.
Times are wall clock on a shared machine: the load average is recorded.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from math import comb
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, write_json

from ds_pipemorph.plan.partition.layer_profile import LayerProfile
from ds_pipemorph.plan.partition.partition import evaluate, exhaustive, partition
from ds_pipemorph.plan.partition.parts import balanced_parts, uniform_parts
from ds_pipemorph.plan.sched.search import search
from ds_pipemorph.plan.sim import native

TARGET_S = 1.0
PLAN_BUDGET_S = 0.5


def profile(L: int, S: int, N: int, rng: random.Random, hetero: bool, slow: bool, memory: bool) -> LayerProfile:
    """Transformer-like layers: F, B = 1.1 F and W = 0.9 F per layer (2 ms, or 1-4 ms when
    heterogeneous, with an embedding-sized first and last layer); 16 MB activations over 10 GB/s
    links; with ``slow``, link (S-1)/2 (rounded down) has 30 ms latency at 1 GB/s; with ``memory``, 3 GB per stage
    against 200-400 MB of parameters and state and 20-40 MB of activations per in-flight micro-batch
    and layer."""
    f = [rng.uniform(1.0, 4.0) if hetero else 2.0 for _ in range(L)]
    if hetero:
        f[0], f[-1] = 0.5, 6.0
    lat, bw = [0.0] * (S - 1), [10.0] * (S - 1)
    if slow:
        lat[(S - 1) // 2], bw[(S - 1) // 2] = 30.0, 1.0
    d = {"stages": S, "microbatches": N,
         "layers": {"forward_ms": f, "backward_input_ms": [1.1 * x for x in f], "backward_weight_ms": [0.9 * x for x in f],
                    "activation_mb": [rng.choice([16, 16, 16, 48]) if hetero else 16 for _ in range(L)],
                    "memory_mb": [rng.uniform(200, 400) for _ in range(L)],
                    "stash_mb": [rng.uniform(20, 40) for _ in range(L)]},
         "links": {"bandwidth_gbs": bw, "latency_ms": lat}}
    if memory:
        d["memory"] = {"capacity_mb": 3000}
    return LayerProfile.model_validate(d)


COLUMNS = ["case", "search s", "complete", "replayed", "chosen ms", "bound ms", "gap", "at 1 s limit ms", "uniform ms",
           "parameters ms", "planned: chosen / uniform / parameters"]


def large_profiles(seed: int) -> list[tuple[str, LayerProfile]]:
    """The 16 profiles of section 1, named."""
    rng = random.Random(seed)
    out = []
    for N in (16, 32):
        for hetero in (False, True):
            for slow in (False, True):
                for memory in (False, True):
                    lp = profile(48, 8, N, rng, hetero, slow, memory)
                    out.append((f"48x8 N={N} {'heterogeneous' if hetero else 'uniform'}"
                                f"{', slow link' if slow else ''}{', 3 GB/stage' if memory else ''}", lp))
    return out


def large(cases: list[tuple[str, LayerProfile]]) -> list:
    """Section 1: 48 x 8, the whole search, against the bound and the baselines."""
    rows, out = [], []
    for name, lp in cases:
        out.append(run_case(name, lp, None, rows))
    print_table(f"48 layers x 8 stages: the whole search (target {TARGET_S:.0f} s), against a lower bound "
                "and DeepSpeed's partitions (greedy: the search's objective; planned: full planner, "
                f"{PLAN_BUDGET_S} s each)", COLUMNS, rows)
    return out


def slowed(cases: list[tuple[str, LayerProfile]]) -> list:
    """Section 1b: the same profiles with stages slowed down (a co-located job on their ranks):
    stage 1 at 2x on every profile, and stages 0, 3, 6 at 1.5x, 1.2x, 2x on the memory-capped ones.
    The baselines are scored and planned under the same factors."""
    rows, out = [], []
    for name, lp in cases:
        factors = [[1.0, 2.0] + [1.0] * (lp.stages - 2)]
        if lp.memory.capacity_mb is not None:
            factors.append([1.5, 1.0, 1.0, 1.2, 1.0, 1.0, 2.0, 1.0])
        for k in factors:
            label = ", ".join(f"{s}:{x:g}" for s, x in enumerate(k) if x != 1.0)
            out.append(run_case(f"{name}; slowdown {label}", lp, None, rows, k))
    print_table(f"48 layers x 8 stages with per-stage slowdown factors (stage:factor; target {TARGET_S:.0f} s)",
                COLUMNS, rows)
    return out


def run_case(name: str, lp: LayerProfile, limit, rows: list, slowdown=None) -> dict:
    L, S, N = lp.num_layers, lp.stages, lp.microbatches
    t = time.perf_counter()
    res = partition(lp, time_limit_s=limit, slowdown=slowdown)
    wall = time.perf_counter() - t
    base = {"uniform": uniform_parts(L, S), "parameters": balanced_parts(lp.layers.param_count, S)}
    greedy = {k: evaluate(lp, p, slowdown=slowdown) for k, p in base.items()}
    planned = {}
    for k, p in (("chosen", res.parts), *base.items()):
        if any(c is None for c in lp.caps(p)):
            planned[k] = None
            continue
        prof = lp.stage_profile(p, slowdown)
        planned[k] = search(prof.costs(), N, caps=prof.caps(), budget_s=PLAN_BUDGET_S, seed=0).iteration_ms
    at_limit = None
    if limit is None and wall > TARGET_S:  # what ``pipemorph partition``'s default 1 s limit returns
        at_limit = partition(lp, time_limit_s=TARGET_S, slowdown=slowdown)
    rec = {"case": name, "layers": L, "stages": S, "microbatches": N, "partitions": comb(L - 1, S - 1),
           "slowdown": slowdown,
           "seconds": wall, "complete": res.complete, "replayed": res.replayed, "leaves": res.leaves,
           "parts": res.parts, "chosen_ms": res.iteration_ms, "lower_bound_ms": res.lower_bound_ms,
           "gap_to_bound": res.gap_to_bound, "time_limit_s": limit,
           "baselines": {k: {"parts": base[k], "greedy_ms": greedy[k], "planned_ms": planned[k]} for k in base},
           "planned_chosen_ms": planned["chosen"], "within_target": wall <= TARGET_S,
           "at_1s_limit": None if at_limit is None else {"parts": at_limit.parts, "chosen_ms": at_limit.iteration_ms,
                                                        "lower_bound_ms": at_limit.lower_bound_ms}}
    fmt = lambda v: "does not fit" if v is None or v == float("inf") else f"{v:.1f}"  # noqa: E731
    rows.append([name, f"{wall:.3f}", "yes" if res.complete else "no", res.replayed, f"{res.iteration_ms:.1f}",
                 f"{res.lower_bound_ms:.1f}", f"{res.gap_to_bound:.2%}",
                 "" if at_limit is None else f"{at_limit.iteration_ms:.1f}", fmt(greedy["uniform"]),
                 fmt(greedy["parameters"]), " / ".join(fmt(planned[k]) for k in ("chosen", "uniform", "parameters"))])
    return rec


def small(seed: int, count: int) -> dict:
    """Section 2: the branch and bound against exhaustive search (the same objective); every other
    case with random slowdown factors (drawn apart, so the profiles are the same with or without)."""
    rng = random.Random(seed + 1)
    rng_slow = random.Random(seed + 3)
    recs, mismatches, bb_s, ex_s, parts_total = [], 0, 0.0, 0.0, 0
    for i in range(count):
        L = rng.randint(6, 14)
        S = rng.randint(2, min(5, L))
        N = rng.randint(S, 3 * S)
        lp = profile(L, S, N, rng, hetero=rng.random() < 0.7, slow=rng.random() < 0.5, memory=False)
        if rng.random() < 0.4:  # memory from loose to tight, so that some cuts do not fit
            per = sum(lp.layers.memory_mb) / S
            lp = LayerProfile.model_validate(dict(lp.model_dump(), memory={"capacity_mb": per * rng.uniform(1.2, 2.5)}))
        factors = [rng_slow.choice([1.0, 1.5, 2.0, 3.0]) for _ in range(S)] if i % 2 else None
        t = time.perf_counter()
        best, best_t = exhaustive(lp, slowdown=factors)
        ex_s += time.perf_counter() - t
        if best is None:
            continue
        t = time.perf_counter()
        res = partition(lp, slowdown=factors)
        bb_s += time.perf_counter() - t
        same = abs(res.iteration_ms - best_t) <= 1e-6
        mismatches += not same
        parts_total += comb(L - 1, S - 1)
        recs.append({"layers": L, "stages": S, "microbatches": N, "slowdown": factors,
                     "exhaustive_ms": best_t, "bnb_ms": res.iteration_ms,
                     "same": same, "replayed": res.replayed, "bound_ms": res.lower_bound_ms})
    summary = {"cases": len(recs), "with_slowdown": sum(r["slowdown"] is not None for r in recs),
               "mismatches": mismatches, "partitions": parts_total,
               "bnb_replayed": sum(r["replayed"] for r in recs), "exhaustive_s": ex_s, "bnb_s": bb_s,
               "max_gap_to_bound": max((r["bnb_ms"] - r["bound_ms"]) / r["bound_ms"] for r in recs) if recs else 0.0}
    print_table("branch and bound vs exhaustive search, small random cases (6-14 layers, 2-5 stages)",
                ["cases", "with slowdown", "mismatches", "partitions", "replayed by B&B", "exhaustive s", "B&B s",
                 "max gap to bound"],
                [[summary["cases"], summary["with_slowdown"], summary["mismatches"], parts_total, summary["bnb_replayed"], f"{ex_s:.2f}",
                  f"{bb_s:.2f}", f"{summary['max_gap_to_bound']:.2%}"]])
    return {"summary": summary, "cases": recs}


def hard(seed: int) -> list:
    """Section 3: as many micro-batches as stages, where the search may not finish in 1 s."""
    rng = random.Random(seed + 2)
    rows, out = [], []
    for k in range(3):
        lp = profile(48, 8, 8, rng, hetero=True, slow=k != 1, memory=k == 2)
        out.append(run_case(f"48x8 N=8 heterogeneous #{k}", lp, TARGET_S, rows))
    print_table(f"48x8 with N = S = 8: what a {TARGET_S:.0f} s limit returns (complete: proved best)", COLUMNS, rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/partition_scale.json")
    ap.add_argument("--small-cases", type=int, default=200)
    args = ap.parse_args()
    native.lib()  # built (once per source version) before anything is timed
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    payload = {"benchmark": "partition_scale", "seed": args.seed, "compiled_core": native.lib() is not None,
               "load_average_1min_at_start": load, "target_s": TARGET_S}
    cases = large_profiles(args.seed)
    payload["large"] = large(cases)
    payload["large_slowdown"] = slowed(cases)
    payload["small_vs_exhaustive"] = small(args.seed, args.small_cases)
    payload["hard_time_limited"] = hard(args.seed)
    payload["load_average_1min_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
