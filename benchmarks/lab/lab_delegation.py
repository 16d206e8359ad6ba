"""Direct vs delegated transport over a real slow link: 4 lab nodes x 1 stage, link 1 (node 1 <-> node 2)
rate-limited in both directions by the kernel (``htb``), everything else unshaped.

One job (``_lab_job``), three rows on fresh engines, same plan (``schedule: zb``, ZB-H1 warm-up),
emulated stages (``--op-ms`` per F, B and W) sending real activations and gradients of
``32 * rows`` bytes, sized so that one message takes ``--message-ms`` on the shaped link (8 S / R):

- ``reference``: ``delegation.mode: off`` before link 1 is shaped (it is shaped once this row ends);
- ``direct``: ``delegation.mode: off``, gloo in the training process over the slow link;
- ``delegated``: ``delegation.mode: always``, every link through staging rings and delegate processes.

Reported per row (medians over the measured iterations): the iteration time (barrier to the last
rank's return), what the senders on link 1 spend per iteration in their SEND ops and in WaitSends
(stage 1 sends activations over it, stage 2 input gradients), what the receivers spend waiting in
RECV ops, and the link-delay estimator's reading of link 1 (``control.estimate.link_delays`` on the
op records, as PipeMorph's control loop reads it) next to the wire time 8 S / R.

    sudo -E DS_ACCELERATOR=cpu python benchmarks/lab/lab_delegation.py [--rate 100mbit] [--message-ms 40]
        [--op-ms 20] [--microbatches 8] [--iterations 6] [--warmup 2] [--out out/lab_delegation.json]

Needs root (network namespaces); every namespace is removed when it ends.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _lab_job import NODES, JobSpec, Row, add_link_options, rows_for, run_job  # noqa: E402
from _util import check_out, exit_on_bad_input, keep, print_table, work_folder, write_json  # noqa: E402

from ds_pipemorph.lab import Lab  # noqa: E402
from ds_pipemorph.lab.shape import format_rate, parse_rate  # noqa: E402

SLOW_LINK = 1  # joins stage 1 (node 1) and stage 2 (node 2)


def median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


def summarize(row: dict, warmup: int, wire_ms: float) -> dict:
    its = row["iterations"][warmup:]
    a, b = SLOW_LINK, SLOW_LINK + 1  # the link's two ends (ranks = stages = nodes)
    return {
        "row": row["name"], "iteration_ms": median([i["ms"] for i in its]),
        "iteration_ms_all": [round(i["ms"], 1) for i in its],
        "send_ms_stage1": median([i["ops"][a]["send_ms"] for i in its]),
        "wait_sends_ms_stage1": median([i["ops"][a]["wait_sends_ms"] for i in its]),
        "max_send_ms_stage1": median([i["ops"][a]["max_send_ms"] for i in its]),
        "send_ms_stage2": median([i["ops"][b]["send_ms"] for i in its]),
        "wait_sends_ms_stage2": median([i["ops"][b]["wait_sends_ms"] for i in its]),
        "recv_ms_stage2": median([i["ops"][b]["recv_ms"] for i in its]),
        "recv_ms_stage1": median([i["ops"][a]["recv_ms"] for i in its]),
        "estimated_link1_ms": median([i["estimated_links_ms"][SLOW_LINK] for i in its]),
        "estimated_link0_ms": median([i["estimated_links_ms"][0] for i in its]),
        "wire_ms": round(wire_ms, 1),
        "modes": its[-1]["modes"] if its else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_link_options(ap, iterations=6, warmup=2, out="out/lab_delegation.json")
    args = ap.parse_args(argv)
    check_out(args.out)
    rate = parse_rate(args.rate)
    act_rows = rows_for(args.message_ms / 1e3, rate)
    work = work_folder("lab-delegation-")
    n = args.warmup + args.iterations
    rows = [Row(name="reference", pipemorph={"schedule": "zb", "delegation": {"mode": "off"}}, iterations=n),
            Row(name="direct", pipemorph={"schedule": "zb", "delegation": {"mode": "off"}}, iterations=n),
            Row(name="delegated", pipemorph={"schedule": "zb", "delegation": {"mode": "always"}}, iterations=n)]
    spec = JobSpec(rows=rows, microbatches=args.microbatches, op_ms=args.op_ms, act_rows=act_rows,
                   timeout_s=args.timeout_s, out=str(work / "job.json"), progress=str(work / "progress"))
    wire_ms = 8 * spec.message_bytes / rate * 1e3
    shaped = []

    with Lab(nodes=NODES) as lab:
        def shape_after_reference(lines):  # link 1 slows down once the reference row's last iteration is in
            if not shaped and lines[-1]["row"] == 0 and lines[-1]["iteration"] == n - 1:
                lab.shape(SLOW_LINK, SLOW_LINK + 1, rate, both=True)
                shaped.append(lines[-1]["time"])

        job = run_job(lab, spec, work, on_progress=shape_after_reference)
    if job.results is None or any(c != 0 for c in job.codes):
        print(job.log_text()[-6000:], file=sys.stderr)
        print(f"a rank failed (exit codes {job.codes}); logs under {keep(work)}", file=sys.stderr)
        if job.results is None:
            return 1
    table = [summarize(r, args.warmup, wire_ms) for r in job.results["rows"]]
    print_table(f"link 1 at {format_rate(rate)}, {spec.message_bytes} B per message (8S/R = {wire_ms:.1f} ms), "
                f"F=B=W={args.op_ms:g} ms, {args.microbatches} micro-batches; medians of {args.iterations} iterations",
                ["row", "iteration ms", "stage 1 SEND ms", "stage 1 WaitSends ms", "stage 2 SEND ms",
                 "stage 2 WaitSends ms", "stage 2 RECV ms", "stage 1 RECV ms", "estimator link 1 ms", "8S/R ms"],
                [[t["row"], t["iteration_ms"], t["send_ms_stage1"], t["wait_sends_ms_stage1"], t["send_ms_stage2"],
                  t["wait_sends_ms_stage2"], t["recv_ms_stage2"], t["recv_ms_stage1"], t["estimated_link1_ms"],
                  t["wire_ms"]] for t in table])
    write_json(args.out, {"benchmark": "lab_delegation", "rate_bits": rate, "message_bytes": spec.message_bytes,
                          "wire_ms": wire_ms, "op_ms": args.op_ms, "microbatches": args.microbatches,
                          "warmup": args.warmup, "iterations": args.iterations, "exit_codes": job.codes,
                          "job_seconds": round(job.seconds, 1), "summary": table, "rows": job.results["rows"]})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
