"""Real heavy micro-batches: stock DeepSpeed 1F1B against ours, ordered and ready (BF and BFW hints),
on the GPT recipe's blocks with micro-batches of varying length, and what the replay predicts.

    DS_ACCELERATOR=cpu python benchmarks/engine/varlen_real.py [--workloads multimodal,varlen] [--ranks 2 4]
        [--sittings 1] [--iterations 24] [--warmup 2] [--micro-batches 8] [--bf-backward both]
        [--malloc glibc] [--out out/varlen_real.json]

Workloads (``recipes/gpt/varlen.py``, a ``PipelineModule(dynamic_shape=True)`` of the recipe's
blocks, d = 128, 4 blocks, 8 windows of 64 bytes per micro-batch, fp32, Adam): ``multimodal``, a
seeded quarter of the micro-batches 4x longer on the encoder (the first half of the blocks: stage 0
of 2, stages 0-1 of 4), pooled to the common length before the text blocks, drawn anew for
each pair of iterations (below); ``varlen``, language only, each micro-batch's length drawn from a long tail. One rank
per stage, ``OMP_NUM_THREADS=1``; 4 ranks on a 2-core machine oversubscribe it (the rows say so).

Each job (``benchmarks/_common/_varlen_job.py``; per workload and rank count one for each of our
settings, ``--sittings`` times) keeps two engines alive side by side and trains iteration k's
batches with each in turn, which goes first alternating with each draw (below): stock DeepSpeed
(``deepspeed.initialize``: 1F1B, fused backward) and our engine with, as the hint of ready dispatch,
the ``zb`` plan (BFW: W apart), or the ``1f1b`` plan with B and W as one backward pass
(``pipemorph.backward: fused``: RRFP's BF, stock's schedule and backward on our engine), or with B
and W apart (``split``: each input gradient sent before its W; ``--bf-backward`` runs one of the
two ``1f1b`` settings, default both; under ordered dispatch the first stage, which sends no input
gradient, runs a B and the W right after it as one pass whatever the setting), alternating ready (B)
with ordered dispatch of the same plan (A) at its iteration boundaries through ``pipemorph.compare`` (cycle ``A B A' B``). So
every row is paired with stock per iteration, on the same batches, a second or two apart: stock /
row is the median of the per-iteration ratios with its 95 % bootstrap interval. Ready against
ordered is the engine's own comparison (B/A per pair, its 95 % interval); each draw of
micro-batches is trained twice, by one A, B pair, so that comparison too is on the same batches.
Ready always runs a draw second: stock's second run of a draw over its first (same pairs of
iterations, its bootstrap interval) is printed as the control for what a second run gains by itself,
and per job ready / ordered is printed net of it (each pair's ratio over stock's in the same two
iterations, both engines keeping their place in the iteration for both runs of a draw): what stays
is the dispatch's difference, provided running a draw again changes both engines alike. These
ratios use the job's iteration times (from a barrier to the last rank's return), the engine's own
comparison its own clock, so the two can differ by a little.

Beside each row, the replay (``plan.sim.ready.replay_varying``) from measured op times: each
iteration's table is the ms each op (F, B, W per stage and micro-batch) took in that row's engine
in that iteration; stock's order (DeepSpeed's 1F1B, ordered, backward fused) and the row's (its
plan, ordered, or ready with the plan's caps) are replayed on it, and "replay: stock / row" is the
median over the row's iterations. "share of gain" is the part of the predicted gain measured,
(measured - 1) / (predicted - 1) of the two speed-ups (none where the replay predicts less than 1 %); the
JSON also holds their quotient (``speedup_quotient``), which reads near 1 for any small gain. Stock's own forward
and fused backward passes are timed too: "replay, stock's own ops" replays stock's order on those
instead (its backward as one op), so that each engine is replayed on its own ops, and "share, own ops" is the
part of that replay's gain measured: what the dispatch keeps of what its replay allows, with what our ops
cost beyond stock's already in the prediction. "ops: row / stock" is the sum of the row's op times over
stock's in the same iteration (what the split backward and our ops cost beyond stock's). The JSON also holds
each iteration's pair and the largest loss difference between the engines (they train alike).
``--malloc caching`` runs every job with glibc settings that keep freed memory, as a GPU's caching
allocator does (``_util.CACHING_MALLOC``); under the default, memory a backward frees goes back to
the system and the next pass faults it in again, which costs a split backward more (what B keeps
for W is memory the fused one would have reused). Prints one table and writes JSON (with
``/proc/loadavg`` before and after).
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

from _util import CACHING_MALLOC, check_out, exit_on_bad_input, gain_share, print_table, write_json  # noqa: E402
from ds_pipemorph.fileio import BadInput  # noqa: E402
from ds_pipemorph.procs import torchrun  # noqa: E402

JOB = HERE.parent / "_common" / "_varlen_job.py"
WORKLOADS = ("multimodal", "varlen")
HINTS = {"zb": "BFW", "1f1b": "BF"}
# Our engine's settings, one job each per sitting: key -> (plan, pipemorph.backward). RRFP's BF is the
# ``1f1b`` hint with B and W as one pass; our 1F1B order with B and W apart sends each input gradient
# before its W (``--bf-backward`` picks either or both).
VARIANTS = {"zb": ("zb", "split"), "1f1b-fused": ("1f1b", "fused"), "1f1b-split": ("1f1b", "split")}
LABELS = {"zb": ("ours ordered zb", "ours ready zb (BFW)"),
          "1f1b-fused": ("ours ordered 1f1b, fused", "ours ready 1f1b, fused (BF)"),
          "1f1b-split": ("ours ordered 1f1b, split", "ours ready 1f1b, split")}
TARGET_SHARE = 0.90
ROWS = ["stock 1F1B", *(name for key in ("1f1b-fused", "1f1b-split", "zb") for name in LABELS[key])]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def run_job(workload: str, ranks: int, variant: str, args, tmp: Path, name: str) -> dict:
    out = tmp / f"{name}.json"
    hint, backward = VARIANTS[variant]
    cmd = [*torchrun(tmp / f"{name}-torchrun", "--standalone", f"--nproc_per_node={ranks}", str(JOB)),
           "--workload", workload, "--hint", hint, "--micro-batches", str(args.micro_batches),
           "--batch", str(args.batch), "--seq", str(args.seq), "--d-model", str(args.d_model),
           "--heads", str(args.heads), "--blocks", str(args.blocks), "--warmup", str(args.warmup),
           "--iterations", str(args.iterations), "--out", str(out),
           "--backward", backward]
    if args.budget is not None:
        cmd += ["--budget", str(args.budget)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(CACHING_MALLOC if args.malloc == "caching" else {})}  # both engines: they share each job
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if p.returncode or not out.exists():
        raise SystemExit(f"{name}: the job failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(out.read_text())


def variant_of(row: dict) -> str:
    """The ``VARIANTS`` key of one of our rows in a job's JSON (its plan and backward)."""
    return next(k for k, v in VARIANTS.items() if v == (row["row"], row.get("backward", "split")))


def label(variant: str, side: str) -> str:
    return LABELS[variant][side == "B"]


def pairs(job: dict) -> dict[str, list[dict]]:
    """Row label -> per measured iteration: stock's ms, the row's ms, the replay's ms of both from
    the op times the row's engine measured in that iteration."""
    from ds_pipemorph.plan.ir.links import DIRECT
    from ds_pipemorph.plan.ir.ops import parse_stage, peak_inflight
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
    from ds_pipemorph.plan.sim.ready import replay_varying

    S, N, warm = job["ranks"], job["args"]["micro_batches"], job["args"]["warmup"]
    costs = Costs.uniform(S, 1.0)
    stock = next(r for r in job["rows"] if r["row"] == "stock")
    out: dict = {}
    for r in job["rows"]:
        if r["row"] == "stock":
            continue
        plan = [parse_stage(stage) for stage in r["plan"]]
        for k in range(warm, len(r["times_ms"])):
            ms = {(s, kind, m): t for s, kind, m, t in r["ops"][k]}

            def table(s, kind, m, ms=ms):
                return ms[(s, getattr(kind, "value", kind), m)]
            ready = r["sides"][k] == "B"
            stock_replay = replay_varying(deepspeed_1f1b(S, N), costs, N, dispatch="ordered", op_times=table,
                                          fused_backward=True, link_model=DIRECT).iteration_ms
            row_replay = replay_varying(plan, costs, N, dispatch="ready" if ready else "ordered",
                                        caps=peak_inflight(plan) if ready else None, op_times=table,
                                        fused_backward=r.get("backward") == "fused", link_model=DIRECT).iteration_ms
            own = {(s, kind, m): t for s, kind, m, t in stock["ops"][k]}

            def stock_table(s, kind, m, own=own):  # its fused backward as B, W nothing
                kind = getattr(kind, "value", kind)
                return own[(s, "F", m)] if kind == "F" else own[(s, "BW", m)] if kind == "B" else 0.0
            stock_own = replay_varying(deepspeed_1f1b(S, N), costs, N, dispatch="ordered", op_times=stock_table,
                                       fused_backward=True, link_model=DIRECT).iteration_ms
            out.setdefault(label(variant_of(r), r["sides"][k]), []).append(
                {"iteration": k, "stock_ms": stock["times_ms"][k], "row_ms": r["times_ms"][k],
                 "stock_replay_ms": stock_replay, "row_replay_ms": row_replay, "stock_own_replay_ms": stock_own,
                 "row_ops_ms": sum(ms.values()), "stock_ops_ms": sum(own.values())})
    return out


def summarize(jobs: list[dict]) -> dict:
    """Per row: stock / row per iteration (median, 95 % interval), the replay's stock / row per
    iteration (median), the part of the predicted gain measured (share) and their quotient; mean ms
    of both; the engines' own ready/ordered comparisons (B/A with its 95 % interval); the largest
    loss difference between the engines."""
    from ds_pipemorph.paired import bootstrap_median

    per: dict = {}
    paired, stock_ms, loss_diff = {}, [], 0.0
    for job in jobs:
        for k, v in pairs(job).items():
            per.setdefault(k, []).extend(v)
        stock = next(r for r in job["rows"] if r["row"] == "stock")
        stock_ms += stock["times_ms"][job["args"]["warmup"]:]
        for r in job["rows"]:
            if r["row"] != "stock":
                paired.setdefault(variant_of(r), []).append(r["comparison"]["ratio"] if r["comparison"] else None)
                loss_diff = max(loss_diff, max(abs(a - b) for a, b in zip(r["losses"], stock["losses"])))
    # Each draw is trained twice in a row (a pair of ours); stock's second run of a draw over its first is
    # what a second run gains by itself, the control for ready (always second) over ordered (first).
    again = []
    for job in jobs:
        t, warm = next(r for r in job["rows"] if r["row"] == "stock")["times_ms"], job["args"]["warmup"]
        again += [t[i + 1] / t[i] for i in range(warm, len(t) - 1, 2)]
    rows = {"stock 1F1B": {"measured_ms": statistics.fmean(stock_ms), "iterations": len(stock_ms),
                           "predicted_ms": statistics.fmean(p["stock_replay_ms"] for v in per.values() for p in v)}}
    for k in sorted(per, key=ROWS.index):
        v = per[k]
        measured = bootstrap_median([p["stock_ms"] / p["row_ms"] for p in v])
        predicted = statistics.median(p["stock_replay_ms"] / p["row_replay_ms"] for p in v)
        own = statistics.median(p["stock_own_replay_ms"] / p["row_replay_ms"] for p in v)
        rows[k] = {"measured_ms": statistics.fmean(p["row_ms"] for p in v), "iterations": len(v),
                   "predicted_ms": statistics.fmean(p["row_replay_ms"] for p in v),
                   "measured_speedup": measured.median, "measured_interval": [measured.lo, measured.hi],
                   "predicted_speedup": predicted, "share": gain_share(measured.median, predicted),
                   "speedup_quotient": measured.median / predicted,
                   "predicted_speedup_own_ops": own,
                   "share_own_ops": gain_share(measured.median, own),
                   "ops_over_stock_ops": statistics.median(p["row_ops_ms"] / p["stock_ops_ms"] for p in v),
                   "iterations_detail": v}
    second = bootstrap_median(again)
    return {"rows": rows, "ready_over_ordered": paired, "ready_over_ordered_net": net_of_stock(jobs),
            "max_loss_difference": loss_diff,
            "stock_second_over_first": {"median": second.median, "lo": second.lo, "hi": second.hi, "pairs": len(again)}}


def net_of_stock(jobs: list[dict]) -> dict[str, list[dict]]:
    """Per variant, one entry per job: ready over ordered on the same draw (our B over the A before
    it, as the engine's comparison pairs them, in the job's iteration times), stock's second run of
    that draw over its first in the same two iterations, and the first over the second: ready over
    ordered net of what running a draw again changed for stock (each a median with its 95 %
    bootstrap interval). Both engines run every iteration, each in the same place for both runs of
    a draw, so stock's ratio carries what the two iterations differed in besides the dispatch."""
    from ds_pipemorph.paired import bootstrap_median

    out: dict = {}
    for job in jobs:
        stock = next(r for r in job["rows"] if r["row"] == "stock")
        for r in job["rows"]:
            if r["row"] == "stock":
                continue
            t, st, sides = r["times_ms"], stock["times_ms"], r["sides"]
            ks = [k for k in range(job["args"]["warmup"] + 1, len(t)) if sides[k] == "B" and sides[k - 1] != "B"]
            if not ks:
                out.setdefault(variant_of(r), []).append(None)
                continue
            entry = {}
            for name, ratios in (("ours", [t[k] / t[k - 1] for k in ks]), ("stock", [st[k] / st[k - 1] for k in ks]),
                                 ("net", [(t[k] / t[k - 1]) / (st[k] / st[k - 1]) for k in ks])):
                iv = bootstrap_median(ratios)
                entry[name] = {"median": iv.median, "lo": iv.lo, "hi": iv.hi, "pairs": iv.pairs}
            out.setdefault(variant_of(r), []).append(entry)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The main table: 'mean ms' and 'replay ms' per iteration; 'stock / row' measured, paired per "
               "iteration; 'replay: stock / row' what the replay predicts with both engines on our op times, and "
               "'share of gain' the part of that gain measured, (measured - 1) / (predicted - 1), '-' where less "
               "than 1 % is predicted; 'replay, stock's own ops' and 'share, own ops' the same with each engine "
               "replayed on its own op times, which holds what our ops cost beyond stock's; 'ops: row / stock' "
               "the sum of the row's op times over stock's; 'ready / ordered, in-engine B/A' the engine's own "
               "comparison per job. The per-job table: ours ready over ordered on the same draw, stock's second "
               "run of that draw over its first in the same two iterations, and the first over the second.")
    ap.add_argument("--workloads", default="multimodal,varlen",
                    help="comma-separated: multimodal (a quarter of the micro-batches 4x longer on the encoder), "
                         "varlen (language only, lengths from a long tail)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sittings", type=int, default=1, help="jobs per workload and rank count")
    ap.add_argument("--iterations", type=int, default=24, help="measured iterations per engine and job (>= 12)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="windows per micro-batch")
    ap.add_argument("--seq", type=int, default=64, help="the common sequence length")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--budget", type=float, default=None, help="our engine's memory.budget (default: no limit)")
    ap.add_argument("--bf-backward", choices=("both", "fused", "split"), default="both",
                    help="the 1f1b rows' backward (`pipemorph.backward`): fused, B and W in one pass, as RRFP's BF "
                         "and stock run it; split, B then W, the input gradient sent before W; both: a job of each")
    ap.add_argument("--malloc", choices=("glibc", "caching"), default="glibc",
                    help="glibc: this machine's default malloc, which returns large freed blocks to the system; "
                         "caching: keeps freed memory, as a GPU's caching allocator does (both engines alike)")
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
    if args.sittings < 1 or args.warmup < 0 or args.warmup % 2 or args.micro_batches < 2:
        raise BadInput("--sittings must be at least 1, --warmup even and at least 0 (each draw of micro-batches "
                       "is one pair of iterations) and --micro-batches at least 2")
    if any(r < 2 or args.blocks % r for r in args.ranks):
        raise BadInput(f"--ranks: each must be at least 2 and divide --blocks {args.blocks}")
    cores = os.cpu_count() or 1
    variants = ["zb", *(["1f1b-fused"] if args.bf_backward != "split" else []),
                *(["1f1b-split"] if args.bf_backward != "fused" else [])]
    results, table = [], []
    load_before = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for workload in workloads:
            for ranks in args.ranks:
                jobs = []
                for k in range(args.sittings):
                    for variant in variants:
                        t0 = time.monotonic()
                        jobs.append(run_job(workload, ranks, variant, args, Path(tmp), f"{workload}_r{ranks}_{variant}_{k}"))
                        print(f"{workload}, {ranks} ranks, {variant}, sitting {k + 1}: {time.monotonic() - t0:.0f} s "
                              f"(load {loadavg()})", flush=True)
                summary = summarize(jobs)
                note = f"{ranks} ranks" + (f" on {cores} cores (oversubscribed)" if ranks > cores else "")
                results.append({"workload": workload, "ranks": ranks, "cores": cores, **summary,
                                "sittings": [{"shapes": j["shapes"], "rows": [{k: v for k, v in r.items() if k != "ops"}
                                                                              for r in j["rows"]]} for j in jobs]})
                for name, r in summary["rows"].items():
                    variant = next((v for v, names in LABELS.items() if name == names[1]), None)
                    pair = summary["ready_over_ordered"].get(variant) if variant else None
                    pair_text = "-" if not pair else "; ".join(
                        "n/a" if p is None else f"{p['median']:.3f} [{p['lo']:.3f}, {p['hi']:.3f}]" for p in pair)
                    stock_row = name == "stock 1F1B"
                    table.append([workload, note, name, f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}",
                                  "-" if stock_row else "{:.3f} [{:.3f}, {:.3f}]".format(
                                      r["measured_speedup"], *r["measured_interval"]),
                                  "-" if stock_row else f"{r['predicted_speedup']:.3f}",
                                  "-" if stock_row or r["share"] is None else f"{r['share']:.0%}",
                                  "-" if stock_row else f"{r['predicted_speedup_own_ops']:.3f}",
                                  "-" if stock_row or r["share_own_ops"] is None else f"{r['share_own_ops']:.0%}",
                                  "-" if stock_row else f"{r['ops_over_stock_ops']:.3f}", pair_text])
    load_after = loadavg()
    net_rows = []
    for r in results:
        c = r["stock_second_over_first"]
        print(f"{r['workload']}, {r['ranks']} ranks: stock's second run of a draw over its first {c['median']:.3f} "
              f"[{c['lo']:.3f}, {c['hi']:.3f}], {c['pairs']} pairs (ready runs each draw second, ordered first)")
        for variant, entries in r["ready_over_ordered_net"].items():
            for k, e in enumerate(entries):
                if e is not None:
                    net_rows.append([r["workload"], r["ranks"], variant, k + 1,
                                     *("{median:.3f} [{lo:.3f}, {hi:.3f}]".format(**e[name])
                                       for name in ("ours", "stock", "net"))])
    print_table("ready over ordered on the same draw, per job, net of what running the draw again changed for stock "
                "in the same two iterations (below 1: ready faster)",
                ["workload", "ranks", "setting", "job", "ours: ready / ordered", "stock: second / first",
                 "ready / ordered, net"], net_rows)
    print_table(f"stock DeepSpeed 1F1B against ours, GPT recipe blocks, real compute, {args.micro_batches} micro-batches, "
                f"{args.sittings} job(s) x {args.iterations} iterations per engine, paired per iteration, {args.malloc} malloc "
                f"(load {load_before} -> {load_after})",
                ["workload", "ranks", "row", "mean ms", "replay ms", "stock / row [95 %]", "replay: stock / row",
                 "share of gain", "replay, stock's own ops", "share, own ops", "ops: row / stock", "ready / ordered, in-engine B/A"],
                table)
    write_json(args.out, {"benchmark": "varlen_real", "args": vars(args), "loadavg_before": load_before,
                          "loadavg_after": load_after, "target_share": TARGET_SHARE, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
