"""One job of benchmarks/engine/varlen_real.py: stock DeepSpeed and our engine, alive side by side,
each iteration's micro-batches of ``recipes/gpt/varlen.py`` trained by each engine in turn.

    torchrun --nproc_per_node S benchmarks/_common/_varlen_job.py --workload multimodal --hint zb --out OUT.json \
        [--micro-batches 8 --batch 8 --seq 64 --d-model 128 --blocks 4 --warmup 2 --iterations 24]

Two engines are built from the same seed and kept: ``stock`` (``deepspeed.initialize``: 1F1B,
fused backward) and ours with the ``--hint`` plan as the hint of ready dispatch (B) and
``pipemorph.compare`` set to the same plan under ordered dispatch (A): ours alternates the two at
its iteration boundaries (``A B A' B``). Each draw of micro-batches is trained twice, by iterations
2j and 2j + 1, so each A, B pair of ours runs one draw (the A'/A check compares two draws, so it
holds the draws' variation as well as the machine's). Iteration k's batches go to each engine in turn, the
order alternating with each draw (iterations 2j and 2j + 1 keep it), so both times of iteration k
are taken within a second or two of each other on the same batches: what the machine's load does between jobs or minutes apart does not
enter a ratio. Both engines train every iteration (they stay equal: ours trains exactly as stock
does). Only one of our engines per job: with two alive in one process a job hung, both ranks
waiting for a message in ready dispatch's inbox (both engines receive on the same links). An iteration's time is from a barrier before ``train_batch`` to the
last rank's return. Of our engines each rank keeps every op's start and end (``op_records``); of
stock, the time of each forward and (fused) backward pass (``time_stock_ops``). Rank 0 writes the
JSON: per engine the times, losses, the side of each iteration (ours), the engine's own comparison
and per iteration each op's measured ms as ``[stage, kind, mb, ms]`` (stock's kinds: F and BW).
"""
from __future__ import annotations

import argparse
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
from ds_pipemorph.runtime.shutdown import release_process_groups  # noqa: E402
import varlen  # noqa: E402



def config(row: str, args) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.micro_batches,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}
    if row != "stock":
        cfg["pipemorph"] = {"schedule": row, "backward": args.backward, "dispatch": "ready", "delegation": {"mode": "off"},
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


def time_stock_ops(engine) -> list:
    """Time stock's forward and (fused) backward passes on this engine only: a list that gets
    ``[stage, "F" or "BW", mb, ms]`` per pass (its k-th forward and k-th backward of an iteration
    are micro-batch k: 1F1B keeps the micro-batches' order). Cleared by the caller per iteration."""
    from deepspeed.runtime.pipe import schedule

    done = []
    table = dict(engine._INSTRUCTION_MAP)
    for instr, kind in ((schedule.ForwardPass, "F"), (schedule.BackwardPass, "BW")):
        def run(self, *a, _fn=table[instr], _kind=kind, **kw):
            t = time.perf_counter_ns()
            try:
                return _fn(self, *a, **kw)
            finally:
                n = sum(1 for d in done if d[1] == _kind)
                done.append([self.stage_id, _kind, n, (time.perf_counter_ns() - t) / 1e6])
        table[instr] = run
    engine._INSTRUCTION_MAP = table  # this instance's map: the class's stays as it is
    return done


def build(row: str, args):
    torch.manual_seed(0)
    module = varlen.model(args.workload, dist.get_world_size(), args.seq, args.d_model, args.heads, args.blocks)
    init = deepspeed.initialize if row == "stock" else ds_pipemorph.initialize
    engine, *_ = init(model=module, model_parameters=module.parameters(), config=config(row, args))
    return engine


def timed(engine, data) -> tuple[float, float]:
    """One ``train_batch``: (ms from a barrier to the last rank's return, the loss)."""
    dist.barrier()
    t0 = time.monotonic_ns()
    loss = engine.train_batch(iter(data))
    span = torch.tensor([-t0, time.monotonic_ns()], dtype=torch.int64)
    dist.all_reduce(span, op=dist.ReduceOp.MAX)
    return (span[0].item() + span[1].item()) / 1e6, float(loss)


def run(args, batches) -> list[dict]:
    ROWS = ["stock", args.hint]
    engines = {row: build(row, args) for row in ROWS}
    out = {row: {"row": row, "times_ms": [], "losses": [], "first": [], "lengths": []} for row in ROWS}
    ops = {row: [] for row in ROWS}
    stock_ops = time_stock_ops(engines["stock"])
    for k in range(args.warmup + args.iterations):
        # Iterations 2j and 2j + 1 train the same draw: with an even warm-up they are one A, B pair of
        # ours (``pipemorph.compare`` pairs iteration i with i - 1), so ready / ordered compares the two
        # dispatches on the same micro-batches, as stock / row does per iteration.
        # Which engine goes first alternates with each draw, so both runs of a draw keep the order: stock's
        # second run of a draw over its first then differs from its first as ours' B from its A (by
        # running the draw again), not by its place in the iteration besides.
        data = batches.of(k // 2)
        j = (k // 2) % len(ROWS)
        order = ROWS[j:] + ROWS[:j]
        for row in order:
            ms, loss = timed(engines[row], data)
            out[row]["times_ms"].append(ms)
            out[row]["losses"].append(loss)
            out[row]["first"].append(order.index(row))
            out[row]["lengths"].append([x.shape[1] for x, _ in data])  # what this engine trained
            if row == "stock":
                ops[row].append(list(stock_ops))
                stock_ops.clear()
            else:
                ops[row].append(op_ms(engines[row].op_records, engines[row].stage_id))
    for row, engine in engines.items():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ops[row])
        out[row]["ops"] = [sum((g[k] for g in gathered), []) for k in range(len(out[row]["times_ms"]))]
        if row != "stock":
            out[row]["sides"] = list(engine.compare.sides)
            result = engine.comparison()
            out[row]["comparison"] = None if result is None else result.as_dict()
            out[row]["plan"] = [[str(op) for op in stage] for stage in engine.plan]
            out[row]["backward"] = args.backward
        if hasattr(engine, "destroy"):
            engine.destroy()
    return [out[row] for row in ROWS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=varlen.WORKLOADS, required=True)
    ap.add_argument("--hint", choices=("zb", "1f1b"), required=True, help="our engine's plan")
    ap.add_argument("--backward", choices=("split", "fused"), default="split",
                    help="our engine's pipemorph.backward (fused: a B directly followed by its W is one pass)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="windows per micro-batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.warmup % 2:
        ap.error(f"--warmup {args.warmup}: use an even number (each draw of micro-batches is one A, B pair)")
    deepspeed.init_distributed(dist_backend="gloo")
    batches = varlen.Batches(args.workload, args.micro_batches, args.batch, args.seq)
    rows = run(args, batches)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"workload": args.workload, "ranks": dist.get_world_size(),
                                              "args": vars(args),
                                              "shapes": [batches.shapes(k // 2) for k in range(args.warmup + args.iterations)],
                                              "rows": rows}))
    release_process_groups()  # before the interpreter's exit tears gloo's threads down (the stock engine too)
    return 0


if __name__ == "__main__":
    sys.exit(main())
