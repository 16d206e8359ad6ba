"""Readiness-driven dispatch against ordered dispatch of the same hint, side by side in one run.

4 stages, 12 micro-batches (``--stages``, ``--microbatches``: deeper pipelines give ready dispatch
more room under the same caps, and this machine less CPU per rank), emulated stages (F = B = W =
10 ms around tiny real math) on one CPU rank per stage, the real engine. Five workloads, each run
with ``dispatch: "ordered"`` and ``"ready"``:

1. heavy micro-batches: each iteration a seeded quarter of the micro-batches is 3x heavier (F, B, W)
   on the first two stages (a multimodal batch whose images go through the encoder there); hint `zb`;
2. per-op jitter: each F and B of each (stage, micro-batch) scaled by a seeded factor uniform in
   [0.5, 1.5] (mean 1), new every iteration; hint `zb`;
3. PipeMorph §7.2 dynamic delays on link 1 (N(30, 10) ms, redrawn every U(50, 100) ms); hint
   `adaptive` with the control loop on;
4. a static 30 ms delay on link 1; `adaptive` with the control loop on;
5. no variation; hint `zb`.

Per-op times come from ``plan.variation`` tables (``testing.vary_inject`` makes the engine's ops
last them); the readiness replay (``plan.ready``) of the same tables predicts workloads 1, 2 and 5.
Iteration time: from a barrier before ``train_batch`` to a barrier after it, on rank 0; the mean
over the measured iterations. The dispatch cost per op is the time ready dispatch spends choosing
the next op (``engine.choosing_ns``) over the ops it ran; "ops ahead of the hint" counts, per
stage, the ops of the last iteration that ready dispatch started while an op earlier in the hint
was still to run. Prints a table and writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/ready_dispatch.py [--iters 10] [--stages 4] [--microbatches 12]
        [--workloads heavy,jitter,dynamic,static,none] [--out out/ready_dispatch.json]

(re-launches itself with ``torchrun --standalone --nproc_per_node STAGES`` when not started by torchrun).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _util import print_table, relaunch, write_json

STAGES, MICROBATCHES, OP_MS = 4, 12, 10.0
SLOW_LINK, DELAY_MS = 1, 30.0
WORKLOADS = ("heavy", "jitter", "dynamic", "static", "none")
TARGET_SPEEDUP = 1.10  # ready over ordered on heavy and jitter (and dynamic, with adaptive)
TARGET_PREDICTION = 0.10  # engine within 10 % of the readiness replay
TARGET_STILL = 0.02  # ready within 2 % of ordered when nothing varies


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10, help="measured iterations per run")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured iterations per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/ready_dispatch.json")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="a comma-separated subset of " + ",".join(WORKLOADS))
    ap.add_argument("--stages", type=int, default=STAGES, help="pipeline stages (one rank each)")
    ap.add_argument("--microbatches", type=int, default=MICROBATCHES)
    args = ap.parse_args()
    if args.stages <= SLOW_LINK + 1 or args.microbatches < args.stages:
        ap.error(f"--stages should be at least {SLOW_LINK + 2} (link {SLOW_LINK} is slowed) "
                 "and --microbatches at least --stages")
    return args


def tables(workload: str, seed: int):
    """(iteration -> OpTable, the emulated stage's own F/B/W ms: the table's smallest)."""
    from ds_pipemorph.plan.profile import Costs
    from ds_pipemorph.plan.variation import OpTable, heavy, jitter

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


def run_one(workload: str, dispatch: str, args, trace: str) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.testing.emulated import EmulatedStage
    from ds_pipemorph.testing.vary_inject import install

    table_of, base = tables(workload, args.seed)
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, *base) for _ in range(STAGES)], num_stages=STAGES,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICROBATCHES,
           "train_batch_size": MICROBATCHES, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9, "pipemorph": section(workload, dispatch, trace)}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    install(engine, table_of)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(MICROBATCHES)]
    seconds, choosing, ops = [], 0, 0
    for k in range(args.warmup + args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(iter(data))
        dist.barrier()
        if k >= args.warmup:
            seconds.append(time.perf_counter() - t0)
            if engine.choosing_ns:
                choosing += engine.choosing_ns[-1]
                ops += 3 * MICROBATCHES
    plans = [[str(op) for op in row] for row in engine.plan]
    ran = [r.op for r in engine.op_records if r.op[:1] in "FBW" and r.op[1:].isdigit()]
    position = {str(op): i for i, op in enumerate(engine.stage_plan)}
    departed, pending = 0, sorted(position.values())
    for op in ran:  # ops of the last iteration started while an op earlier in the hint was still to run
        departed += position[op] > pending[0]
        pending.remove(position[op])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, departed)
    if engine.inbox is not None:
        engine.inbox.close()
    engine.transport.close()
    if engine.adapter is not None:
        engine.adapter.close()
    return {"seconds": seconds, "choosing_ns": choosing, "ops": ops, "plan": plans, "departed": gathered}


def predict(workload: str, plan_text, dispatch: str, args) -> float:
    """Mean over the measured iterations of the replay of that iteration's table."""
    from ds_pipemorph.plan.profile import Costs
    from ds_pipemorph.plan.ready import replay_varying
    from ds_pipemorph.plan.simulate import peak_inflight
    from ds_pipemorph.plan.validate import parse_schedule

    plan = parse_schedule(plan_text)
    table_of, _ = tables(workload, args.seed)
    costs = Costs.uniform(STAGES, OP_MS)
    caps = peak_inflight(plan)
    ks = range(args.warmup, args.warmup + args.iters)
    return statistics.mean(replay_varying(plan, costs, MICROBATCHES, dispatch, caps, table_of(k)).iteration_ms
                           for k in ks)


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
        duration = 3.0 * (args.warmup + args.iters) * 0.8 + 30
        text = trace_text(make_trace(STAGES - 1, [SLOW_LINK], duration, RATES["A"], seed=args.seed), "§7.2 rate A")
        Path(trace).write_text(text)
    dist.barrier()
    results = {}
    for workload in args.workloads.split(","):
        for dispatch in ("ordered", "ready"):
            results[(workload, dispatch)] = run_one(workload, dispatch, args, trace)
            dist.barrier()
    if rank == 0:
        report(results, args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(results: dict, args) -> None:
    rows, out = [], []
    for w in args.workloads.split(","):
        o, r = results[(w, "ordered")], results[(w, "ready")]
        o_ms, r_ms = 1e3 * statistics.mean(o["seconds"]), 1e3 * statistics.mean(r["seconds"])
        pred = {d: predict(w, results[(w, d)]["plan"], d, args) for d in ("ordered", "ready")} \
            if w in ("heavy", "jitter", "none") else None
        cost_us = r["choosing_ns"] / r["ops"] / 1e3 if r["ops"] else None
        speedup = o_ms / r_ms
        row = {"workload": w, "ordered_ms": o_ms, "ready_ms": r_ms, "speedup": speedup,
               "predicted_ms": pred, "ready_over_predicted": (r_ms / pred["ready"]) if pred else None,
               "choosing_us_per_op": cost_us, "departed_per_stage": r["departed"],
               "ordered_s": o["seconds"], "ready_s": r["seconds"]}
        if w in ("heavy", "jitter", "dynamic"):
            row["target"] = f"ready >= {TARGET_SPEEDUP:.2f}x ordered"
            row["met"] = speedup >= TARGET_SPEEDUP and (pred is None or abs(r_ms / pred["ready"] - 1) <= TARGET_PREDICTION)
        else:
            row["target"] = f"ready within {TARGET_STILL:.0%} of ordered"
            row["met"] = r_ms <= o_ms * (1 + TARGET_STILL)
        out.append(row)
        rows.append([w, f"{o_ms:.1f}", f"{r_ms:.1f}", f"{speedup:.3f}x",
                     f"{pred['ordered']:.1f} / {pred['ready']:.1f}" if pred else "-",
                     f"{r_ms / pred['ready']:.3f}" if pred else "-",
                     f"{cost_us:.1f}" if cost_us is not None else "-", ",".join(map(str, r["departed"])),
                     "yes" if row["met"] else "NO"])
    print_table(f"ready vs ordered dispatch, {STAGES} stages x {MICROBATCHES} micro-batches, "
                f"mean of {args.iters} iterations (after {args.warmup})",
                ["workload", "ordered ms", "ready ms", "ordered / ready", "replay ordered / ready ms",
                 "ready / its replay", "choosing us/op", "ops ahead of the hint per stage", "target met"], rows)
    write_json(args.out, {"benchmark": "ready_dispatch", "stages": STAGES, "microbatches": MICROBATCHES,
                          "op_ms": OP_MS, "iters": args.iters, "warmup": args.warmup, "seed": args.seed,
                          "results": out})


if __name__ == "__main__":
    sys.exit(main())
