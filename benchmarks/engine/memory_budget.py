"""Activation memory against iteration time on the GPT recipe: stock DeepSpeed 1F1B, ``zb`` and
``adaptive`` with the default budget (stock's memory), with ``memory.budget`` 1.5 and without limit.

The recipe's GPT (``recipes/gpt``: d_model 128, 4 heads, 4 blocks, 64-token windows, micro-batches of
4, 8 per iteration) on 2 pipeline stages, one CPU rank and one thread per stage, fp32, no activation
checkpointing (the recipe's default config checkpoints every block, which leaves F almost nothing to
keep). One job runs every row in turn, each a fresh engine on the same seed and data: ``--warmup``
iterations, then two metered ones (what autograd holds saved for backward, the most at once per
stage: ``runtime.act_meter.SavedBytes``, each storage once, parameters left out), then
``--iterations`` timed ones without the meter (their median). The engine also logs what its first
iteration measured per micro-batch (F's bytes; the stock column is S - s of them).

``--budget-mb X`` (repeatable; X one MiB figure for every stage or one per stage, comma-separated) adds
a ``zb`` and an ``adaptive`` row granting ``memory.budget_mb`` X: the grant is in force from the second
iteration, so the metered and timed iterations run within it (at least 1 warm-up iteration).

    DS_ACCELERATOR=cpu python benchmarks/engine/memory_budget.py [--iterations 10] [--warmup 3]
        [--budget-mb 12 ...] [--out out/memory_budget.json]

(re-launches itself with ``torchrun --standalone --nproc_per_node 2`` when not started by torchrun).
Prints one table and writes JSON.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import check_out, exit_on_bad_input, print_table, relaunch, write_json

ROOT = Path(__file__).resolve().parents[2]
STAGES, MICROBATCHES, MB_SIZE, SEQ = 2, 8, 4, 64
ROWS = [  # (label, pipemorph section or None for stock DeepSpeed)
    ("stock 1F1B", None),
    ("zb, default (1x)", {"schedule": "zb"}),
    ("adaptive, default (1x)", {"schedule": "adaptive"}),
    ("zb, budget 1.5x", {"schedule": "zb", "memory": {"budget": 1.5}}),
    ("adaptive, budget 1.5x", {"schedule": "adaptive", "memory": {"budget": 1.5}}),
    ("zb, no limit", {"schedule": "zb", "memory": {"budget": None}}),
]
MIB = 1024 * 1024


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-mb", action="append", default=[], type=_mib,
                    help="add zb and adaptive rows granting memory.budget_mb this many MiB per stage "
                         "(one value, or one per stage comma-separated); repeatable")
    ap.add_argument("--out", default="out/memory_budget.json")
    args = ap.parse_args(argv)
    if args.budget_mb and args.warmup < 1:
        ap.error("--budget-mb needs --warmup 1 or more: the grant is in force from the second iteration")
    return args


def _mib(text: str):
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget-mb takes MiB as numbers (e.g. 12 or 12,6), not {text!r}") from None
    if len(values) not in (1, STAGES):
        raise argparse.ArgumentTypeError(f"--budget-mb takes one value or {STAGES} (one per stage), not {len(values)}")
    return values[0] if len(values) == 1 else values


def rows_for(args) -> list:
    """``ROWS`` and, per ``--budget-mb`` value, a ``zb`` and an ``adaptive`` row granting it."""
    extra = []
    for mib in args.budget_mb:
        shown = f"{mib:g}" if isinstance(mib, float) else ",".join(f"{x:g}" for x in mib)
        for schedule in ("zb", "adaptive"):
            extra.append((f"{schedule}, budget_mb {shown}", {"schedule": schedule, "memory": {"budget_mb": mib}}))
    return ROWS + extra


def run_rank(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "recipes" / "gpt"))
    import ds_pipemorph
    from ds_pipemorph.runtime.act_meter import SavedBytes
    from model import gpt

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)
    windows = [torch.randint(0, 256, (MB_SIZE, SEQ + 1), generator=g) for _ in range(MICROBATCHES)]
    data = [(w[:, :-1], w[:, 1:]) for w in windows]
    rows = []
    for label, section in rows_for(args):
        torch.manual_seed(0)
        model = gpt(stages=STAGES, max_seq=SEQ)
        cfg = {"train_micro_batch_size_per_gpu": MB_SIZE, "gradient_accumulation_steps": MICROBATCHES,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}
        if section is None:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        else:
            cfg["pipemorph"] = {**section, "delegation": {"mode": "off"}, "nvtx": False}
            engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for _ in range(args.warmup):
            engine.train_batch(iter(data))
        peaks = []
        for _ in range(2):
            with SavedBytes(engine.module.parameters()) as meter:
                engine.train_batch(iter(data))
            peaks.append(meter.peak)
        times = []
        for _ in range(args.iterations):
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(iter(data))
            dist.barrier()
            times.append((time.perf_counter() - t0) * 1e3)
        per_stage = [None] * dist.get_world_size()
        dist.all_gather_object(per_stage, (engine.stage_id, max(peaks)))
        measured = getattr(engine, "activation_bytes", None)
        budget = getattr(engine, "budget", None)  # the limits in force (units: micro-batches' activations)
        if rank == 0:
            rows.append({"row": label, "section": section, "median_ms": statistics.median(times), "ms": times,
                         "peak_saved_bytes": [b for _, b in sorted(per_stage)],
                         "engine_measured": [a.as_dict() for a in measured] if measured else None,
                         "budget": None if budget is None else {"units": budget.units, "caps": budget.caps,
                                                                 "mib": budget.mib}})
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine
        dist.barrier()
    if rank == 0:
        stock = rows[0]["peak_saved_bytes"]
        table = []
        for r in rows:
            peak = r["peak_saved_bytes"]
            table.append([r["row"], f"{r['median_ms']:.0f}", f"{rows[0]['median_ms'] / r['median_ms']:.2f}x",
                          ", ".join(f"{b / MIB:.1f}" for b in peak),
                          ", ".join(f"{b / s:.2f}x" for b, s in zip(peak, stock)),
                          _granted(r)])
        print_table(f"GPT recipe, {STAGES} stages x {MICROBATCHES} micro-batches of {MB_SIZE} x {SEQ} tokens, fp32, "
                    f"1 thread per rank; median of {args.iterations} iterations",
                    ["row", "iteration ms", "speed vs stock", "peak saved MiB per stage", "vs stock per stage",
                     "budget per stage: MiB (micro-batches)"], table)
        write_json(args.out, {"stages": STAGES, "microbatches": MICROBATCHES, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


def _granted(row: dict) -> str:
    """The budget in force per stage, in MiB and in micro-batches' activations (F's bytes each)."""
    b, measured = row["budget"], row["engine_measured"]
    if b is None or b["units"] is None or not measured:
        return "-" if b is None else "none"
    mib = b["mib"] or [u * m["f"] / MIB for u, m in zip(b["units"], measured)]
    return ", ".join(f"{x:.1f} ({u:.2g})" for x, u in zip(mib, b["units"]))


def main() -> int:
    args = parse()
    if "LOCAL_RANK" not in os.environ:
        check_out(args.out)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        return relaunch(__file__, STAGES)
    run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
