"""Ready dispatch against stock DeepSpeed 1F1B on a multimodal batch, and what the replay allows.

RRFP's multimodal case: 4 stages x 12 micro-batches, F = B = W = 10 ms emulated on one CPU rank per
stage; every iteration a seeded quarter of the micro-batches, drawn anew, is 3x heavier (F, B and W)
on the first two stages, where a multimodal batch's images go through the encoder
(``heavy:frac=0.25,factor=3,stages=2``, ``plan.sim.variation``). Ours: ``PipeMorphEngine`` with
ready dispatch and the ``zb`` plan as its hint. Stock: DeepSpeed's own engine and 1F1B (fused
backward), its forward and backward timed from the same tables (``inject.vary.install_stock``).

Stock DeepSpeed is another engine class and cannot share a job with ours, so each sitting is one
``pipemorph bench`` job that runs both, one after the other, on the same per-iteration tables; the
order of the two alternates from one sitting to the next. Per sitting: the measured speed-up (stock's
mean iteration over ours) and the one the readiness replay predicts for the same tables
(``plan.sim.ready``: stock's 1F1B replayed ordered with its backward fused, ours replayed under
ready dispatch with the plan's caps), and the share of the predicted gain measured, (measured - 1) /
(predicted - 1) (``_util.gain_share``; their quotient is in the JSON as ``speedup_quotient``).
Each engine's time over its own replay is shown too (what this machine adds to both), and ours over
the replay of its ops as they ran ("replay as ran": the same replay with each op's measured
duration instead of its table's), which leaves out what the ops themselves took beyond their tables
and keeps what dispatch and messages cost; and over that replay with each link's measured mean
message latency (from the end of the producing op to the receiver having it) added to its delay,
which leaves the dispatch's own cost. The summary gives the medians over sittings.

``--workload plain-sleep`` runs the same shape on a stage of its own instead (``bench.plain_sleep``):
F, B and W are plain ``time.sleep`` calls inside autograd functions (no hook, nothing makes up for a
late wake-up), and the heavy quarter is drawn by that module's own RNG and carried in the batch.

A second table says where ours' time went, per stage, as means per iteration over all measured
iterations (``bench.stage_time``): its idle time against the replay's, how much longer its ops
lasted than their tables, the time spent choosing the next op, settling the inbox and posting
receives, the wait for messages (its own and the replay's, and the part beyond the replay's), and
the time idle with the next op's message in, and a message's mean time from the end of the op that
produced it to its receiver having it. Prints both tables and writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/engine/ready_vs_stock.py [--sittings 4] [--iterations 8] [--warmup 2]
        [--workload heavy|plain-sleep] [--out out/ready_vs_stock.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import BadInput, check_out, exit_on_bad_input, gain_share, print_table, work_folder, write_json

from ds_pipemorph.bench import plain_sleep, stage_time
from ds_pipemorph.bench.launch import run_job
from ds_pipemorph.bench.spec import BenchSpec, Scenario

STAGES, MICROBATCHES, OP_MS = 4, 12, 10.0
VARY = "heavy:frac=0.25,factor=3,stages=2"
TARGET_SHARE = 0.90  # of the gain over stock the replay predicts
WORKLOADS = ("heavy", plain_sleep.NAME)
STAGE_COLUMNS = {"idle": "idle", "replay_idle": "replay idle", "busy_over": "ops over table",
                 "choosing": "choosing", "settling": "settling", "posting": "posting", "holding": "holding",
                 "held_in_vain": "held in vain",
                 "msg_wait": "msg wait",
                 "replay_msg_wait": "replay msg wait", "beyond_replay": "wait beyond replay",
                 "msg_in": "idle, msg in", "msg_latency": "msg latency (mean)"}


def sitting(k: int, args) -> dict:
    """One job: both engines on the same tables, stock first in odd sittings; the two rows."""
    work = work_folder("pipemorph-ready-vs-stock-")
    schedules = ["stock-1f1b", "zb"] if k % 2 == 0 else ["zb", "stock-1f1b"]
    spec = BenchSpec(stages=STAGES, microbatches=MICROBATCHES, op_ms=OP_MS,
                     scenarios=[Scenario(name="multimodal", links_ms=[0.0] * (STAGES - 1))],
                     schedules=schedules, dispatches=["ready"], iterations=args.iterations,
                     **({"vary": VARY} if args.workload == "heavy" else {"workload": args.workload}),
                     warmup=args.warmup, progress_file=str(work / "progress"), out=str(work / "bench.json"))
    spec_path = work / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    t0 = time.monotonic()
    rows = {r["schedule"]: r for r in run_job(spec, spec_path, work, args.timeout_s)["results"]}
    stock, ours = rows["stock-1f1b"], rows["zb"]
    measured = stock["mean_ms"] / ours["mean_ms"]
    predicted = stock["predicted_ms"] / ours["predicted_ms"]
    return {"sitting": k + 1, "first": schedules[0], "stock_ms": stock["mean_ms"], "ours_ms": ours["mean_ms"],
            "stock_predicted_ms": stock["predicted_ms"], "ours_predicted_ms": ours["predicted_ms"],
            "measured_speedup": measured, "predicted_speedup": predicted, "share": gain_share(measured, predicted),
            "speedup_quotient": measured / predicted,
            "stock_iterations_ms": stock["iterations_ms"], "ours_iterations_ms": ours["iterations_ms"],
            "ours_stage_time_ms": ours["stage_time_ms"], "ours_predicted_as_ran_ms": ours["predicted_as_ran_ms"],
            "ours_predicted_as_ran_latency_ms": ours["predicted_as_ran_latency_ms"],
            "wall_s": round(time.monotonic() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sittings", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=8, help="measured iterations per engine and sitting")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--workload", choices=WORKLOADS, default="heavy",
                    help=f"heavy: the emulated stage timed by {VARY}; plain-sleep: {plain_sleep.DESCRIPTION}")
    ap.add_argument("--out", default="out/ready_vs_stock.json")
    args = ap.parse_args()
    for name, value, least in (("--sittings", args.sittings, 1), ("--iterations", args.iterations, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            ap.error(f"{name} must be at least {least}, not {value}")
    try:
        check_out(args.out)
    except BadInput as e:
        ap.error(str(e))
    results = []
    for k in range(args.sittings):
        results.append(sitting(k, args))
        r = results[-1]
        print(f"sitting {k + 1}: stock / ours {r['measured_speedup']:.3f}, the replay allows "
              f"{r['predicted_speedup']:.3f} ({r['wall_s']:.0f} s)", flush=True)
    what = VARY if args.workload == "heavy" else plain_sleep.DESCRIPTION
    print_table(f"ours (ready dispatch, zb hint) against stock DeepSpeed 1F1B, {STAGES} stages x {MICROBATCHES} "
                f"micro-batches, {what}, {args.iterations} iterations per engine and sitting",
                ["sitting", "first", "stock ms", "ours ms", "stock / its replay", "ours / its replay",
                 "ours / replay as ran", "ours / as ran + latency", "stock / ours", "replay: stock / ours",
                 "share of gain"],
                [[r["sitting"], r["first"], f"{r['stock_ms']:.1f}", f"{r['ours_ms']:.1f}",
                  f"{r['stock_ms'] / r['stock_predicted_ms']:.3f}", f"{r['ours_ms'] / r['ours_predicted_ms']:.3f}",
                  f"{r['ours_ms'] / r['ours_predicted_as_ran_ms']:.3f}",
                  f"{r['ours_ms'] / r['ours_predicted_as_ran_latency_ms']:.3f}",
                  f"{r['measured_speedup']:.3f}", f"{r['predicted_speedup']:.3f}",
                  "-" if r["share"] is None else f"{r['share']:.0%}"]
                 for r in results])
    per_stage = stage_time.mean([r["ours_stage_time_ms"] for r in results])  # sittings hold equal iterations
    print_table(f"ours: where each stage's time went, ms per iteration (mean over {len(results)} x "
                f"{args.iterations} measured iterations)", ["stage", *STAGE_COLUMNS.values()],
                [[s, *(f"{row[f]:.1f}" for f in STAGE_COLUMNS)] for s, row in enumerate(per_stage)])
    med = {k: statistics.median(r[k] for r in results) for k in ("measured_speedup", "predicted_speedup")}
    shares = [r["share"] for r in results if r["share"] is not None]
    med["share"] = statistics.median(shares) if shares else None
    verdict = "no gain predicted" if med["share"] is None else "met" if med["share"] >= TARGET_SHARE else "not met"
    share_text = "no gain predicted" if med["share"] is None else f"{med['share']:.0%} of the predicted gain"
    print(f"median over {len(results)} sittings: stock / ours {med['measured_speedup']:.3f}, the replay allows "
          f"{med['predicted_speedup']:.3f}: {share_text} (goal >= {TARGET_SHARE:.0%}: {verdict})")
    write_json(args.out, {"stages": STAGES, "microbatches": MICROBATCHES, "op_ms": OP_MS, "workload": args.workload,
                          "vary": VARY if args.workload == "heavy" else None, "stage_time_ms": per_stage,
                          "iterations": args.iterations, "warmup": args.warmup, "sittings": results,
                          "median": med, "target_share": TARGET_SHARE, "verdict": verdict})


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
