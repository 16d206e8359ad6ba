"""A real interface failure in the lab: one node's interface goes down while a 4-node job trains.

Two networks (``two``): every link goes through the delegates (``delegation.mode: always``) with
``delegation.interfaces: [eth0, eth1]``; the ranks' own process group (barriers, the loss broadcast)
runs on the second network (eth1, node 0's address there as the master), as a cluster keeps its
control traffic on a management network. After ``--fault-after`` iterations node 2's eth0 goes down
(``ip link set eth0 down`` in its namespace): the delegate pairs of links 1 and 2 lose their
connections and must meet again on eth1. The job must finish, its parameters equal to a fault-free
run of the same job (same lab, before the fault run) within 1e-6, and the log must name the link and
the interface it moved to.

One network (``one``): the same fault with everything on eth0 (no other interface to move to): the
job must end with one clear error naming the link within the engine's ``timeout_s``, not hang.

    sudo -E DS_ACCELERATOR=cpu python benchmarks/lab/lab_failover.py [--case two|one|both]
        [--iterations 6] [--fault-after 2] [--timeout-s 30] [--out out/lab_failover.json]

Needs root (network namespaces); every namespace is removed when it ends.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _lab_job import NODES, JobResult, JobSpec, Row, run_job  # noqa: E402
from _util import check_out, exit_on_bad_input, print_table, work_folder, write_json  # noqa: E402

from ds_pipemorph.lab import Lab  # noqa: E402

FAULT_NODE = 2  # stage 2: an end of links 1 and 2
OP_MS = 10.0
ACT_ROWS = 2048  # 64 KiB per message
MICROBATCHES = 6


def spec_for(work: Path, name: str, iterations: int, timeout_s: float, interfaces, params: bool) -> JobSpec:
    delegation = {"mode": "always", **({"interfaces": interfaces} if interfaces else {})}
    return JobSpec(rows=[Row(name=name, pipemorph={"schedule": "zb", "delegation": delegation},
                             iterations=iterations)],
                   microbatches=MICROBATCHES, op_ms=OP_MS, act_rows=ACT_ROWS, timeout_s=timeout_s,
                   out=str(work / name / "job.json"), progress=str(work / name / "progress"),
                   params_dir=str(work / name / "params") if params else None)


def fault_at(lab: Lab, after: int, node: int, net: int, when: list):
    """An ``on_progress`` that takes ``node``'s interface on ``net`` down once ``after`` iterations are in."""
    def hook(lines):
        if not when and len(lines) >= after:
            lab.link_down(node, net)
            when.append(time.monotonic())
    return hook


def load_params(path: Path) -> dict:
    import torch

    return {s: torch.load(path / f"stage{s}.pt") for s in range(NODES)}


def max_param_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for s in range(NODES):
        pa, pb = a[s]["params"], b[s]["params"]
        if pa.keys() != pb.keys():
            return float("inf")
        for k in pa:
            worst = max(worst, (pa[k] - pb[k]).abs().max().item())
    return worst


def errors_in(job: JobResult) -> list[str]:
    """The lines of the nodes' logs that report an error of the transport or the engine."""
    out = []
    for text in job.logs:
        for line in text.splitlines():
            if re.search(r"(TransportTimeout|TransportError|timed out|failed|Error:)", line) and "link" in line:
                out.append(line.strip())
    return out


def run_two(work: Path, iterations: int, fault_after: int, timeout_s: float) -> dict:
    """Fault-free and faulted runs, two networks; what the test and the table need."""
    with Lab(nodes=NODES, networks=2) as lab:
        ref = run_job(lab, spec_for(work, "fault-free", iterations, timeout_s, ["eth0", "eth1"], True),
                      work / "fault-free", net=1, port=29641, timeout_s=900)
        when: list = []
        faulted = run_job(lab, spec_for(work, "faulted", iterations, timeout_s, ["eth0", "eth1"], True),
                          work / "faulted", net=1, port=29642, timeout_s=max(300.0, 8 * timeout_s),
                          on_progress=fault_at(lab, fault_after, FAULT_NODE, 0, when))
    res = {"case": "two networks", "fault_free_codes": ref.codes, "faulted_codes": faulted.codes,
           "fault_free_s": round(ref.seconds, 1), "faulted_s": round(faulted.seconds, 1),
           "fault_at_iteration": fault_after, "ref": ref, "faulted": faulted}
    if ref.results and faulted.results:
        res["max_param_diff"] = max_param_diff(load_params(work / "fault-free" / "params"),
                                               load_params(work / "faulted" / "params"))
        res["events"] = faulted.results["rows"][0]["events"]
        res["iteration_ms"] = [round(i["ms"], 1) for i in faulted.results["rows"][0]["iterations"]]
        res["ref_iteration_ms"] = [round(i["ms"], 1) for i in ref.results["rows"][0]["iterations"]]
    return res


def run_one(work: Path, iterations: int, fault_after: int, timeout_s: float) -> dict:
    """The same fault with one network: an error naming the link, within timeout_s."""
    with Lab(nodes=NODES, networks=1) as lab:
        when: list = []
        job = run_job(lab, spec_for(work, "one-network", iterations, timeout_s, None, False),
                      work / "one-network", net=0, port=29643, timeout_s=max(300.0, 6 * timeout_s),
                      on_progress=fault_at(lab, fault_after, FAULT_NODE, 0, when))
        ended = time.monotonic()
    return {"case": "one network", "codes": job.codes, "job": job, "errors": errors_in(job),
            "fault_to_end_s": round(ended - when[0], 1) if when else None, "fault_at_iteration": fault_after}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("two", "one", "both"), default="both")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--fault-after", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=30.0, help="the engine's timeout_s")
    ap.add_argument("--out", default="out/lab_failover.json")
    args = ap.parse_args(argv)
    check_out(args.out)
    work = work_folder("lab-failover-")
    rows, payload = [], {"benchmark": "lab_failover", "timeout_s": args.timeout_s}
    if args.case in ("two", "both"):
        r = run_two(work, args.iterations, args.fault_after, args.timeout_s)
        rows.append(["two networks", r["faulted_codes"], r.get("max_param_diff"), r["faulted_s"], r["fault_free_s"],
                     "; ".join(e for e in r.get("events", []) if "interface" in e)[:200] or "-"])
        payload["two"] = {k: v for k, v in r.items() if k not in ("ref", "faulted")}
        payload["two"]["faulted_log_tail"] = r["faulted"].log_text()[-4000:]
    if args.case in ("one", "both"):
        r = run_one(work, args.iterations, args.fault_after, args.timeout_s)
        rows.append(["one network", r["codes"], "-", r["fault_to_end_s"], "-", (r["errors"] or ["-"])[0][:200]])
        payload["one"] = {k: v for k, v in r.items() if k != "job"}
        payload["one"]["log_tail"] = r["job"].log_text()[-6000:]
    print_table(f"node {FAULT_NODE}'s eth0 down after iteration {args.fault_after}; timeout_s {args.timeout_s:g}",
                ["case", "exit codes", "max |param diff|", "faulted run s (one: fault to end)", "fault-free s",
                 "log"], rows)
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
