"""Real heavy micro-batches: stock DeepSpeed 1F1B against ours, ordered and ready (BF and BFW hints),
on the GPT recipe's blocks with micro-batches of varying length, and what the replay predicts.

    DS_ACCELERATOR=cpu python benchmarks/engine/varlen_real.py [--workloads multimodal,varlen] [--ranks 2 4]
        [--sittings 2] [--iterations 12] [--warmup 2] [--micro-batches 8] [--out out/varlen_real.json]

Workloads (``recipes/gpt/varlen.py``, a ``PipelineModule(dynamic_shape=True)`` of the recipe's
blocks, d = 128, 4 blocks, 8 windows of 64 bytes per micro-batch, fp32, Adam): ``multimodal``, a
seeded quarter of the micro-batches 4x longer on the encoder (the first half of the blocks: stage 0
of 2, stages 0-1 of 4), pooled to the common length before the text blocks, drawn anew each
iteration; ``varlen``, language only, each micro-batch's length drawn from a long tail. One rank
per stage, ``OMP_NUM_THREADS=1``; 4 ranks on a 2-core machine oversubscribe it (the rows say so).

Each sitting is one job (``benchmarks/_common/_varlen_job.py``) that trains three engines one after
the other on the same per-iteration batches: stock DeepSpeed (``deepspeed.initialize``: 1F1B, fused
backward), and our engine twice, with the ``zb`` plan (BFW: W apart) and the ``1f1b`` plan (BF: W
fused with B) as the hint of ready dispatch, each job alternating ready (B) with ordered dispatch of
the same plan (A) at iteration boundaries through ``pipemorph.compare`` (cycle ``A B A' B``), so
ready against ordered is paired inside one engine. Stock is another engine class and cannot share
an engine with ours: the order of the three alternates from one sitting to the next.

Beside each row, the replay's time (``plan.sim.ready.replay_varying``) from measured op times: for
every measured iteration of our engines, each op's measured ms (F, B, W per stage and micro-batch)
is a table; every row is replayed on every table (stock: DeepSpeed's 1F1B, ordered, backward fused;
ours: its plan, ordered, or ready with the plan's caps) and the mean is the row's predicted time.
Measured and predicted speed-ups are over stock's; "share" is measured over predicted speed-up.
Prints one table and writes JSON (with ``/proc/loadavg`` before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "_common"))  # the shared helpers

from _util import check_out, exit_on_bad_input, print_table, write_json  # noqa: E402
from ds_pipemorph.fileio import BadInput  # noqa: E402

JOB = HERE.parent / "_common" / "_varlen_job.py"
WORKLOADS = ("multimodal", "varlen")
HINTS = {"zb": "BFW", "1f1b": "BF"}
TARGET_SHARE = 0.90
ROWS = ["stock 1F1B", "ours ordered 1f1b", "ours ready 1f1b (BF)", "ours ordered zb", "ours ready zb (BFW)"]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def run_job(workload: str, ranks: int, order: list[str], args, tmp: Path, name: str) -> dict:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(JOB),
           "--workload", workload, "--rows", ",".join(order), "--micro-batches", str(args.micro_batches),
           "--batch", str(args.batch), "--seq", str(args.seq), "--d-model", str(args.d_model),
           "--heads", str(args.heads), "--blocks", str(args.blocks), "--warmup", str(args.warmup),
           "--iterations", str(args.iterations), "--out", str(out)]
    if args.budget is not None:
        cmd += ["--budget", str(args.budget)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if p.returncode or not out.exists():
        raise SystemExit(f"{name}: the job failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(out.read_text())


def measured_rows(job: dict) -> dict[str, list[float]]:
    """Row label -> the measured iterations' times (ms) of one job."""
    warm = job["args"]["warmup"]
    out = {}
    for r in job["rows"]:
        if r["row"] == "stock":
            out["stock 1F1B"] = r["times_ms"][warm:]
            continue
        hint = r["row"]
        sides = r["sides"]
        out[f"ours ordered {hint}"] = [t for s, t in list(zip(sides, r["times_ms"]))[warm:] if s != "B"]
        out[f"ours ready {hint} ({HINTS[hint]})"] = [t for s, t in list(zip(sides, r["times_ms"]))[warm:] if s == "B"]
    return out


def predicted_rows(job: dict) -> dict[str, float]:
    """Row label -> the mean replay time (ms) over the tables of every measured iteration of our engines."""
    from ds_pipemorph.plan.ir.links import DIRECT
    from ds_pipemorph.plan.ir.ops import parse_stage, peak_inflight
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
    from ds_pipemorph.plan.sim.ready import replay_varying

    S, N, warm = job["ranks"], job["args"]["micro_batches"], job["args"]["warmup"]
    costs = Costs.uniform(S, 1.0)
    plans = {r["row"]: [parse_stage(stage) for stage in r["plan"]] for r in job["rows"] if r["row"] != "stock"}
    tables = []
    for r in job["rows"]:
        if r["row"] != "stock":
            for ops in r["ops"][warm:]:
                ms = {(s, k, m): t for s, k, m, t in ops}
                tables.append(lambda s, k, m, ms=ms: ms[(s, getattr(k, "value", k), m)])
    sums = dict.fromkeys(ROWS, 0.0)
    for t in tables:
        sums["stock 1F1B"] += replay_varying(deepspeed_1f1b(S, N), costs, N, dispatch="ordered", op_times=t,
                                             fused_backward=True, link_model=DIRECT).iteration_ms
        for hint, plan in plans.items():
            sums[f"ours ordered {hint}"] += replay_varying(plan, costs, N, dispatch="ordered", op_times=t,
                                                           link_model=DIRECT).iteration_ms
            sums[f"ours ready {hint} ({HINTS[hint]})"] += replay_varying(
                plan, costs, N, dispatch="ready", caps=peak_inflight(plan), op_times=t, link_model=DIRECT).iteration_ms
    return {k: v / len(tables) for k, v in sums.items()}


def summarize(jobs: list[dict]) -> dict:
    """Per row: mean measured ms over the sittings' iterations, mean predicted ms over the sittings;
    speed-ups over stock; the engines' own ready/ordered comparisons (B/A with its 95 % interval)."""
    times = {k: [] for k in ROWS}
    preds = {k: [] for k in ROWS}
    paired = {h: [] for h in HINTS}
    for job in jobs:
        for k, v in measured_rows(job).items():
            times[k] += v
        for k, v in predicted_rows(job).items():
            preds[k].append(v)
        for r in job["rows"]:
            if r["row"] in HINTS and r["comparison"]:
                paired[r["row"]].append(r["comparison"]["ratio"])
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    pred = {k: statistics.fmean(v) for k, v in preds.items()}
    rows = {}
    for k in ROWS:
        measured, predicted = mean["stock 1F1B"] / mean[k], pred["stock 1F1B"] / pred[k]
        rows[k] = {"measured_ms": mean[k], "iterations": len(times[k]), "predicted_ms": pred[k],
                   "measured_speedup": measured, "predicted_speedup": predicted, "share": measured / predicted}
    return {"rows": rows, "ready_over_ordered": paired}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="multimodal,varlen")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sittings", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=12, help="measured iterations per engine and sitting (>= 12)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="windows per micro-batch")
    ap.add_argument("--seq", type=int, default=64, help="the common sequence length")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--budget", type=float, default=None, help="our engine's memory.budget (default: no limit)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", default="out/varlen_real.json")
    args = ap.parse_args()
    check_out(args.out)
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise BadInput(f"--workloads: unknown '{unknown[0]}'; use a comma-separated list of {', '.join(WORKLOADS)}")
    if args.iterations < 12:
        raise BadInput(f"--iterations {args.iterations}: use at least 12 (the engine's comparison needs 6 pairs)")
    if args.sittings < 1 or args.warmup < 0 or args.micro_batches < 2:
        raise BadInput("--sittings must be at least 1, --warmup at least 0 and --micro-batches at least 2")
    if any(r < 2 or args.blocks % r for r in args.ranks):
        raise BadInput(f"--ranks: each must be at least 2 and divide --blocks {args.blocks}")
    cores = os.cpu_count() or 1
    results, table = [], []
    load_before = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for workload in workloads:
            for ranks in args.ranks:
                jobs = []
                for k in range(args.sittings):
                    order = ["stock", "zb", "1f1b"] if k % 2 == 0 else ["1f1b", "zb", "stock"]
                    t0 = time.monotonic()
                    jobs.append(run_job(workload, ranks, order, args, Path(tmp), f"{workload}_r{ranks}_{k}"))
                    print(f"{workload}, {ranks} ranks, sitting {k + 1}: {time.monotonic() - t0:.0f} s "
                          f"(load {loadavg()})", flush=True)
                summary = summarize(jobs)
                note = f"{ranks} ranks" + (f" on {cores} cores (oversubscribed)" if ranks > cores else "")
                results.append({"workload": workload, "ranks": ranks, "cores": cores, **summary,
                                "sittings": [{"order": [r["row"] for r in j["rows"]], "shapes": j["shapes"],
                                              "rows": [{k: v for k, v in r.items() if k != "ops"} for r in j["rows"]]}
                                             for j in jobs]})
                for label, r in summary["rows"].items():
                    hint = next((h for h in HINTS if f"ready {h} " in label), None)
                    pair = summary["ready_over_ordered"].get(hint) if hint else None
                    pair_text = "-" if not pair else "; ".join(
                        f"{p['median']:.3f} [{p['lo']:.3f}, {p['hi']:.3f}]" for p in pair)
                    table.append([workload, note, label, f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}",
                                  f"{r['measured_speedup']:.3f}", f"{r['predicted_speedup']:.3f}",
                                  "-" if label == "stock 1F1B" else f"{r['share']:.3f}", pair_text])
    load_after = loadavg()
    print_table(f"stock DeepSpeed 1F1B against ours, GPT recipe blocks, real compute, {args.micro_batches} micro-batches, "
                f"{args.sittings} sittings x {args.iterations} iterations per engine (load {load_before} -> {load_after})",
                ["workload", "ranks", "row", "ms", "replay ms", "stock / row", "replay: stock / row", "share",
                 "ready / ordered, paired (per sitting)"], table)
    write_json(args.out, {"benchmark": "varlen_real", "args": vars(args), "loadavg_before": load_before,
                          "loadavg_after": load_after, "target_share": TARGET_SHARE, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
