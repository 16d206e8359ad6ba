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
prediction error), and link 1's path. Writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/lab_slow_link.py [--rate 100mbit] [--message-ms 40]
        [--op-ms 20] [--microbatches 8] [--iterations 8] [--warmup 6] [--out out/lab_slow_link.json]

Run as root (network namespaces); every namespace is removed when it ends.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lab_job import NODES, JobSpec, Row, add_link_options, rows_for, run_job  # noqa: E402
from _util import check_out, exit_on_bad_input, print_table, write_json  # noqa: E402

from ds_pipemorph.lab import Lab  # noqa: E402
from ds_pipemorph.lab.shape import format_rate, parse_rate  # noqa: E402
from ds_pipemorph.plan.ir.links import DIRECT, Delegated  # noqa: E402
from ds_pipemorph.plan.ir.profile import Costs  # noqa: E402
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, zb_h1  # noqa: E402
from ds_pipemorph.plan.sim.simulate import replay  # noqa: E402

SLOW_LINK = 1  # joins stage 1 (node 1) and stage 2 (node 2)
ENGINES = {  # label -> how the row runs
    "stock 1F1B": {"stock": True},
    "zb": {"pipemorph": {"schedule": "zb", "delegation": {"mode": "off"}}},
    "PipeMorph": {"pipemorph": {"schedule": "adaptive", "delegation": {"mode": "auto"}}},
}
CALM, SLOW = "unshaped", "shaped"


def rows(iterations: int) -> list[Row]:
    return [Row(name=f"{label} / {setting}", iterations=iterations, setting=setting, **how)
            for label, how in ENGINES.items() for setting in (CALM, SLOW)]


def predicted_static(label: str, op_ms: float, microbatches: int, link_ms: float) -> float | None:
    """The replay's time for the static orders, link 1 costing ``link_ms`` per message: for stock, the
    sender holds it (DeepSpeed's blocking p2p); for zb, one FIFO whose sender never waits (gloo's isend,
    the model the control loop uses for this transport)."""
    costs = Costs.uniform(NODES, op_ms, [link_ms if k == SLOW_LINK else 0.0 for k in range(NODES - 1)])
    if label == "stock 1F1B":
        return replay(deepspeed_1f1b(NODES, microbatches), costs, microbatches, fused_backward=True,
                      link_model=DIRECT).iteration_ms
    if label == "zb":
        return replay(zb_h1(Costs.uniform(NODES, op_ms), microbatches), costs, microbatches,
                      link_model=Delegated(1)).iteration_ms
    return None


def summarize(row: dict, warmup: int) -> dict:
    its = row["iterations"][warmup:]
    ms = [i["ms"] for i in its]
    out = {"row": row["name"], "median_ms": round(statistics.median(ms), 1),
           "range_ms": [round(min(ms), 1), round(max(ms), 1)], "iteration_ms_all": [round(x, 1) for x in ms],
           "link1_path": its[-1]["modes"][SLOW_LINK]}
    links = [i["estimated_links_ms"][SLOW_LINK] for i in its if i.get("estimated_links_ms")]
    out["estimated_link1_ms"] = round(statistics.median(links), 1) if links else None
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_link_options(ap, iterations=8, warmup=6, out="out/lab_slow_link.json")
    args = ap.parse_args(argv)
    check_out(args.out)
    rate = parse_rate(args.rate)
    spec = JobSpec(rows=rows(args.warmup + args.iterations), microbatches=args.microbatches, op_ms=args.op_ms,
                   act_rows=rows_for(args.message_ms / 1e3, rate), timeout_s=args.timeout_s,
                   out="", progress="")
    work = Path(tempfile.mkdtemp(prefix="lab-slow-link-"))
    spec.out, spec.progress = str(work / "job.json"), str(work / "progress")
    wire_ms = 8 * spec.message_bytes / rate * 1e3
    applied = []

    with Lab(nodes=NODES) as lab:
        def on_setting(index: int, setting: str) -> None:
            if setting == SLOW:
                lab.shape(SLOW_LINK, SLOW_LINK + 1, rate, both=True)
            else:
                lab.unshape(SLOW_LINK, SLOW_LINK + 1, both=True)
            applied.append({"row": index, "setting": setting, "rate": lab.rate(SLOW_LINK, SLOW_LINK + 1)})

        job = run_job(lab, spec, work, on_setting=on_setting)
    if job.results is None or any(c != 0 for c in job.codes):
        print(job.log_text()[-6000:], file=sys.stderr)
        if job.results is None:
            print(f"the job failed (exit codes {job.codes}); logs under {work}", file=sys.stderr)
            return 1
    table = [summarize(r, args.warmup) for r in job.results["rows"]]
    by = {t["row"]: t for t in table}
    lines = []
    for label in ENGINES:
        calm, slow = by[f"{label} / {CALM}"], by[f"{label} / {SLOW}"]
        stock = by[f"stock 1F1B / {SLOW}"]["median_ms"]
        calm["predicted_ms"] = predicted_static(label, args.op_ms, args.microbatches, 0.0)
        slow["predicted_ms"] = predicted_static(label, args.op_ms, args.microbatches, wire_ms)
        slow["vs_own_unshaped"] = round(slow["median_ms"] / calm["median_ms"], 3)
        slow["speedup_vs_stock"] = round(stock / slow["median_ms"], 3)
        for t in (calm, slow):
            pred = t.get("planner_predicted_ms", t.get("predicted_ms"))
            lines.append([t["row"], t["median_ms"], f"{t['range_ms'][0]}-{t['range_ms'][1]}",
                          t.get("vs_own_unshaped", "-"), t.get("speedup_vs_stock", "-"),
                          "-" if pred is None else round(pred, 1),
                          "-" if t.get("planner_error") is None else f"{100 * t['planner_error']:+.1f} %",
                          t["link1_path"], t["estimated_link1_ms"] if t["estimated_link1_ms"] is not None else "-"])
    print_table(f"link 1 at {format_rate(rate)} both ways, {spec.message_bytes} B per message (8S/R = {wire_ms:.1f} ms), "
                f"F=B=W={args.op_ms:g} ms, {args.microbatches} micro-batches; medians of {args.iterations} iterations "
                f"after {args.warmup}",
                ["row", "iteration ms", "range", "x own unshaped", "speed-up vs stock", "predicted ms",
                 "PipeMorph planner error", "link 1 path", "estimator link 1 ms"], lines)
    pm = by[f"PipeMorph / {SLOW}"]
    for r in pm.get("replans", []):
        print(f"PipeMorph re-planned after iteration {r['iteration']} ({r['kind']}): links read "
              f"{[round(x, 1) for x in r['measured_links_ms']]} ms, warm-up {r['warmup']}, "
              f"predicted {r['predicted_ms']} ms")
    print(f"goals: PipeMorph shaped / unshaped = {pm['vs_own_unshaped']} (goal <= 1.15); "
          f"speed-up over stock = {pm['speedup_vs_stock']} (goal >= 1.5)")
    write_json(args.out, {"benchmark": "lab_slow_link", "rate_bits": rate, "message_bytes": spec.message_bytes,
                          "wire_ms": wire_ms, "op_ms": args.op_ms, "microbatches": args.microbatches,
                          "warmup": args.warmup, "iterations": args.iterations, "exit_codes": job.codes,
                          "settings_applied": applied, "job_seconds": round(job.seconds, 1),
                          "goals": {"pipemorph_vs_own_unshaped": pm["vs_own_unshaped"],
                                    "pipemorph_speedup_vs_stock": pm["speedup_vs_stock"]},
                          "summary": table, "rows": job.results["rows"]})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
