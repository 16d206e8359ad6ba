"""A real compute straggler: CPU burners on one stage's core, against the rebalance loop.

2 stages, one CPU rank each, each rank pinned to a core of its own (``os.sched_setaffinity``, every
thread of the rank) with one intra-op thread; the tiny_gpt recipe's model (embedding, 10
transformer blocks, head: real matmuls), 12 micro-batches of 4 x 32 tokens, the real engine
(``zb``). At iteration ``--burn-from`` (8), rank 1 starts ``--burners`` (3) CPU-burning processes
(``_burner.py``: busy loops at normal priority, pinned to stage 1's core, killed at the end of the
run and unable to outlive it) and they spin until the run ends. Nothing is injected: stage 1 is
slow because its core is shared.

Rows, each a fresh engine on the same data and seed:

- uniform: DeepSpeed's uniform partition throughout;
- rebalance: the same start with ``"rebalance": {"enabled": true}``;
- best static: the partition ``pipemorph partition`` chooses for the model's layer profile (measured
  by ``profiling.layers`` on rank 0, pinned, one thread, before the runs) under the per-stage
  slowdowns *measured in the uniform row* (each stage's F + B + W per micro-batch after the burners
  started over before), on a ``PartsPipelineModule`` from the start, same burners from the same
  iteration.

Per row: median iteration time (barrier to barrier on rank 0) before the burners (iterations 1 to
burn-from - 1) and after them (from burn-from + ``--settle``), each after-median over the uniform
row's with a 95 % bootstrap interval (two independent samples, ``scipy.stats.bootstrap``: the rows
run one after the other, so no pairing cancels the machine's drift between them), the stages'
measured slowdowns, the moves and the iteration the first one after the burners took effect.

Then the learned slowdown predictor (``control.interference.SlowdownModel``) is refitted on these
runs: one sample per stage and iteration, the features of an iteration (its op times over the
layer profile's, the rank's CPU share, the machine's load, a memcpy probe) against the stage's
slowdown in the next iteration; trained on the uniform and best static rows, tested on the held-out
rebalance row, against persistence (next = last), as ``interference_predictor.py`` does.

    DS_ACCELERATOR=cpu python benchmarks/real_straggler.py [--iters 24] [--burn-from 8] [--burners 3]
                       [--rows uniform,rebalance,best-static] [--no-predictor] [--out out/real_straggler.json]

(re-launches itself with ``torchrun --standalone --nproc_per_node 2``). The burners run at normal
priority: on a machine loaded with other, unpinned work, the kernel's load balancer moves some of
that work off the burners' core onto stage 0's, which then slows too; the measured stage slowdowns
say how much of a stage-1 straggler the burners made.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROWS = ("uniform", "rebalance", "best-static")
STAGES, SLOW_STAGE = 2, 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=24, help="iterations per row")
    ap.add_argument("--burn-from", type=int, default=8, help="iteration at which the burners start")
    ap.add_argument("--burners", type=int, default=3, help="CPU-burning processes on stage 1's core")
    ap.add_argument("--settle", type=int, default=2, help="iterations after burn-from left out of the after-median")
    ap.add_argument("--microbatches", type=int, default=12)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--no-predictor", action="store_true", help="skip refitting the learned slowdown predictor")
    ap.add_argument("--out", default="out/real_straggler.json")
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        ap.error(f"--rows takes a comma-separated list of {', '.join(ROWS)}, not {a.rows!r}")
    if "best-static" in rows and "uniform" not in rows:
        ap.error("--rows: best-static needs the uniform row (its slowdowns are measured there)")
    if not 2 <= a.burn_from < a.iters - a.settle - 1:
        ap.error("--burn-from must be at least 2 and leave at least two iterations after --settle")
    if a.burners < 1:
        ap.error("--burners must be at least 1")
    a.rows = [r for r in ROWS if r in rows]
    return a


# ---------------------------------------------------------------------------------------------
# the launcher


def launch(args) -> int:
    from _util import relaunch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < STAGES:
        print(f"this process may run on {len(cores)} core(s); the benchmark pins 2 stages to 2 cores", file=sys.stderr)
        return 2
    return relaunch(__file__, STAGES)


# ---------------------------------------------------------------------------------------------
# the ranks


def pin_threads(core: int) -> None:
    """Every thread of this process on ``core`` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


def model(microbatches: int):
    import torch
    from rebalance import GPT, GPT_BATCH, layers_of, loss_of

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "tiny_gpt"))  # tiny_gpt's model.py
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, GPT["vocab"], (GPT_BATCH, GPT["max_seq"] + 1), generator=g) for _ in range(microbatches)]
    return layers_of, [(w[:, :-1], w[:, 1:]) for w in ids], loss_of("gpt"), GPT_BATCH


def layer_profile(microbatches: int):
    """The model's layer profile, measured here (rank 0, pinned, one thread)."""
    from ds_pipemorph.plan.partition.layer_profile import LayerProfile
    from ds_pipemorph.profiling.layers import layer_profile_data, profile_layers

    layers_of, data, loss, _ = model(microbatches)
    costs, _ = profile_layers(layers_of("gpt"), data[0][0], data[0][1], loss, warmup=3, reps=7)
    data = layer_profile_data(costs, STAGES, microbatches)
    return LayerProfile.model_validate({"stages": STAGES, "microbatches": microbatches, "layers": data["layers"]})


def run_row(kind: str, parts, core: int, cores: list[int], args) -> dict:
    import torch
    import torch.distributed as dist
    from _burner import Burners
    from deepspeed.pipe import PipelineModule

    import ds_pipemorph
    from ds_pipemorph.control.interference import memcpy_probe_ms, read_host
    from ds_pipemorph.runtime.oprecords import fbw_ms_per_microbatch
    from ds_pipemorph.runtime.parts_module import PartsPipelineModule

    layers_of, data, loss, mbs = model(args.microbatches)
    torch.manual_seed(0)
    if kind == "best-static":
        module = PartsPipelineModule(layers_of("gpt"), parts, loss_fn=loss)
    else:
        module = PipelineModule(layers=layers_of("gpt"), num_stages=STAGES, loss_fn=loss, partition_method="uniform")
    pm = {"schedule": "zb", "delegation": {"mode": "off"}, "nvtx": False,
          "rebalance": {"enabled": kind == "rebalance"}}
    N = args.microbatches
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": N, "train_batch_size": mbs * N,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9, "pipemorph": pm}
    engine, *_ = ds_pipemorph.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    pin_threads(core)  # threads the engine started
    rank = dist.get_rank()
    burners = Burners(cores[SLOW_STAGE], args.burners)
    seconds, losses, iters = [], [], []
    probe_solo = statistics.median(memcpy_probe_ms() for _ in range(9))
    try:
        for it in range(args.iters):
            if it == args.burn_from and rank == SLOW_STAGE:
                burners.start()
            dist.barrier()
            t0 = time.perf_counter()
            layers = [engine.module._local_start, engine.module._local_stop]
            before = read_host()
            loss_value = engine.train_batch(iter(data))
            after = read_host()
            dist.barrier()
            seconds.append(time.perf_counter() - t0)
            losses.append(float(loss_value))
            records = engine.recorder.records
            ops = [(r.plan_op.kind.value, (r.end_ns - r.start_ns) / 1e6) for r in records
                   if r.plan_op is not None and r.plan_op.kind.is_compute]
            iters.append({"fbw": fbw_ms_per_microbatch(records, N), "ops": ops, "layers": layers,
                          "host": [list(vars_of(before)), list(vars_of(after))], "probe_ms": memcpy_probe_ms()})
    finally:
        burners.stop()
    events = list(engine.rebalance.events) if engine.rebalance is not None else []
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, iters)
    engine.transport.close()
    return {"seconds": seconds, "losses": losses, "parts": list(engine.module.parts), "events": events,
            "stages": per_rank, "probe_solo_ms": probe_solo}


def vars_of(counters) -> tuple:
    from dataclasses import astuple

    return astuple(counters)


def ranks_main(args) -> int:
    cores = sorted(os.sched_getaffinity(0))[:STAGES]
    core = cores[int(os.environ["LOCAL_RANK"])]
    pin_threads(core)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    pin_threads(core)
    rank = dist.get_rank()
    box = [layer_profile(args.microbatches) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    lp = box[0]
    results, best = {}, None
    for kind in args.rows:
        if kind == "best-static":
            from _straggler_report import measured_slowdowns

            from ds_pipemorph.plan.partition.partition import partition

            factors = measured_slowdowns(results["uniform"], lp, args)
            best = {"slowdown": factors, "parts": partition(lp, slowdown=factors).parts}
        dist.barrier()
        results[kind] = run_row(kind, best["parts"] if best else None, core, cores, args)
    if rank == 0:
        from _straggler_report import report

        report(results, best, lp, args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return launch(args)
    return ranks_main(args)


if __name__ == "__main__":
    sys.exit(main())
