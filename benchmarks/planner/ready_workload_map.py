"""Where readiness-driven dispatch pays: ordered against ready dispatch in the replay, over the
parameters of the workloads of ``benchmarks/engine/ready_dispatch.py``.

4 stages x 12 micro-batches, F = B = W = 10 ms, no link delay, the simulator only
(``plan.sim.ready.replay_varying``; nothing runs on the engine). Each workload keeps its definition
and sweeps its parameters:

- heavy: round(frac x N) micro-batches (seeded) take ``factor`` times as long for F, B and W on
  the first ``stages`` stages (``plan.sim.variation.heavy``); frac 0.10-0.30 (1-4 of 12 micro-batches),
  factor 2-6, stages 1-2 of 4;
- jitter: every F and B (or F, B and W) of every (stage, micro-batch) scaled by its own seeded
  factor of mean 1: uniform in [1 - s, 1 + s] (``plan.sim.variation.jitter``), lognormal with sigma
  0.2-0.6, or gamma with a coefficient of variation 0.2-0.6.

Hints: ``zb`` (the engine's plan for ``schedule: "zb"``) and ``1f1b`` (DeepSpeed's order, B and W
run apart as the engine runs them). Caps per stage: the plan's peak of in-flight activations (what
the engine uses), the peak + 1, + 2, and none (N: what the cap costs). Each parameter set is
replayed under ``--iters`` seeded draws (the benchmark draws anew every iteration); its speed-up is
the mean ordered time over the mean ready time. Prints a summary per workload, hint and cap, the
parameter sets at or above ``--target`` and how much the cap holds ready dispatch back; writes
every parameter set to JSON.

    python benchmarks/planner/ready_workload_map.py [--iters 20] [--target 1.15] [--out out/ready_workload_map.json]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, write_json  # noqa: E402

from ds_pipemorph.plan.ir.ops import peak_inflight  # noqa: E402
from ds_pipemorph.plan.ir.profile import Costs  # noqa: E402
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, zb_h1_warmup  # noqa: E402
from ds_pipemorph.plan.sim.ready import replay_varying  # noqa: E402
from ds_pipemorph.plan.sim.variation import OpTable, heavy, jitter  # noqa: E402
from ds_pipemorph.runtime.plans import DEFAULT_OP_MS, latency_robust_schedule  # noqa: E402

STAGES, MICROBATCHES, OP_MS = 4, 12, 10.0
CAPS = ("peak", "peak+1", "peak+2", "none")
HEAVY_FRACS = (0.10, 0.15, 0.25, 0.30)  # 1, 2, 3 and 4 of 12 micro-batches
HEAVY_FACTORS = (2.0, 3.0, 4.0, 5.0, 6.0)
HEAVY_STAGES = (1, 2)
JITTER = {"uniform": (0.25, 0.5, 0.75, 1.0), "lognormal": (0.2, 0.3, 0.4, 0.5, 0.6), "gamma": (0.2, 0.4, 0.6)}
JITTER_KINDS = ("FB", "FBW")
BENCHMARK = {"heavy": "frac=0.25 factor=3 stages=2", "jitter": "uniform s=0.5 FB"}  # benchmarks/engine/ready_dispatch.py


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20, help="seeded draws per parameter set")
    ap.add_argument("--seed", type=int, default=0, help="draws use seeds seed .. seed + iters - 1")
    ap.add_argument("--target", type=float, default=1.15, help="speed-up to list the parameter sets reaching")
    ap.add_argument("--show", type=int, default=12, help="how many of the fastest parameter sets to list")
    ap.add_argument("--out", default="out/ready_workload_map.json")
    return ap.parse_args()


def hints(costs: Costs) -> dict:
    S, N = STAGES, MICROBATCHES
    return {"zb": latency_robust_schedule(Costs.uniform(S, DEFAULT_OP_MS), N, zb_h1_warmup(S, N)),
            "1f1b": deepspeed_1f1b(S, N)}


def caps_of(plan, cap: str) -> list[int]:
    if cap == "none":
        return [MICROBATCHES] * STAGES
    extra = 0 if cap == "peak" else int(cap.split("+")[1])
    return [min(MICROBATCHES, max(1, p) + extra) for p in peak_inflight(plan)]


def scaled_jitter(costs: Costs, shape: str, spread: float, seed: int, kinds: str) -> OpTable:
    """Per-op factors of mean 1, drawn in ``plan.sim.variation.jitter``'s order (stage, micro-batch, kind)."""
    if shape == "uniform":
        return jitter(costs, MICROBATCHES, spread, seed=seed, kinds=kinds)
    rng = random.Random(seed)
    if shape == "lognormal":  # mean exp(mu + sigma^2 / 2) = 1
        def draw():
            return rng.lognormvariate(-spread * spread / 2, spread)
    else:  # gamma of shape 1/cv^2 and scale cv^2: mean 1, coefficient of variation cv
        def draw():
            return rng.gammavariate(1 / (spread * spread), spread * spread)
    factors = {(s, k, m): draw() for s in range(STAGES) for m in range(MICROBATCHES) for k in "FBW" if k in kinds}
    return OpTable.constant(costs, MICROBATCHES).scaled(factors)


def workloads(costs: Costs):
    """(workload, parameter text, parameters, seed -> OpTable) of every parameter set."""
    N = MICROBATCHES
    for stages in HEAVY_STAGES:
        for frac in HEAVY_FRACS:
            for factor in HEAVY_FACTORS:
                yield ("heavy", f"frac={frac:g} factor={factor:g} stages={stages}",
                       {"frac": frac, "heavy_microbatches": round(frac * N + 1e-9), "factor": factor, "stages": stages},
                       lambda seed, f=frac, x=factor, k=stages: heavy(costs, N, frac=f, factor=x, stages=k, seed=seed))
    for kinds in JITTER_KINDS:
        for shape, spreads in JITTER.items():
            for spread in spreads:
                name = {"uniform": "s", "lognormal": "sigma", "gamma": "cv"}[shape]
                yield ("jitter", f"{shape} {name}={spread:g} {kinds}",
                       {"shape": shape, name: spread, "kinds": kinds},
                       lambda seed, sh=shape, sp=spread, kd=kinds: scaled_jitter(costs, sh, sp, seed, kd))


def bound_ms(t: OpTable) -> float:
    """A lower bound on the iteration under any dispatch and no cap: a stage runs all its ops after
    the first activation can reach it; a micro-batch runs its F on every stage, then its B on every
    stage back to the first, then that stage's W."""
    S, N = STAGES, MICROBATCHES
    head = [min(sum(t.f[q][m] for q in range(s)) for m in range(N)) for s in range(S)]
    stages = max(head[s] + sum(t.f[s]) + sum(t.b[s]) + sum(t.w[s]) for s in range(S))
    path = max(sum(t.f[s][m] + t.b[s][m] for s in range(S)) + t.w[0][m] for m in range(N))
    return max(stages, path)


def measure(plans: dict, costs: Costs, table_of, seeds) -> dict:
    """Per hint: mean ordered ms, and per cap the mean ready ms, the speed-up and its per-draw range;
    ``ceiling``: the mean ordered ms over the mean lower bound (no dispatch does better)."""
    tables = [table_of(seed) for seed in seeds]
    bound = statistics.mean(bound_ms(t) for t in tables)
    out = {}
    for h, plan in plans.items():
        ordered = [replay_varying(plan, costs, MICROBATCHES, dispatch="ordered", op_times=t).iteration_ms
                   for t in tables]
        row = {"ordered_ms": statistics.mean(ordered), "bound_ms": bound, "ceiling": statistics.mean(ordered) / bound,
               "caps": {}}
        for cap in CAPS:
            c = caps_of(plan, cap)
            ready = [replay_varying(plan, costs, MICROBATCHES, dispatch="ready", caps=c, op_times=t).iteration_ms
                     for t in tables]
            per = sorted(o / r for o, r in zip(ordered, ready))
            row["caps"][cap] = {"caps": c, "ready_ms": statistics.mean(ready),
                                "speedup": statistics.mean(ordered) / statistics.mean(ready),
                                "per_draw": {"min": per[0], "median": statistics.median(per), "max": per[-1]}}
        out[h] = row
    return out


def main() -> int:
    args = parse_args()
    costs = Costs.uniform(STAGES, OP_MS)
    plans = hints(costs)
    seeds = range(args.seed, args.seed + args.iters)
    t0 = time.perf_counter()
    sets = []
    for workload, text, params, table_of in workloads(costs):
        sets.append({"workload": workload, "params": text, **params, "hints": measure(plans, costs, table_of, seeds)})
    seconds = time.perf_counter() - t0
    report(sets, args)
    write_json(args.out, {"benchmark": "ready_workload_map", "stages": STAGES, "microbatches": MICROBATCHES,
                          "op_ms": OP_MS, "iters": args.iters, "seed": args.seed, "target": args.target,
                          "caps": list(CAPS), "plans": {h: [[str(op) for op in row] for row in p] for h, p in plans.items()},
                          "seconds": seconds, "sets": sets})
    return 0


def _speedup(s: dict, h: str, cap: str) -> float:
    return s["hints"][h]["caps"][cap]["speedup"]


def report(sets: list, args) -> None:
    rows = []
    for w in ("heavy", "jitter"):
        for h in ("zb", "1f1b"):
            for cap in CAPS:
                mine = [s for s in sets if s["workload"] == w]
                ups = [_speedup(s, h, cap) for s in mine]
                best = max(mine, key=lambda s: _speedup(s, h, cap))
                bench = next(s for s in mine if s["params"] == BENCHMARK[w])
                rows.append([w, h, cap, f"{_speedup(bench, h, cap):.3f}x", f"{statistics.median(ups):.3f}x",
                             f"{_speedup(best, h, cap):.3f}x", best["params"], f"{best['hints'][h]['ceiling']:.3f}x",
                             f"{sum(u >= args.target for u in ups)}/{len(ups)}"])
    print_table(f"ordered / ready dispatch in the replay, {STAGES} x {MICROBATCHES}, F = B = W = {OP_MS:g} ms, "
                f"mean of {args.iters} draws per parameter set",
                ["workload", "hint", "cap", "benchmark's parameters", "median over sets", "best", "best at",
                 "its ordered / lower bound", f">= {args.target:g}x"], rows)

    best = []
    for s in sets:
        for h in ("zb", "1f1b"):
            ups = {cap: _speedup(s, h, cap) for cap in CAPS}
            d = s["hints"][h]["caps"]["peak"]["per_draw"]
            best.append((max(ups[c] for c in CAPS if c != "none"), [
                s["workload"], s["params"], h, *(f"{ups[c]:.3f}x" for c in CAPS), f"{d['min']:.2f}-{d['max']:.2f}",
                f"{s['hints'][h]['ordered_ms']:.0f}", f"{s['hints'][h]['ceiling']:.3f}x"]))
    best.sort(key=lambda x: -x[0])
    reached = sum(b >= args.target for b, _ in best)
    print_table(f"the {args.show} parameter sets fastest under ready dispatch with a cap of the peak, + 1 or + 2 "
                f"({reached} of {len(best)} sets x hints reach {args.target:g}x)",
                ["workload", "parameters", "hint", *CAPS, "per draw at peak", "ordered ms",
                 "ordered / lower bound"], [r for _, r in best[:args.show]])

    rows = []
    for w in ("heavy", "jitter"):
        for h in ("zb", "1f1b"):
            mine = [s for s in sets if s["workload"] == w]
            gain = {cap: [_speedup(s, h, cap) / _speedup(s, h, "peak") for s in mine] for cap in CAPS[1:]}
            rows.append([w, h, *(f"{statistics.median(g):.3f} / {max(g):.3f}" for g in gain.values())])
    print_table("how much the cap holds ready dispatch back: speed-up at a larger cap / at the peak "
                "(median / largest over parameter sets)", ["workload", "hint", *CAPS[1:]], rows)


if __name__ == "__main__":
    sys.exit(main())
