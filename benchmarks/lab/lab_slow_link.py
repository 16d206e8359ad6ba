"""PipeMorph's §7.2 setting on a real slow link: 4 lab nodes x 1 stage, link 1 (node 1 <-> node 2)
rate-limited by the kernel (``htb``) in both directions; stock DeepSpeed 1F1B, the static zero-bubble
order and PipeMorph (``schedule: adaptive``, ``delegation: auto``) side by side in one job.

One job (``_lab_job``), six rows on fresh engines, in pairs: each engine first with link 1 unshaped,
then with link 1 at ``--rate``; the launcher changes the link between rows while every rank waits,
so a row never starts under the previous row's setting. Emulated stages (``--op-ms`` per F, B and W
around tiny real math) send real activations and gradients of ``32 * rows`` bytes, sized so that one
message takes ``--message-ms`` on the shaped link (8 S / R).

- ``stock 1F1B``: DeepSpeed's own ``PipelineEngine`` (blocking p2p, fused backward);
- ``zb``: this package's engine with the static ZB-H1 order, every link direct (``delegation: off``);
- ``PipeMorph``: ``schedule: adaptive`` and ``delegation: auto``: the control loop reads the link
  from the engine's own op records and re-plans the warm-up (and moves the link to the delegates
  where its model says that is faster).

Per row: the median iteration time (barrier to the last rank's return from ``train_batch``) over
the measured iterations, after ``--warmup`` unmeasured ones (in which PipeMorph re-plans); per
engine the slow link's cost (shaped over unshaped); per shaped row the speed-up over stock; for
PipeMorph its planner's prediction for the plan it re-planned to, against the measured time (the
prediction error), and the slow link's path. Writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/lab/lab_slow_link.py [--rate 100mbit] [--message-ms 40]
        [--op-ms 20] [--microbatches 8] [--iterations 8] [--warmup 6] [--out out/lab_slow_link.json]

``--model gpt``: real compute instead of emulated stages. 2 lab nodes x 1 stage (one rank per core,
one intra-op thread each), the GPT recipe's model cut by its blocks (``recipes/gpt/model.py``: tied
embedding, 4 blocks, d = 128) on windows of the recipe's data, ``--gpt-batch`` (4) 64-byte windows
per micro-batch, so one message is ``gpt-batch * 64 * 128`` float32 values (128 KiB); the slow link
is link 0, the only one, and its rate is the one at which a message takes ``--message-ms`` (40 ms:
about 26 mbit) unless ``--rate`` is given. F, B and W are the blocks' own times, so the stages, the
engine's threads, gloo and the delegates all compete for the two cores; ``--op-ms`` is unused, and
the static rows' predictions replay their orders with the op times our engine measured in the
``zb / unshaped`` row (their medians per stage). The tied embedding's gradient (the same 128 KiB)
is all-reduced over the shaped link once per iteration, a cost no replay counts. A 40 ms message
makes the link a bandwidth limit, not a delay: each direction carries ``--microbatches`` x 8 S / R
of wire per iteration whatever the order (320 ms with the defaults, more than the compute), so
instead of §7.2's goals the script prints that bound beside PipeMorph's shaped time.

    DS_ACCELERATOR=cpu python benchmarks/lab/lab_slow_link.py --model gpt [--message-ms 40] [--gpt-batch 4]

Run as root (network namespaces); every namespace is removed when it ends.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _lab_job import JobSpec, Row, add_link_options, gpt_message_bytes, rows_for, run_job  # noqa: E402
from _util import check_out, exit_on_bad_input, keep, print_table, work_folder, write_json  # noqa: E402

from ds_pipemorph.fileio import BadInput  # noqa: E402
from ds_pipemorph.lab import Lab  # noqa: E402
from ds_pipemorph.lab.shape import format_rate, parse_rate  # noqa: E402
from ds_pipemorph.plan.ir.links import DIRECT, Delegated  # noqa: E402
from ds_pipemorph.plan.ir.profile import Costs  # noqa: E402
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, zb_h1  # noqa: E402
from ds_pipemorph.plan.sim.simulate import replay  # noqa: E402

SLOW_LINK = {"emulated": 1, "gpt": 0}  # per model: the middle link (nodes 1-2 of 4), the only one (nodes 0-1 of 2)
DEFAULT_RATE = "100mbit"  # the emulated model's; the gpt model's follows from its message size and --message-ms
ENGINES = {  # label -> how the row runs
    "stock 1F1B": {"stock": True},
    "zb": {"pipemorph": {"schedule": "zb", "delegation": {"mode": "off"}}},
    "PipeMorph": {"pipemorph": {"schedule": "adaptive", "delegation": {"mode": "auto"}}},
}
CALM, SLOW = "unshaped", "shaped"


def rows(iterations: int) -> list[Row]:
    return [Row(name=f"{label} / {setting}", iterations=iterations, setting=setting, **how)
            for label, how in ENGINES.items() for setting in (CALM, SLOW)]


def predicted_static(label: str, ops: Costs, slow: int, microbatches: int, link_ms: float) -> float | None:
    """The replay's time for the static orders with op times ``ops``, link ``slow`` costing
    ``link_ms`` per message: for stock, the sender holds it (DeepSpeed's blocking p2p); for zb, one
    FIFO whose sender never waits (gloo's isend, the model the control loop uses for this transport)."""
    S = ops.stages
    costs = ops.with_links([link_ms if k == slow else 0.0 for k in range(S - 1)])
    if label == "stock 1F1B":
        return replay(deepspeed_1f1b(S, microbatches), costs, microbatches, fused_backward=True,
                      link_model=DIRECT).iteration_ms
    if label == "zb":
        return replay(zb_h1(ops, microbatches), costs, microbatches, link_model=Delegated(1)).iteration_ms
    return None


def measured_ops(row: dict, warmup: int, microbatches: int) -> Costs:
    """Per stage, the median over the measured iterations of its F, B and W per micro-batch, from our
    engine's op records (the stock engine keeps none)."""
    its = row["iterations"][warmup:]
    per = lambda kind, s: statistics.median(i["ops"][s][f"{kind}_ms"] for i in its) / microbatches  # noqa: E731
    stages = range(len(its[0]["ops"]))
    return Costs([per("F", s) for s in stages], [per("B", s) for s in stages], [per("W", s) for s in stages],
                 [0.0] * (len(stages) - 1))


def summarize(row: dict, warmup: int, slow: int) -> dict:
    its = row["iterations"][warmup:]
    ms = [i["ms"] for i in its]
    out = {"row": row["name"], "median_ms": round(statistics.median(ms), 1),
           "range_ms": [round(min(ms), 1), round(max(ms), 1)], "iteration_ms_all": [round(x, 1) for x in ms],
           "slow_link_path": its[-1]["modes"][slow]}
    links = [i["estimated_links_ms"][slow] for i in its if i.get("estimated_links_ms")]
    out["estimated_slow_link_ms"] = round(statistics.median(links), 1) if links else None
    replans = row.get("replans") or []
    if replans:
        last = replans[-1]
        after = [i["ms"] for i in its if i["iteration"] > last["iteration"]]  # measured, under that plan
        out["replans"] = [{"iteration": r["iteration"], "kind": r["kind"], "measured_links_ms": r["measured_ms"],
                           "predicted_ms": round(r["predicted_ms"], 1), "warmup": r["warmup"]} for r in replans]
        out["planner_predicted_ms"] = round(last["predicted_ms"], 1)
        if after:
            measured = statistics.median(after)
            out["planner_measured_ms"] = round(measured, 1)
            out["planner_error"] = round(measured / last["predicted_ms"] - 1, 3)
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_link_options(ap, iterations=8, warmup=6, out="out/lab_slow_link.json")
    ap.set_defaults(rate=None)  # per model, below
    ap.add_argument("--model", default="emulated", help="emulated (4 nodes, sleeps) or gpt (2 nodes, real compute)")
    ap.add_argument("--gpt-batch", type=int, default=4, help="64-byte windows per micro-batch of --model gpt")
    args = ap.parse_args(argv)
    if args.model not in SLOW_LINK:
        raise BadInput(f"--model: unknown '{args.model}'; use emulated or gpt")
    if args.gpt_batch < 1 or args.message_ms <= 0:
        raise BadInput("--gpt-batch and --message-ms must be positive")
    return args


def link_rate(args) -> int:
    """--rate, or by default: 100 mbit for the emulated model (its message is sized to the rate), and
    for the gpt model (its message is the model's) the rate at which one message takes --message-ms."""
    if args.rate is not None:
        return parse_rate(args.rate)
    if args.model == "gpt":
        return round(8 * gpt_message_bytes(args.gpt_batch) / (args.message_ms / 1e3))
    return parse_rate(DEFAULT_RATE)


def job_spec(args, rate: int) -> JobSpec:
    return JobSpec(rows=rows(args.warmup + args.iterations), microbatches=args.microbatches, op_ms=args.op_ms,
                   act_rows=rows_for(args.message_ms / 1e3, rate), timeout_s=args.timeout_s,
                   model=args.model, gpt_batch=args.gpt_batch, out="", progress="")


def op_costs(args, spec: JobSpec, by: dict) -> Costs:
    """The op times the static rows' predictions replay: the emulated stage's, or the gpt model's as
    our engine measured them unshaped."""
    if args.model == "gpt":
        return measured_ops(by[f"zb / {CALM}"], args.warmup, args.microbatches)
    return Costs.uniform(spec.nodes, args.op_ms)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_out(args.out)
    rate = link_rate(args)
    spec = job_spec(args, rate)
    slow = SLOW_LINK[args.model]
    work = work_folder("lab-slow-link-")
    spec.out, spec.progress = str(work / "job.json"), str(work / "progress")
    wire_ms = 8 * spec.message_bytes / rate * 1e3
    applied = []

    with Lab(nodes=spec.nodes) as lab:
        def on_setting(index: int, setting: str) -> None:
            if setting == SLOW:
                lab.shape(slow, slow + 1, rate, both=True)
            else:
                lab.unshape(slow, slow + 1, both=True)
            applied.append({"row": index, "setting": setting, "rate": lab.rate(slow, slow + 1)})

        job = run_job(lab, spec, work, on_setting=on_setting)
    if job.results is None or any(c != 0 for c in job.codes):
        print(job.log_text()[-6000:], file=sys.stderr)
        print(f"a rank failed (exit codes {job.codes}); logs under {keep(work)}", file=sys.stderr)
        if job.results is None:
            return 1
    table = [summarize(r, args.warmup, slow) for r in job.results["rows"]]
    by = {t["row"]: t for t in table}
    ops = op_costs(args, spec, {r["name"]: r for r in job.results["rows"]})
    lines = []
    for label in ENGINES:
        calm, shaped = by[f"{label} / {CALM}"], by[f"{label} / {SLOW}"]
        stock = by[f"stock 1F1B / {SLOW}"]["median_ms"]
        shaped["predicted_ms"] = predicted_static(label, ops, slow, args.microbatches, wire_ms)
        calm["predicted_ms"] = predicted_static(label, ops, slow, args.microbatches, 0.0)
        shaped["vs_own_unshaped"] = round(shaped["median_ms"] / calm["median_ms"], 3)
        shaped["speedup_vs_stock"] = round(stock / shaped["median_ms"], 3)
        for t in (calm, shaped):
            pred = t.get("planner_predicted_ms", t.get("predicted_ms"))
            lines.append([t["row"], t["median_ms"], f"{t['range_ms'][0]}-{t['range_ms'][1]}",
                          t.get("vs_own_unshaped", "-"), t.get("speedup_vs_stock", "-"),
                          "-" if pred is None else round(pred, 1),
                          "-" if t.get("planner_error") is None else f"{100 * t['planner_error']:+.1f} %",
                          t["slow_link_path"],
                          t["estimated_slow_link_ms"] if t["estimated_slow_link_ms"] is not None else "-"])
    stages = (f"F=B=W={args.op_ms:g} ms" if args.model == "emulated" else
              f"GPT recipe blocks on {spec.nodes} nodes x 1 thread, {args.gpt_batch} windows per micro-batch")
    print_table(f"link {slow} at {format_rate(rate)} both ways, {spec.message_bytes} B per message "
                f"(8S/R = {wire_ms:.1f} ms), {stages}, {args.microbatches} micro-batches; medians of "
                f"{args.iterations} iterations after {args.warmup}",
                ["row", "iteration ms", "range", "x own unshaped", "speed-up vs stock", "predicted ms",
                 "PipeMorph planner error", f"link {slow} path", f"estimator link {slow} ms"], lines)
    pm = by[f"PipeMorph / {SLOW}"]
    for r in pm.get("replans", []):
        print(f"PipeMorph re-planned after iteration {r['iteration']} ({r['kind']}): links read "
              f"{[round(x, 1) for x in r['measured_links_ms']]} ms, warm-up {r['warmup']}, "
              f"predicted {r['predicted_ms']} ms")
    wire_bound = args.microbatches * wire_ms
    if args.model == "emulated":
        print(f"goals: PipeMorph shaped / unshaped = {pm['vs_own_unshaped']} (goal <= 1.15); "
              f"speed-up over stock = {pm['speedup_vs_stock']} (goal >= 1.5)")
    else:  # the link, not its latency, bounds the shaped rows: no order hides bytes that do not fit
        print(f"the link alone: {args.microbatches} messages x {wire_ms:.1f} ms = {wire_bound:.0f} ms per direction "
              f"and iteration; PipeMorph shaped at {pm['median_ms']} ms is {pm['median_ms'] / wire_bound:.2f}x that, "
              f"{pm['speedup_vs_stock']}x faster than stock")
    write_json(args.out, {"benchmark": "lab_slow_link", "model": args.model, "nodes": spec.nodes,
                          "lab": lab.lab_id, "slow_link": slow, "rate_bits": rate, "gpt_batch": args.gpt_batch,
                          "message_bytes": spec.message_bytes, "wire_ms": wire_ms, "wire_bound_ms": wire_bound,
                          "op_ms": args.op_ms, "microbatches": args.microbatches,
                          "warmup": args.warmup, "iterations": args.iterations, "exit_codes": job.codes,
                          "settings_applied": applied, "job_seconds": round(job.seconds, 1),
                          "op_costs_ms": {"F": ops.f, "B": ops.b, "W": ops.w},
                          "goals": {"pipemorph_vs_own_unshaped": pm["vs_own_unshaped"],
                                    "pipemorph_speedup_vs_stock": pm["speedup_vs_stock"]},
                          "summary": table, "rows": job.results["rows"]})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
