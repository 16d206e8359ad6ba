"""Readiness-driven dispatch against ordered dispatch of the same hint, paired.

4 stages, 12 micro-batches (``--stages``, ``--microbatches``: deeper pipelines give ready dispatch
more room under the same caps, and this machine less CPU per rank), emulated stages (F = B = W =
10 ms around tiny real math) on one CPU rank per stage, the real engine. Five workloads:

1. heavy micro-batches: each pair of iterations a seeded quarter of the micro-batches is 3x heavier
   (F, B, W) on the first two stages (a multimodal batch whose images go through the encoder
   there); hint `zb`;
2. per-op jitter: each F and B of each (stage, micro-batch) scaled by a seeded factor uniform in
   [0.5, 1.5] (mean 1), drawn anew for each pair of iterations; hint `zb`;
3. PipeMorph §7.2 dynamic delays on link 1 (N(30, 10) ms, redrawn every U(50, 100) ms); hint
   `adaptive` with the control loop on;
4. a static 30 ms delay on link 1; `adaptive` with the control loop on;
5. no variation; hint `zb`.

Paired (``ds_pipemorph.paired``): A is ready dispatch, B ordered dispatch, in the cycle
``A B A' B``; the result is ordered / ready, the median of the per-pair ratios with a bootstrap
95 % interval, next to the A/A noise check; "no difference measurable here" when the interval
holds 1. Workloads 1, 2 and 5 alternate in one job: one engine switches its dispatch at every
iteration boundary (``engine.switch_to``), and both members of a pair run the same table of op
times. Workloads 3 and 4 have a control loop that re-plans on its own, which cannot share
iterations with another: whole runs alternate there, each a fresh engine in the same ranks (the
delay trace starts anew with each), and a run's sample is the median of its measured iterations.

Per-op times come from ``plan.sim.variation`` tables (``inject.vary`` makes the engine's ops
last them); the readiness replay (``plan.sim.ready``) of the same tables predicts workloads 1, 2 and 5.
Iteration time: from a barrier before ``train_batch`` to the last rank's return. The dispatch cost
per op is the time ready dispatch spends choosing the next op (``engine.choosing_ns``) over the
ops it ran; "ops ahead of the hint" counts, per stage, the ops of the last ready iteration that
started while an op earlier in the hint was still to run. Prints a table and writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/engine/ready_dispatch.py [--pairs 12] [--warmup 4] [--run-pairs 6]
        [--iters 6] [--stages 4] [--microbatches 12] [--workloads heavy,jitter,dynamic,static,none]
        [--out out/ready_dispatch.json]

(re-launches itself with ``torchrun --standalone --nproc_per_node STAGES`` when not started by torchrun).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, relaunch, write_json

STAGES, MICROBATCHES, OP_MS = 4, 12, 10.0
SLOW_LINK, DELAY_MS = 1, 30.0
WORKLOADS = ("heavy", "jitter", "dynamic", "static", "none")
ONE_JOB = ("heavy", "jitter", "none")  # a fixed hint: the dispatch switches every iteration
TARGET_SPEEDUP = 1.10  # ready over ordered on heavy and jitter (and dynamic, with adaptive)
TARGET_PREDICTION = 0.10  # engine within 10 % of the readiness replay
TARGET_STILL = 0.02  # ready within 2 % of ordered when nothing varies


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=12, help="B/A pairs of a one-job workload (A/A: half as many)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured iterations: of the job, or of each whole run")
    ap.add_argument("--run-pairs", type=int, default=6, help="B/A pairs of whole runs (dynamic, static)")
    ap.add_argument("--iters", type=int, default=6, help="measured iterations of each whole run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the op-time tables and of the bootstrap")
    ap.add_argument("--out", default="out/ready_dispatch.json")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="a comma-separated subset of " + ",".join(WORKLOADS))
    ap.add_argument("--stages", type=int, default=STAGES, help="pipeline stages (one rank each)")
    ap.add_argument("--microbatches", type=int, default=MICROBATCHES)
    args = ap.parse_args()
    if args.stages <= SLOW_LINK + 1 or args.microbatches < args.stages:
        ap.error(f"--stages should be at least {SLOW_LINK + 2} (link {SLOW_LINK} is slowed) "
                 "and --microbatches at least --stages")
    if args.warmup % 2:
        ap.error("--warmup must be even: the two iterations of a pair share one table of op times")
    bad = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if bad:
        ap.error(f"--workloads: '{bad[0]}' is not one of {', '.join(WORKLOADS)}")
    return args


def tables(workload: str, seed: int):
    """(iteration -> OpTable, the emulated stage's own F/B/W ms: the table's smallest)."""
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sim.variation import OpTable, heavy, jitter

    costs = Costs.uniform(STAGES, OP_MS)
    if workload == "heavy":
        return (lambda k: heavy(costs, MICROBATCHES, frac=0.25, factor=3.0, stages=2, seed=seed + k)), (OP_MS,) * 3
    if workload == "jitter":
        return (lambda k: jitter(costs, MICROBATCHES, 0.5, seed=seed + k)), (OP_MS / 2, OP_MS / 2, OP_MS)
    const = OpTable.constant(costs, MICROBATCHES)
    return (lambda k: const), (OP_MS,) * 3


def section(workload: str, dispatch: str, trace: str) -> dict:
    adaptive = workload in ("dynamic", "static")
    out = {"schedule": "adaptive" if adaptive else "zb", "dispatch": dispatch, "delegation": {"mode": "off"},
           "adapt": {"enabled": adaptive}, "nvtx": False}
    if workload == "dynamic":
        out["inject"] = {"trace": trace}
    elif workload == "static":
        out["inject"] = {"links": {str(SLOW_LINK): {"delay_ms": DELAY_MS}}}
    return out


def build(workload: str, dispatch: str, args, trace: str):
    """A fresh engine for ``workload`` with ``dispatch``, its ops lasting the workload's tables; the
    table of iteration k is the pair's, ``k // 2`` (both members of a pair run the same one)."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.inject.emulated import EmulatedStage
    from ds_pipemorph.inject.vary import install

    table_of, base = tables(workload, args.seed)
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, *base) for _ in range(STAGES)], num_stages=STAGES,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICROBATCHES,
           "train_batch_size": MICROBATCHES, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9, "pipemorph": section(workload, dispatch, trace)}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    install(engine, lambda k: table_of(k // 2))
    return engine


def batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(MICROBATCHES)]


def departed(engine) -> int:
    """Ops of the last iteration this rank started while an op earlier in the hint was still to run."""
    ran = [r.op for r in engine.op_records if r.plan_op is not None and r.plan_op.kind.is_compute]
    position = {str(op): i for i, op in enumerate(engine.stage_plan)}
    count, pending = 0, sorted(position.values())
    for op in ran:
        count += position[op] > pending[0]
        pending.remove(position[op])
    return count


def close(engine) -> None:
    for part in (engine.inbox, getattr(engine, "_idle_inbox", None), engine.transport, engine.adapter):
        if part is not None:
            part.close()


def one_job(workload: str, args, trace: str) -> dict:
    """Ready (A) and ordered (B) dispatch of one engine, switched every iteration: side, ms per
    iteration; ready dispatch's choosing time and ops, and its departures from the hint."""
    import torch.distributed as dist

    from ds_pipemorph.paired import A_SIDE, cycles_for, sequence
    from ds_pipemorph.bench.paired_worker import timed_step

    engine = build(workload, "ordered", args, trace)
    data = batch()
    sides = sequence(args.warmup + 4 * cycles_for(args.pairs), args.warmup)
    rows, choosing, ops, ahead = [], 0, 0, 0
    for k, label in enumerate(sides):
        dispatch = "ready" if label in A_SIDE else "ordered"
        engine.switch_to(dispatch=dispatch)
        before = len(engine.choosing_ns)
        rows.append({"side": label, "dispatch": dispatch, "ms": timed_step(lambda: engine.train_batch(iter(data)))})
        if dispatch == "ready":
            if len(engine.choosing_ns) == before:
                raise RuntimeError(f"iteration {k}: ready dispatch did not run")
            ahead = departed(engine)
            if k >= args.warmup:
                choosing += engine.choosing_ns[-1]
                ops += 3 * MICROBATCHES
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ahead)
    plan = [[str(op) for op in row] for row in engine.plan]
    close(engine)
    return {"iterations": rows, "choosing_ns": choosing, "ops": ops, "departed": gathered, "plan": plan}


def whole_runs(workload: str, args, trace: str) -> dict:
    """Fresh engines alternating, ready (A) and ordered (B); a run's sample is its median iteration."""
    import torch.distributed as dist

    from ds_pipemorph.paired import A_SIDE, cycles_for, sequence
    from ds_pipemorph.bench.paired_worker import timed_step

    rows = []
    for k, label in enumerate(sequence(4 * cycles_for(args.run_pairs))):
        dispatch = "ready" if label in A_SIDE else "ordered"
        engine = build(workload, dispatch, args, trace)
        data = batch()
        ms = [timed_step(lambda: engine.train_batch(iter(data))) for _ in range(args.warmup + args.iters)]
        rows.append({"side": label, "dispatch": dispatch, "ms": statistics.median(ms[args.warmup:]),
                     "iterations_ms": ms})
        close(engine)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"{workload}: run {k + 1} ({dispatch}): {rows[-1]['ms']:.1f} ms", flush=True)
    return {"iterations": rows}


def predict(workload: str, plan_text, dispatch: str, ks, args) -> float:
    """Mean over iterations ``ks`` of the replay of each one's table."""
    from ds_pipemorph.plan.ir.ops import peak_inflight
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sim.ready import replay_varying
    from ds_pipemorph.plan.sim.validate import parse_schedule

    plan = parse_schedule(plan_text)
    table_of, _ = tables(workload, args.seed)
    costs = Costs.uniform(STAGES, OP_MS)
    caps = peak_inflight(plan)
    return statistics.mean(replay_varying(plan, costs, MICROBATCHES, dispatch=dispatch, caps=caps,
                                          op_times=table_of(k // 2)).iteration_ms for k in ks)


def main() -> int:
    global STAGES, MICROBATCHES
    args = parse_args()
    STAGES, MICROBATCHES = args.stages, args.microbatches
    if "LOCAL_RANK" not in os.environ:
        return relaunch(__file__, STAGES)
    import deepspeed
    import torch.distributed as dist

    from ds_pipemorph.bench.traces import RATES, make_trace, trace_text

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    trace = os.path.join(tempfile.gettempdir(), f"pipemorph-ready-trace-{os.getppid()}.yaml")
    if rank == 0:
        duration = 3.0 * (args.warmup + max(args.iters, 4 * args.pairs)) * 0.8 + 30
        text = trace_text(make_trace(STAGES - 1, [SLOW_LINK], duration, RATES["A"], seed=args.seed), "§7.2 rate A")
        Path(trace).write_text(text)
    dist.barrier()
    results = {}
    for workload in args.workloads.split(","):
        results[workload] = (one_job if workload in ONE_JOB else whole_runs)(workload, args, trace)
        dist.barrier()
    if rank == 0:
        report(results, args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(results: dict, args) -> None:
    from ds_pipemorph.paired import compare

    rows, out, verdicts = [], [], []
    for w, res in results.items():
        it = res["iterations"]
        one = w in ONE_JOB
        warmup = args.warmup if one else 0
        c = compare([r["side"] for r in it], [r["ms"] for r in it], warmup, seed=args.seed)
        r, n = c.ratio, c.noise
        pred = ready_over_pred = cost_us = None
        if one:
            measured = range(warmup, len(it))
            pred = {d: predict(w, res["plan"], d, [k for k in measured if it[k]["dispatch"] == d], args)
                    for d in ("ordered", "ready")}
            ready_over_pred = c.a_median_ms / pred["ready"]
            cost_us = res["choosing_ns"] / res["ops"] / 1e3 if res["ops"] else None
        if w in ("heavy", "jitter", "dynamic"):
            target = f"ordered / ready >= {TARGET_SPEEDUP:.2f}"
            met = (r.median >= TARGET_SPEEDUP and r.lo > 1.0  # a speed-up, and one measurable here
                   and (ready_over_pred is None or abs(ready_over_pred - 1) <= TARGET_PREDICTION))
        else:
            target = f"ready within {TARGET_STILL:.0%} of ordered"
            met = r.median >= 1 / (1 + TARGET_STILL)
        out.append({"workload": w, "alternation": "one job" if one else "whole runs", "comparison": c.as_dict(),
                    "predicted_ms": pred, "ready_median_over_predicted": ready_over_pred,
                    "choosing_us_per_op": cost_us, "departed_per_stage": res.get("departed"),
                    "target": target, "met": met, "iterations": it})
        rows.append([w, "one job" if one else "whole runs", f"{r.median:.3f}", f"[{r.lo:.3f}, {r.hi:.3f}]", r.pairs,
                     n.text() if n else "-", f"{c.b_median_ms:.1f} / {c.a_median_ms:.1f}",
                     f"{pred['ordered']:.1f} / {pred['ready']:.1f}" if pred else "-",
                     f"{ready_over_pred:.3f}" if ready_over_pred else "-",
                     f"{cost_us:.1f}" if cost_us is not None else "-",
                     ",".join(map(str, res["departed"])) if res.get("departed") else "-", "yes" if met else "NO"])
        verdicts.append(f"{w} (ordered / ready): {c.verdict}")
    print_table(f"ordered (B) / ready (A) dispatch, {STAGES} stages x {MICROBATCHES} micro-batches, paired "
                f"(A B A' B ...), median per-pair ratio with its bootstrap 95% interval",
                ["workload", "alternation", "ordered / ready", "95% interval", "pairs", "A'/A noise [95%]",
                 "median ms ordered / ready", "replay ordered / ready ms", "ready / its replay",
                 "choosing us/op", "ops ahead of the hint per stage", "target met"], rows)
    print("\n".join(verdicts))
    write_json(args.out, {"benchmark": "ready_dispatch", "stages": STAGES, "microbatches": MICROBATCHES,
                          "op_ms": OP_MS, "pairs": args.pairs, "run_pairs": args.run_pairs, "iters": args.iters,
                          "warmup": args.warmup, "seed": args.seed, "results": out})


if __name__ == "__main__":
    sys.exit(main())
