"""A real compute straggler: CPU burners on one stage's core, against the rebalance loop.

2 stages, one CPU rank each, each rank pinned to a core of its own (``os.sched_setaffinity``, every
thread of the rank) with one intra-op thread, the real engine (``zb``), 12 micro-batches of one of
two models (``--model``):

- ``tiny_gpt`` (default): the tiny_gpt recipe's model (embedding, 10 transformer blocks, head: real
  matmuls), 4 x 32 random tokens per micro-batch;
- ``gpt``: the GPT recipe's model (``recipes/gpt/model.py``: tied embedding and head, 4 blocks,
  d = 128), 4 windows of 64 bytes of the recipe's data (``recipes/gpt/data.py``) per micro-batch.
  The tied layers stay on their stages; the loop moves blocks (and the final norm).

At iteration ``--burn-from`` (8), rank 1 starts ``--burners`` (3) CPU-burning processes
(``_burner.py``: busy loops at normal priority, pinned to stage 1's core, killed at the end of the
row and unable to outlive it) and they spin until the row ends. Nothing is injected: stage 1 is
slow because its core is shared. ``--burn-from 0``: the burners spin from before the row's first
iteration (a co-located job that was there first), so the loop never sees stage 1 healthy; there is
then no "before", and a stage's slowdown is its F + B + W over what its layers cost in the layer
profile (measured before the rows, no burners).

Rows, each a fresh engine on the same data and seed:

- uniform: DeepSpeed's uniform partition throughout;
- rebalance: the same start with ``"rebalance": {"enabled": true}``;
- rebalance-profiled (only when asked for in ``--rows``): the same, with the layer profile measured
  before the rows given to the loop (``rebalance.layer_profile``): it then learns no layer costs and
  sees a stage slowed from the first iteration at once, which the learned costs cannot show on two
  stages whose layers are not all of one class (the embedding on one, the head on the other);
- best static: the partition ``pipemorph partition`` chooses for the model's layer profile (measured
  by ``profiling.layers`` on rank 0, pinned, one thread, before the runs) under the per-stage
  slowdowns *measured in the uniform row* (each stage's F + B + W per micro-batch after the burners
  started over before), on a ``PartsPipelineModule`` from the start, same burners from the same
  iteration.

Per row: median iteration time (barrier to barrier on rank 0) before the burners (iterations 1 to
burn-from - 1) and after them (from burn-from + ``--settle``), each after-median over the uniform
row's with a 95 % bootstrap interval (two independent samples, ``scipy.stats.bootstrap``: the rows
run one after the other, so no pairing cancels the machine's drift between them), the stages'
measured slowdowns, the moves and the iteration the first one after the burners took effect. For
each row the loop ran in, its own prediction for that move (the iteration time its replay gives the
new partition under the slowdowns it measured, ``predicted_ms`` of its event) beside the measured
median from the iteration after the move took effect to the next move (or the end).

Then the learned slowdown predictor (``control.interference.SlowdownModel``) is refitted on these
runs: one sample per stage and iteration, the features of an iteration (its op times over the
layer profile's, the rank's CPU share, the machine's load, a memcpy probe) against the stage's
slowdown in the next iteration; trained on the other rows, tested on the held-out rebalance row,
against persistence (next = last), as ``interference_predictor.py`` does.

    DS_ACCELERATOR=cpu python benchmarks/control/real_straggler.py [--model tiny_gpt|gpt] [--iters 24] [--burn-from 8]
                       [--burners 3] [--rows uniform,rebalance,best-static] [--no-predictor]
                       [--out out/real_straggler.json]

(re-launches itself with ``torchrun --standalone --nproc_per_node 2``). The burners run at normal
priority: on a machine loaded with other, unpinned work, the kernel's load balancer moves some of
that work off the burners' core onto stage 0's, which then slows too; the measured stage slowdowns
say how much of a stage-1 straggler the burners made.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers
from _util import check_out, exit_on_bad_input  # noqa: E402

from ds_pipemorph.fileio import BadInput  # noqa: E402

ROWS = ("uniform", "rebalance", "rebalance-profiled", "best-static")
DEFAULT_ROWS = ("uniform", "rebalance", "best-static")
MODELS = ("tiny_gpt", "gpt")
STAGES, SLOW_STAGE = 2, 1
RECIPE_GPT = Path(__file__).resolve().parents[2] / "recipes" / "gpt"
GPT_SEQ, GPT_BATCH = 64, 4  # the recipe's window (its model's max_seq), windows per micro-batch


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny_gpt", help=f"one of {', '.join(MODELS)}")
    ap.add_argument("--iters", type=int, default=24, help="iterations per row")
    ap.add_argument("--burn-from", type=int, default=8,
                    help="iteration at which the burners start (0: before the first, present from the start)")
    ap.add_argument("--burners", type=int, default=3, help="CPU-burning processes on stage 1's core")
    ap.add_argument("--settle", type=int, default=2, help="iterations after burn-from left out of the after-median")
    ap.add_argument("--microbatches", type=int, default=12)
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--no-predictor", action="store_true", help="skip refitting the learned slowdown predictor")
    ap.add_argument("--out", default="out/real_straggler.json")
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise BadInput(f"--rows takes a comma-separated list of {', '.join(ROWS)}, not {a.rows!r}")
    if "best-static" in rows and "uniform" not in rows:
        raise BadInput("--rows: best-static needs the uniform row (its slowdowns are measured there)")
    if a.model not in MODELS:
        raise BadInput(f"--model takes one of {', '.join(MODELS)}, not {a.model!r}")
    if not (a.burn_from == 0 or a.burn_from >= 2) or a.burn_from >= a.iters - a.settle - 1:
        raise BadInput("--burn-from must be 0 or at least 2 and leave at least two iterations after --settle")
    if a.burn_from == 0 and a.settle < 1:
        raise BadInput("--burn-from 0 needs --settle of at least 1 (the first iteration carries start-up work)")
    if a.burners < 1:
        raise BadInput("--burners must be at least 1")
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


def model(name: str, microbatches: int):
    """(layers, one iteration's micro-batches, loss function, windows per micro-batch) of ``name``."""
    if name == "gpt":
        return recipe_gpt(microbatches)
    import torch
    from rebalance import GPT, GPT_BATCH, layers_of, loss_of

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_gpt"))  # tiny_gpt's model.py
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, GPT["vocab"], (GPT_BATCH, GPT["max_seq"] + 1), generator=g) for _ in range(microbatches)]
    return layers_of("gpt"), [(w[:, :-1], w[:, 1:]) for w in ids], loss_of("gpt"), GPT_BATCH


def _recipe_module(name: str):
    """The GPT recipe's ``name``.py under a name of its own (tiny_gpt's recipe has a ``model`` too)."""
    import importlib.util

    key = f"gpt_recipe_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, RECIPE_GPT / f"{name}.py")
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def recipe_gpt(microbatches: int):
    """The GPT recipe's layers (defaults: 4 blocks, d = 128) and ``microbatches`` x ``GPT_BATCH``
    windows of its training data (the same on every rank: window i is seeded by i)."""
    import torch

    gpt, data = _recipe_module("model"), _recipe_module("data")
    batches = data.micro_batches("train", GPT_SEQ, GPT_BATCH, microbatches)
    torch.manual_seed(0)
    return gpt.layer_specs(vocab=data.VOCAB, max_seq=GPT_SEQ), batches, gpt.next_token_loss, GPT_BATCH


def layer_profile(name: str, microbatches: int):
    """The model's layer profile, measured here (rank 0, pinned, one thread)."""
    from ds_pipemorph.plan.partition.layer_profile import LayerProfile
    from ds_pipemorph.profiling.layers import layer_profile_data, profile_layers

    layers, data, loss, _ = model(name, microbatches)
    costs, _ = profile_layers(layers, data[0][0], data[0][1], loss, warmup=3, reps=7)
    data = layer_profile_data(costs, STAGES, microbatches)
    return LayerProfile.model_validate({"stages": STAGES, "microbatches": microbatches, "layers": data["layers"]})


def rebalance_section(kind: str, profile_path: str) -> dict:
    """The row's ``pipemorph.rebalance``: off, on with learned layer costs, or on with the measured profile."""
    if kind == "rebalance-profiled":
        return {"enabled": True, "layer_profile": profile_path}
    return {"enabled": kind == "rebalance"}


def run_row(kind: str, parts, core: int, cores: list[int], args, profile_path: str) -> dict:
    import torch
    import torch.distributed as dist
    from _burner import Burners
    from deepspeed.pipe import PipelineModule

    import ds_pipemorph
    from ds_pipemorph.control.interference import memcpy_probe_ms, read_host
    from ds_pipemorph.runtime.oprecords import fbw_ms_per_microbatch
    from ds_pipemorph.runtime.parts_module import PartsPipelineModule

    layers, data, loss, mbs = model(args.model, args.microbatches)
    torch.manual_seed(0)
    if kind == "best-static":
        module = PartsPipelineModule(layers, parts, loss_fn=loss)
    else:
        module = PipelineModule(layers=layers, num_stages=STAGES, loss_fn=loss, partition_method="uniform")
    pm = {"schedule": "zb", "delegation": {"mode": "off"}, "nvtx": False,
          "rebalance": rebalance_section(kind, profile_path)}
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
            if it == args.burn_from and rank == SLOW_STAGE:  # at 0: before the row's first iteration
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
    box = [write_layer_profile(layer_profile(args.model, args.microbatches)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    lp, profile_path = box[0]
    try:
        run_rows(args, lp, profile_path, core, cores)
        dist.barrier()
    finally:
        if rank == 0:  # every rank read the file when it built its engine
            shutil.rmtree(Path(profile_path).parent, ignore_errors=True)
    dist.destroy_process_group()
    return 0


def write_layer_profile(lp) -> tuple:
    """``lp`` and a file holding it (rank 0's temporary folder; the ranks share the machine)."""
    path = Path(tempfile.mkdtemp(prefix="real-straggler-")) / "layers.json"
    path.write_text(lp.model_dump_json(exclude_none=True))
    return lp, str(path)


def run_rows(args, lp, profile_path: str, core: int, cores: list[int]) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    results, best = {}, None
    for kind in args.rows:
        if kind == "best-static":
            from _straggler_report import measured_slowdowns

            from ds_pipemorph.plan.partition.partition import partition

            factors = measured_slowdowns(results["uniform"], lp, args)
            best = {"slowdown": factors, "parts": partition(lp, slowdown=factors).parts}
        dist.barrier()
        results[kind] = run_row(kind, best["parts"] if best else None, core, cores, args, profile_path)
    if rank == 0:
        from _straggler_report import report

        report(results, best, lp, args)


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        check_out(args.out)
        return launch(args)
    return ranks_main(args)


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
