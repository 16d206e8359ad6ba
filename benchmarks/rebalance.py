"""Compute straggler: the rebalance loop against the uniform partition and the best static one.

4 stages (``--stages``), 12 micro-batches, one CPU rank per stage, the real engine (``zb``). Stage 1 is slowed 2x from
iteration 5 on (``inject.compute_trace``: each of its F, B and W waits once more its own time). Per
model, three runs side by side:

- uniform: DeepSpeed's uniform partition throughout (what a job without the loop keeps);
- rebalance: the same start with ``"rebalance": {"enabled": true}``: the loop learns what each
  layer costs in the first iterations, detects the slowdown, moves layers at an iteration boundary
  and re-plans;
- best static: the partition ``pipemorph partition --slowdown 1=2`` chooses for the model's layer
  profile (a ``PartsPipelineModule`` on it from the start, same slowdown from iteration 5).

Models: ``emulated`` (16 emulated layers, F = B = W = 2.5 ms each around tiny real math: the
layer profile is exact) and ``gpt`` (the tiny_gpt recipe with 10 blocks, real compute; its layer
profile measured by ``profiling.layers`` on rank 0 before the runs). Iteration time: barrier to
barrier on rank 0; reported: the median of the iterations after ``--settle`` slowed ones (two
shared cores give single iterations of any run spikes of up to 1.7x; the means are in the JSON), the
iteration from which the new partition ran, the migration's time and bytes (all ranks).

    DS_ACCELERATOR=cpu python benchmarks/rebalance.py [--models emulated,gpt] [--stages 4] [--iters 18]

(re-launches itself with ``torchrun --standalone --nproc_per_node STAGES`` when not started by
torchrun). With real compute, four ranks on a two-core machine share the cores: a stage that waits
(the injected slowdown) lends its core to the others, so stage times move with what the other
stages do; ``--stages 2`` gives each rank a core.
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

MICROBATCHES, SLOW_STAGE, FACTOR, SLOW_FROM = 12, 1, 2.0, 5
EMULATED_LAYERS, LAYER_MS = 16, 2.5
GPT = {"vocab": 64, "d_model": 128, "heads": 4, "blocks": 10, "max_seq": 32}
GPT_BATCH = 4
TARGET_BEST, TARGET_UNIFORM, TARGET_ITERS = 1.10, 1.3, 3


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="emulated,gpt")
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages, one CPU rank each (2 or more)")
    ap.add_argument("--iters", type=int, default=18, help="iterations per run (the slowdown starts at 5)")
    ap.add_argument("--settle", type=int, default=4, help="slowed iterations left out before measuring")
    ap.add_argument("--out", default="out/rebalance.json")
    return ap.parse_args()


def layers_of(model: str) -> list:
    import torch
    from deepspeed.pipe import LayerSpec

    if model == "emulated":
        from ds_pipemorph.testing.emulated import EmulatedStage

        return [LayerSpec(EmulatedStage, 8, LAYER_MS, LAYER_MS, LAYER_MS) for _ in range(EMULATED_LAYERS)]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "tiny_gpt"))
    from model import Block, Embedding, Head

    torch.manual_seed(0)
    return ([LayerSpec(Embedding, GPT["vocab"], GPT["d_model"], GPT["max_seq"])]
            + [LayerSpec(Block, GPT["d_model"], GPT["heads"]) for _ in range(GPT["blocks"])]
            + [LayerSpec(Head, GPT["vocab"], GPT["d_model"])])


def data_of(model: str) -> list:
    import torch

    g = torch.Generator().manual_seed(1)
    if model == "emulated":
        return [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(MICROBATCHES)]
    ids = [torch.randint(0, GPT["vocab"], (GPT_BATCH, GPT["max_seq"] + 1), generator=g) for _ in range(MICROBATCHES)]
    return [(w[:, :-1], w[:, 1:]) for w in ids]


def loss_of(model: str):
    import torch

    if model == "emulated":
        return torch.nn.MSELoss()
    from model import next_token_loss

    return next_token_loss


def best_static(model: str, stages: int) -> tuple[list[int], dict]:
    """What ``pipemorph partition --slowdown 1=2`` chooses for the model's layer profile (rank 0)."""
    from ds_pipemorph.plan.layer_profile import LayerProfile
    from ds_pipemorph.plan.partition import partition

    slow = [FACTOR if s == SLOW_STAGE else 1.0 for s in range(stages)]
    if model == "emulated":
        layers = {"forward_ms": [LAYER_MS] * EMULATED_LAYERS, "backward_input_ms": LAYER_MS,
                  "backward_weight_ms": LAYER_MS}
    else:
        import torch

        from ds_pipemorph.profiling.layers import layer_profile_data, profile_layers

        x, y = data_of(model)[0]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank runs
        try:
            costs, _ = profile_layers(layers_of(model), x, y, loss_of(model), warmup=3, reps=7)
        finally:
            torch.set_num_threads(threads)
        layers = layer_profile_data(costs, stages, MICROBATCHES)["layers"]
    lp = LayerProfile.model_validate({"stages": stages, "microbatches": MICROBATCHES, "layers": layers})
    res = partition(lp, slowdown=slow)
    return res.parts, {"forward_ms": [round(v, 3) for v in lp.layers.forward_ms],
                       "search_ms": round(res.iteration_ms, 2)}


def run_one(model: str, kind: str, parts, trace: str, args) -> dict:
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import ds_pipemorph
    from ds_pipemorph.runtime.partition_hook import PartsPipelineModule

    torch.manual_seed(0)
    layers = layers_of(model)
    if kind == "best static":
        module = PartsPipelineModule(layers, parts, loss_fn=loss_of(model))
    else:
        module = PipelineModule(layers=layers, num_stages=args.stages, loss_fn=loss_of(model),
                                partition_method="uniform")
    pm = {"schedule": "zb", "delegation": {"mode": "off"}, "nvtx": False, "inject": {"compute_trace": trace},
          "rebalance": {"enabled": kind == "rebalance"}}
    mbs = 1 if model == "emulated" else GPT_BATCH
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": MICROBATCHES,
           "train_batch_size": mbs * MICROBATCHES, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9, "pipemorph": pm}
    engine, *_ = ds_pipemorph.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    data = data_of(model)
    seconds = []
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(iter(data))
        dist.barrier()
        seconds.append(time.perf_counter() - t0)
    events = list(engine.rebalance.events) if engine.rebalance is not None else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(e["bytes_sent"], e["seconds"]) for e in events])
    engine.transport.close()
    return {"seconds": seconds, "parts": list(engine.module.parts), "events": events, "per_rank": gathered}


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return relaunch(__file__, args.stages)
    import deepspeed
    import torch.distributed as dist
    import yaml

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    trace = os.path.join(tempfile.gettempdir(), f"pipemorph-rebalance-trace-{os.getppid()}.yaml")
    if rank == 0:
        Path(trace).write_text(yaml.safe_dump({"points": [{"iteration": SLOW_FROM,
                                                            "factors": {str(SLOW_STAGE): FACTOR}}]}))
    results = {}
    for model in args.models.split(","):
        box = [best_static(model, args.stages) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        parts, profile = box[0]
        results[model] = {"best_parts": parts, "profile": profile}
        for kind in ("uniform", "rebalance", "best static"):
            dist.barrier()
            results[model][kind] = run_one(model, kind, parts, trace, args)
    if rank == 0:
        report(results, args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(results: dict, args) -> None:
    rows, out = [], []
    first = SLOW_FROM + args.settle
    for model, res in results.items():
        kinds = ("uniform", "rebalance", "best static")
        ms = {k: 1e3 * statistics.median(res[k]["seconds"][first:]) for k in kinds}
        means = {k: 1e3 * statistics.mean(res[k]["seconds"][first:]) for k in kinds}
        healthy = 1e3 * statistics.median(res["uniform"]["seconds"][2:SLOW_FROM])
        events = res["rebalance"]["events"]
        ok = [e for e in events if e["ok"]]
        after = [e for e in ok if e["iteration"] + 1 > SLOW_FROM]  # a move before it answered noise
        from_iter = after[0]["iteration"] + 1 if after else None
        moved_bytes = sum(b for rank in res["rebalance"]["per_rank"] for b, _ in rank[:1])
        mig_ms = 1e3 * max((s for rank in res["rebalance"]["per_rank"] for _, s in rank[:1]), default=0.0)
        vs_best, vs_uniform = ms["rebalance"] / ms["best static"], ms["uniform"] / ms["rebalance"]
        met = (from_iter is not None and from_iter - SLOW_FROM <= TARGET_ITERS and vs_best <= TARGET_BEST
               and vs_uniform >= TARGET_UNIFORM)
        row = {"model": model, "healthy_ms": healthy, "uniform_ms": ms["uniform"], "rebalance_ms": ms["rebalance"],
               "best_static_ms": ms["best static"], "means_ms": means, "rebalance_over_best": vs_best, "uniform_over_rebalance": vs_uniform,
               "best_parts": res["best_parts"], "rebalance_parts": res["rebalance"]["parts"],
               "new_partition_from_iteration": from_iter, "migration_ms": mig_ms, "migration_bytes": moved_bytes,
               "events": events, "profile": res["profile"],
               "seconds": {k: res[k]["seconds"] for k in ("uniform", "rebalance", "best static")}, "met": met}
        out.append(row)
        rows.append([model, f"{healthy:.0f}", f"{ms['uniform']:.0f}", f"{ms['rebalance']:.0f}",
                     f"{ms['best static']:.0f}", f"{vs_best:.3f}", f"{vs_uniform:.2f}x",
                     str(res["rebalance"]["parts"]), str(res["best_parts"]),
                     ("-" if from_iter is None else f"{from_iter} (+{from_iter - SLOW_FROM})") + f", {len(ok)} moves",
                     f"{mig_ms:.0f} ms, {moved_bytes / 1e3:.0f} kB", "yes" if met else "NO"])
    print_table(f"stage {SLOW_STAGE} slowed {FACTOR:g}x from iteration {SLOW_FROM}: {args.stages} stages x {MICROBATCHES} "
                f"micro-batches, median of iterations {first}-{args.iters - 1} (ms)",
                ["model", "healthy", "uniform", "rebalance", "best static", "rebalance / best",
                 "uniform / rebalance", "rebalance parts", "best parts", "moved from iteration", "migration",
                 "target met"], rows)
    write_json(args.out, {"benchmark": "rebalance", "stages": args.stages, "microbatches": MICROBATCHES,
                          "slow_stage": SLOW_STAGE, "factor": FACTOR, "slow_from": SLOW_FROM, "iters": args.iters,
                          "settle": args.settle, "gpt": GPT, "results": out})


if __name__ == "__main__":
    sys.exit(main())
