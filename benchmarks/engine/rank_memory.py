"""Whole-rank peak memory: stock DeepSpeed 1F1B against our engine's schedules on one job.

4 emulated stages (``inject.emulated.EmulatedStage``, F = B = W = ``--op-ms``) × 12 micro-batches,
each micro-batch a 32 MiB fp32 activation (``--act-mib``), 20 ms injected on link 0 (``--delay-ms``;
the stock row through ``inject.stock``, ours through the config's ``inject`` section), ``--warmup``
then ``--iterations`` iterations, one rank per stage. Each row is its own ``torchrun`` job, so that
a rank's peak is that of a process which ran that row only. Every rank reports its resident set
after ``initialize`` (libraries, parameters, optimizer: the same in every row), its peak resident
set (``VmHWM``, started again before each iteration) per iteration, and which path each link took
at the end (d: direct, D: delegated; a delegated link's staging rings are resident memory too).
The table gives each rank's peak, its ratio to the stock row's on the same rank, and the peak above
the resident set after ``initialize`` (the "working set": activations, messages, buffers, rings).

Rows: ``stock``; ``1f1b``, ``zb`` and ``adaptive`` with the defaults (``adaptive`` may move a slow
link to the delegates); ``adaptive-direct`` with ``delegation.mode: off``, and ``adaptive-direct-unbounded`` also without
the send window (what a gloo rank keeps of an iteration's sends without it); ``adaptive-ready`` (ready
dispatch, no delegation); ``adaptive-1.5x`` (``memory.budget: 1.5``); ``zb-nolimit`` (``budget: null``); ``1f1b-recv2``
(``recv_window: 2``, two receives of each kind posted ahead instead of one).

    DS_ACCELERATOR=cpu python benchmarks/engine/rank_memory.py [--rows stock,1f1b,zb,...]
        [--act-mib 32] [--iterations 2] [--warmup 4] [--out out/rank_memory.json]

Prints one table and writes JSON. Times are medians of few iterations, one job per row: not paired.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import check_out, exit_on_bad_input, print_table, relaunch, write_json

STAGES, MICROBATCHES, WIDTH = 4, 12, 8
ROWS = {  # label -> pipemorph section (None: stock DeepSpeed)
    "stock": None,
    "1f1b": {"schedule": "1f1b"},
    "zb": {"schedule": "zb"},
    "adaptive-direct": {"schedule": "adaptive", "delegation": {"mode": "off"}},
    "adaptive-direct-unbounded": {"schedule": "adaptive", "delegation": {"mode": "off"}, "send_window": 10**6},
    "adaptive": {"schedule": "adaptive"},
    "adaptive-ready": {"schedule": "adaptive", "dispatch": "ready", "delegation": {"mode": "off"}},
    "adaptive-1.5x": {"schedule": "adaptive", "memory": {"budget": 1.5}, "delegation": {"mode": "off"}},
    "zb-nolimit": {"schedule": "zb", "memory": {"budget": None}},
    "1f1b-recv2": {"schedule": "1f1b", "recv_window": 2},  # two receives of each kind posted ahead
}
DEFAULT_ROWS = "stock,1f1b,zb,adaptive-direct,adaptive,adaptive-ready,1f1b-recv2"
MIB = 1024 * 1024


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--act-mib", type=float, default=32.0, help="one micro-batch's activation, MiB")
    ap.add_argument("--op-ms", type=float, default=10.0)
    ap.add_argument("--delay-ms", type=float, default=20.0, help="injected on link 0")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--mmap-threshold-mib", type=float, default=None,
                    help="MALLOC_MMAP_THRESHOLD_ for the jobs: blocks this large are mapped and unmapped at once, so "
                         "the peak counts what is live, not what malloc kept (default: glibc's own, which maps "
                         "blocks of 32 MiB and more)")
    ap.add_argument("--out", default="out/rank_memory.json")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_rank(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import ds_pipemorph
    from ds_pipemorph.inject.delays import DelaySchedule
    from ds_pipemorph.inject.emulated import EmulatedStage, anchor_stock_engine

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    section = ROWS[args.row]
    torch.manual_seed(0)
    t = args.op_ms
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, WIDTH, t, t, t) for _ in range(STAGES)],
                           num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICROBATCHES,
           "train_batch_size": MICROBATCHES, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9}
    patch = None
    if section is None:
        from ds_pipemorph.inject.stock import install

        patch = install(DelaySchedule([args.delay_ms] + [0.0] * (STAGES - 2)))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        anchor_stock_engine(engine)
    else:
        cfg["pipemorph"] = {**section, "nvtx": False, "inject": {"links": {"0": {"delay_ms": args.delay_ms}}}}
        engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rows = int(args.act_mib * MIB) // (4 * WIDTH)

    def data():  # made as the engine asks (first and last stage), so no rank holds the whole batch
        g = torch.Generator().manual_seed(1)
        for _ in range(MICROBATCHES):
            yield torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)

    import gc

    gc.collect()
    dist.barrier()
    after_init = _status_mib("VmRSS")
    times, peaks = [], []
    for i in range(args.warmup + args.iterations):
        dist.barrier()
        _reset_peak()
        t0 = time.monotonic()
        engine.train_batch(data())
        if i >= args.warmup:
            times.append((time.monotonic() - t0) * 1e3)
        peaks.append(_status_mib("VmHWM"))
    peak = max(peaks)
    if patch:
        patch["drain"]()
        patch["uninstall"]()
    links = ([engine.transport.link_mode(i, "F") for i in range(STAGES - 1)] if section is not None
             else ["direct"] * (STAGES - 1))
    mine = {"rank": rank, "links": links, "after_init_mib": after_init, "peak_mib": peak, "times_ms": times, "peaks_mib": peaks}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(args.report).write_text(json.dumps(gathered))
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse(argv)
    if os.environ.get("LOCAL_RANK") is not None:
        run_rank(args)
        return 0
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"error: --rows: unknown row {unknown[0]!r}; choose from {', '.join(ROWS)}", file=sys.stderr)
        return 2
    for name, value, least in (("--act-mib", args.act_mib, 0.001), ("--op-ms", args.op_ms, 0.5),
                                ("--iterations", args.iterations, 1), ("--warmup", args.warmup, 0),
                                ("--delay-ms", args.delay_ms, 0)):
        if value < least:
            print(f"error: {name} must be at least {least:g}, not {value:g}", file=sys.stderr)
            return 2
    if args.mmap_threshold_mib is not None and args.mmap_threshold_mib <= 0:
        print(f"error: --mmap-threshold-mib must be positive, not {args.mmap_threshold_mib:g}", file=sys.stderr)
        return 2
    check_out(args.out)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            report = Path(tmp) / f"{row}.json"
            passed = [a for a in (argv if argv is not None else sys.argv[1:])]
            if args.mmap_threshold_mib is not None:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = str(int(args.mmap_threshold_mib * MIB))
            code = relaunch(__file__, STAGES, *passed, "--row", row, "--report", str(report))
            if code != 0 or not report.exists():
                print(f"error: the {row} job failed (exit code {code})", file=sys.stderr)
                return 1
            results[row] = json.loads(report.read_text())
            print(f"{row}: done", flush=True)
    table = []
    stock = results.get("stock")
    for row, ranks in results.items():
        for r in ranks:
            ratio = (f"{r['peak_mib'] / stock[r['rank']]['peak_mib']:.3f}" if stock else "-")
            work = r["peak_mib"] - r["after_init_mib"]
            work_ratio = (f"{work / (stock[r['rank']]['peak_mib'] - stock[r['rank']]['after_init_mib']):.2f}"
                          if stock else "-")
            times = sorted(r["times_ms"])
            table.append([row, ",".join("D" if m == "delegated" else "d" for m in r["links"]), r["rank"], f"{r['after_init_mib']:.0f}", f"{r['peak_mib']:.0f}", ratio,
                          f"{work:.0f}", work_ratio, f"{times[len(times) // 2]:.0f}"])
    print_table(f"whole-rank peak resident memory, {STAGES} stages x {MICROBATCHES} micro-batches of "
                f"{args.act_mib:g} MiB, {args.delay_ms:g} ms on link 0",
                ["row", "links", "rank", "after init MiB", "peak MiB", "peak / stock", "working set MiB",
                 "working / stock", "median ms"], table)
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k not in ("row", "report")},
                          "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
