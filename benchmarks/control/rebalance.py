"""Compute straggler: the rebalance loop against the best static partition and the uniform one, paired.

One CPU rank per stage (``--stages``, 4 by default; ``--stages 2`` gives each rank a core), 12
micro-batches, the real engine (``zb``). Stage 1 is slowed 2x from iteration 5 on
(``inject.compute_trace``: each of its F, B and W waits once more its own time; ``--slow-from 0``:
from the first iteration, a stage slow before training began, so the loop learns the layers' costs
on the slowed stages and must tell the slow one by comparing stages). Two paired
comparisons per model (``ds_pipemorph.paired``: the cycle ``A B A' B``, the median of the
per-pair ratios B/A with a bootstrap 95 % interval, the A/A noise check, and "no difference
measurable here" when the interval holds 1):

- rebalance / best static, whole runs alternating: each run a fresh engine in the same ranks,
  ``A`` the partition ``pipemorph partition --slowdown 1=2`` chooses for the model's layer
  profile (a ``PartsPipelineModule`` on it from the start), ``B`` DeepSpeed's uniform partition
  with ``"rebalance": {"enabled": true}`` (the loop learns what each layer costs, detects the
  slowdown, moves layers at an iteration boundary and re-plans). A run's sample is the median of
  its iterations after ``--settle`` slowed ones. Two engines cannot share iterations, so whole
  runs alternate; each pair is two runs back to back;
- uniform / rebalance, one job: a rebalancing engine runs until its loop has moved layers after
  the slowdown, the loop is then stopped, and ``A`` (the partition the loop chose, with its plan)
  and ``B`` (the uniform partition, restored by a migration back, with its plan) alternate every
  iteration, each switch a live migration at the iteration boundary, outside the timed span
  (a barrier before ``train_batch`` to the last rank's return).

Models: ``emulated`` (16 emulated layers, F = B = W = 2.5 ms each around tiny real math: the layer
profile is exact) and ``gpt`` (the tiny_gpt recipe with 10 blocks, real compute; its layer profile
measured by ``profiling.layers`` on rank 0 first). Also reported: the iteration from which the
loop's partition ran, its migration's time and bytes, and its cut against the best static one.
Prints a table and writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/control/rebalance.py [--models emulated,gpt] [--stages 4] [--run-pairs 6]
        [--iters 18] [--settle 4] [--pairs 12] [--warmup 4] [--slow-from 5] [--out out/rebalance.json]

(re-launches itself with ``torchrun --standalone --nproc_per_node STAGES`` when not started by
torchrun). With real compute, four ranks on a two-core machine share the cores: a stage that waits
(the injected slowdown) lends its core to the others, so stage times move with what the other
stages do.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, relaunch, write_json

MICROBATCHES, SLOW_STAGE, FACTOR = 12, 1, 2.0
# The loop's own start: the first iteration (start-up) and ``rebalance.warmup_iterations`` (2 by
# default) learn the layers' costs, so a slowdown there can be acted on only after them.
LEARNED_BY = 3
EMULATED_LAYERS, LAYER_MS = 16, 2.5
GPT = {"vocab": 64, "d_model": 128, "heads": 4, "blocks": 10, "max_seq": 32}
GPT_BATCH = 4
TARGET_BEST, TARGET_UNIFORM, TARGET_ITERS = 1.10, 1.3, 3


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="emulated,gpt")
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages, one CPU rank each (2 or more)")
    ap.add_argument("--pairs", type=int, default=12, help="B/A pairs of the one-job comparison (A/A pairs: half as many)")
    ap.add_argument("--run-pairs", type=int, default=6, help="B/A pairs of whole runs (two runs each)")
    ap.add_argument("--iters", type=int, default=18, help="iterations per whole run (the slowdown starts at 5)")
    ap.add_argument("--settle", type=int, default=4, help="slowed iterations of a run left out before measuring")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured alternating iterations of the one-job comparison")
    ap.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    ap.add_argument("--slow-from", type=int, default=5, help="iteration from which stage 1 is slowed (0: the first)")
    ap.add_argument("--out", default="out/rebalance.json")
    args = ap.parse_args()
    if args.slow_from < 0:
        ap.error("--slow-from must be 0 or more")
    if args.iters <= args.slow_from + args.settle:
        ap.error(f"--iters must exceed --slow-from ({args.slow_from}) + --settle: a run measures the iterations after both")
    return args


def layers_of(model: str) -> list:
    import torch
    from deepspeed.pipe import LayerSpec

    if model == "emulated":
        from ds_pipemorph.inject.emulated import EmulatedStage

        return [LayerSpec(EmulatedStage, 8, LAYER_MS, LAYER_MS, LAYER_MS) for _ in range(EMULATED_LAYERS)]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_gpt"))
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
    from ds_pipemorph.plan.partition.layer_profile import LayerProfile
    from ds_pipemorph.plan.partition.partition import partition

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


def build(model: str, kind: str, parts, trace: str, stages: int):
    """A fresh engine: ``best static`` on ``parts`` from the start, or ``rebalance`` from uniform."""
    import torch
    from deepspeed.pipe import PipelineModule

    import ds_pipemorph
    from ds_pipemorph.runtime.parts_module import PartsPipelineModule

    torch.manual_seed(0)
    layers = layers_of(model)
    if kind == "best static":
        module = PartsPipelineModule(layers, parts, loss_fn=loss_of(model))
    else:
        module = PipelineModule(layers=layers, num_stages=stages, loss_fn=loss_of(model), partition_method="uniform")
    pm = {"schedule": "zb", "delegation": {"mode": "off"}, "nvtx": False, "inject": {"compute_trace": trace},
          "rebalance": {"enabled": kind == "rebalance"}}
    mbs = 1 if model == "emulated" else GPT_BATCH
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": MICROBATCHES,
           "train_batch_size": mbs * MICROBATCHES, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9, "pipemorph": pm}
    engine, *_ = ds_pipemorph.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    return engine


def loop_moves(engine, slow_from: int) -> list[dict]:
    """The rebalance loop's successful moves after the slowdown (a move before it answered noise)."""
    events = engine.rebalance.events if engine.rebalance is not None else []
    return [e for e in events if e["ok"] and e["iteration"] + 1 > slow_from]


def whole_run(model: str, kind: str, parts, trace: str, args) -> dict:
    """One whole run of a fresh engine: every iteration's ms (barrier to the last rank's return), its
    sample (the median after the slowdown and ``--settle``), its final partition and the loop's moves."""
    import torch.distributed as dist

    from ds_pipemorph.bench.paired_worker import timed_step

    engine = build(model, kind, parts, trace, args.stages)
    data = data_of(model)
    ms = [timed_step(lambda: engine.train_batch(iter(data))) for _ in range(args.iters)]
    moves = loop_moves(engine, args.slow_from) if kind == "rebalance" else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(e["bytes_sent"], e["seconds"]) for e in moves[:1]])
    engine.transport.close()
    return {"kind": kind, "ms": statistics.median(ms[args.slow_from + args.settle:]), "iterations_ms": ms,
            "parts": list(engine.module.parts), "moves": moves,
            "first_move_bytes": sum(b for rank in gathered for b, _ in rank),
            "first_move_ms": 1e3 * max((s for rank in gathered for _, s in rank), default=0.0)}


def migration_alternation(model: str, trace: str, args) -> dict:
    """Uniform (B) against the loop's partition (A) in one job: the loop moves layers once the slowdown
    is detected, then it stops and every iteration migrates to its side's partition and plan."""
    from ds_pipemorph.paired import A_SIDE, cycles_for, sequence
    from ds_pipemorph.bench.paired_worker import timed_step

    engine = build(model, "rebalance", None, trace, args.stages)
    data = data_of(model)
    uniform = (list(engine.module.parts), engine.plan)
    before = []
    while not loop_moves(engine, args.slow_from) and len(before) < args.iters:
        before.append(timed_step(lambda: engine.train_batch(iter(data))))
    moves = loop_moves(engine, args.slow_from)
    if not moves:
        engine.transport.close()
        return {"error": f"the loop did not move layers within {args.iters} iterations", "before_ms": before}
    engine.rebalance = None  # from here on, only the alternation moves layers
    moved = (list(engine.module.parts), engine.plan)
    sides = sequence(args.warmup + 4 * cycles_for(args.pairs), args.warmup)
    rows, migrations = [], []
    for label in sides:
        parts, plan = moved if label in A_SIDE else uniform
        if list(engine.module.parts) != parts:
            t = time.perf_counter()
            report = engine.repartition(parts)
            if not report.ok:
                raise RuntimeError(f"the migration to {parts} failed: {report.describe()}")
            migrations.append(time.perf_counter() - t)
        engine.switch_to(plan=plan)
        rows.append({"side": label, "parts": parts,
                     "ms": timed_step(lambda: engine.train_batch(iter(data)))})
    engine.transport.close()
    return {"before_ms": before, "moves": moves, "uniform_parts": uniform[0], "loop_parts": moved[0],
            "iterations": rows, "migrations": len(migrations),
            "migration_ms_median": 1e3 * statistics.median(migrations) if migrations else None}


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return relaunch(__file__, args.stages)
    import deepspeed
    import torch.distributed as dist
    import yaml

    from ds_pipemorph.paired import A_SIDE, cycles_for, sequence

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    trace = os.path.join(tempfile.gettempdir(), f"pipemorph-rebalance-trace-{os.getppid()}.yaml")
    if rank == 0:
        Path(trace).write_text(yaml.safe_dump({"points": [{"iteration": args.slow_from,
                                                            "factors": {str(SLOW_STAGE): FACTOR}}]}))
    results = {}
    for model in args.models.split(","):
        box = [best_static(model, args.stages) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        parts, profile = box[0]
        runs = []
        for k, label in enumerate(sequence(4 * cycles_for(args.run_pairs))):
            dist.barrier()
            runs.append({"side": label, **whole_run(model, "best static" if label in A_SIDE else "rebalance",
                                                    parts, trace, args)})
            if rank == 0:
                print(f"{model}: run {k + 1} ({runs[-1]['kind']}): {runs[-1]['ms']:.1f} ms", flush=True)
        dist.barrier()
        results[model] = {"best_parts": parts, "profile": profile, "runs": runs,
                          "migration_alternation": migration_alternation(model, trace, args)}
    if rank == 0:
        report(results, args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(results: dict, args) -> None:
    from ds_pipemorph.paired import compare

    rows, verdicts, out = [], [], []
    for model, res in results.items():
        runs = res["runs"]
        whole = compare([r["side"] for r in runs], [r["ms"] for r in runs], 0, seed=args.seed)
        reb = [r for r in runs if r["kind"] == "rebalance"]
        starts = [r["moves"][0]["iteration"] + 1 for r in reb if r["moves"]]
        same_cut = sum(r["parts"] == res["best_parts"] for r in reb)
        mig = res["migration_alternation"]
        one = None
        if "iterations" in mig:
            it = mig["iterations"]
            one = compare([r["side"] for r in it], [r["ms"] for r in it], args.warmup, seed=args.seed)
        before = [x for r in runs for x in r["iterations_ms"][2:args.slow_from]]
        healthy = statistics.median(before) if before else None  # none when slowed from the start
        seen_from = max(args.slow_from, LEARNED_BY)
        met = (whole.ratio.median <= TARGET_BEST and one is not None and one.ratio.median >= TARGET_UNIFORM and one.ratio.lo > 1.0
               and len(starts) == len(reb) and max(starts) - seen_from <= TARGET_ITERS)
        row = {"model": model, "healthy_ms": healthy, "best_parts": res["best_parts"],
               "rebalance_over_best_static": whole.as_dict(),
               "uniform_over_rebalance": None if one is None else one.as_dict(),
               "new_partition_from_iteration": starts, "rebalance_parts": [r["parts"] for r in reb],
               "runs_ending_on_best_cut": same_cut,
               "first_move_ms": [round(r["first_move_ms"], 1) for r in reb],
               "first_move_bytes": [r["first_move_bytes"] for r in reb],
               "runs": runs, "migration_alternation": mig, "profile": res["profile"], "met": met}
        out.append(row)
        w = whole.ratio
        rows.append([model, "rebalance / best static", "whole runs", f"{w.median:.3f}", f"[{w.lo:.3f}, {w.hi:.3f}]",
                     w.pairs, whole.noise.text() if whole.noise else "-",
                     f"{whole.b_median_ms:.0f} / {whole.a_median_ms:.0f}"])
        verdicts.append(f"{model}, rebalance / best static: {whole.verdict}")
        if one is not None:
            u = one.ratio
            rows.append([model, "uniform / rebalance", "one job", f"{u.median:.3f}", f"[{u.lo:.3f}, {u.hi:.3f}]",
                         u.pairs, one.noise.text() if one.noise else "-",
                         f"{one.b_median_ms:.0f} / {one.a_median_ms:.0f}"])
            verdicts.append(f"{model}, uniform / rebalance: {one.verdict}; {mig['migrations']} migrations between "
                            f"{mig['loop_parts']} and {mig['uniform_parts']}, median {mig['migration_ms_median']:.0f} ms")
        else:
            verdicts.append(f"{model}, uniform / rebalance: not measured: {mig['error']}")
        verdicts.append(f"{model}: healthy {'-' if healthy is None else f'{healthy:.0f}'} ms; new partition from "
                        f"iteration {', '.join(map(str, starts)) or '-'} (slowdown at {args.slow_from}); {same_cut} of {len(reb)} "
                        f"rebalance runs end on the best static cut {res['best_parts']}; first migration "
                        f"{statistics.median(row['first_move_ms']):.0f} ms, "
                        f"{statistics.median(row['first_move_bytes']) / 1e3:.0f} kB (medians); targets met: "
                        f"{'yes' if met else 'NO'}")
    print_table(f"stage {SLOW_STAGE} slowed {FACTOR:g}x from iteration {args.slow_from}: {args.stages} stages x {MICROBATCHES} "
                f"micro-batches, paired (A B A' B ...), B/A with its bootstrap 95% interval",
                ["model", "B / A", "alternation", "median ratio", "95% interval", "pairs", "A'/A noise [95%]",
                 "median ms B / A"], rows)
    print("\n".join(verdicts))
    write_json(args.out, {"benchmark": "rebalance", "stages": args.stages, "microbatches": MICROBATCHES,
                          "slow_stage": SLOW_STAGE, "factor": FACTOR, "slow_from": args.slow_from, "iters": args.iters,
                          "settle": args.settle, "run_pairs": args.run_pairs, "pairs": args.pairs, "warmup": args.warmup, "seed": args.seed,
                          "targets": {"rebalance_over_best_static_max": TARGET_BEST,
                                      "uniform_over_rebalance_min": TARGET_UNIFORM, "iterations_max": TARGET_ITERS},
                          "gpt": GPT, "results": out})


if __name__ == "__main__":
    sys.exit(main())
