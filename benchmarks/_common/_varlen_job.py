"""One job of benchmarks/engine/varlen_real.py: stock DeepSpeed and our engine, one after the other,
on the same per-iteration micro-batches of ``recipes/gpt/varlen.py``.

    torchrun --nproc_per_node S benchmarks/_common/_varlen_job.py --workload multimodal --rows stock,zb,1f1b \
        --out OUT.json [--micro-batches 8 --batch 8 --seq 64 --d-model 128 --blocks 4 --warmup 2 --iterations 12]

Rows: ``stock`` is ``deepspeed.initialize`` (1F1B, fused backward); ``zb`` and ``1f1b`` are our engine
with that plan as the hint of ready dispatch (B) and ``pipemorph.compare`` set to the same plan
under ordered dispatch (A): the engine alternates the two at iteration boundaries (``A B A' B``).
Every row trains ``warmup + iterations`` iterations from the same seed on iteration k's batches;
an iteration's time is from a barrier before ``train_batch`` to the last rank's return. Of our
rows each rank keeps every op's start and end (``op_records``). Rank 0 writes the JSON: per row the
times, the side of each iteration (ours), the engine's own comparison and per iteration each op's
measured ms as ``[stage, kind, mb, ms]``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "gpt"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_pipemorph  # noqa: E402
from ds_pipemorph.plan.ir.ops import recorded_op  # noqa: E402
import varlen  # noqa: E402


def config(row: str, args) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.micro_batches,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}
    if row != "stock":
        cfg["pipemorph"] = {"schedule": row, "dispatch": "ready", "delegation": {"mode": "off"},
                            "adapt": {"enabled": False}, "nvtx": False, "memory": {"budget": args.budget},
                            "compare": {"schedule": row, "dispatch": "ordered", "warmup": args.warmup}}
    return cfg


def op_ms(records, stage: int) -> list:
    out = []
    for r in records:
        op = recorded_op(r.op)
        if op is not None and op.kind.is_compute:
            out.append([stage, op.kind.value, op.mb, (r.end_ns - r.start_ns) / 1e6])
    return out


def run_row(row: str, args, batches) -> dict:
    torch.manual_seed(0)
    module = varlen.model(args.workload, dist.get_world_size(), args.seq, args.d_model, args.heads, args.blocks)
    cfg = config(row, args)
    init = deepspeed.initialize if row == "stock" else ds_pipemorph.initialize
    engine, *_ = init(model=module, model_parameters=module.parameters(), config=cfg)
    times, ops, losses = [], [], []
    for k in range(args.warmup + args.iterations):
        data = batches.of(k)
        dist.barrier()
        t0 = time.monotonic_ns()
        loss = engine.train_batch(iter(data))
        span = torch.tensor([-t0, time.monotonic_ns()], dtype=torch.int64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        times.append((span[0].item() + span[1].item()) / 1e6)
        losses.append(float(loss))
        if row != "stock":
            ops.append(op_ms(engine.op_records, engine.stage_id))
    out = {"row": row, "times_ms": times, "losses": losses}
    if row != "stock":
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ops)
        out["ops"] = [sum((g[k] for g in gathered), []) for k in range(len(times))]
        out["sides"] = list(engine.compare.sides)
        result = engine.comparison()
        out["comparison"] = None if result is None else result.as_dict()
        out["plan"] = [[str(op) for op in stage] for stage in engine.plan]
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine
    gc.collect()
    dist.barrier()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=varlen.WORKLOADS, required=True)
    ap.add_argument("--rows", default="stock,zb,1f1b")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="windows per micro-batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    batches = varlen.Batches(args.workload, args.micro_batches, args.batch, args.seq)
    rows = [run_row(row, args, batches) for row in args.rows.split(",")]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"workload": args.workload, "ranks": dist.get_world_size(),
                                              "args": vars(args),
                                              "shapes": [batches.shapes(k) for k in range(args.warmup + args.iterations)],
                                              "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
