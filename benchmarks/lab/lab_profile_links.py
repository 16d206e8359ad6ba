"""`pipemorph profile-links --all-pairs` on a real slow link: 4 lab nodes x 1 rank, one pair rate-limited
by the kernel (both directions); the profile must find that pair within 10 % of its configured rate
and no other pair slow in bandwidth. Needs root (it builds a lab).

    python benchmarks/lab/lab_profile_links.py [--rate 100mbit] [--pair 1-2] [--out out/lab_profile_links.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import check_out, exit_on_bad_input, print_table, write_json

from ds_pipemorph.lab import Lab, parse_rate
from ds_pipemorph.procs import torchrun

NODES = 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--pair", default="1-2", help="the shaped pair A-B (both directions)")
    ap.add_argument("--sizes", default="1M,4M,8M", help="large enough that the wire time of the shaped pair dwarfs scheduling noise")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out/lab_profile_links.json")
    args = ap.parse_args()
    check_out(args.out)
    a, b = (int(x) for x in args.pair.split("-"))
    rate = parse_rate(args.rate)
    want_gbs = rate / 8 / 1e9  # GB/s on the wire

    with tempfile.TemporaryDirectory() as tmp, Lab(nodes=NODES) as lab:
        lab.shape(a, b, rate, both=True)
        report = Path(tmp) / "report.json"
        cmd = lambda k: [*torchrun(Path(tmp) / f"torchrun{k}", "--nnodes", str(NODES), "--nproc_per_node", "1"),  # noqa: E731
                         "--node_rank", str(k), "--master_addr", lab.addr(0), "--master_port", "29711",
                         "-m", "ds_pipemorph_cli.app", "profile-links", "--all-pairs", "--sizes", args.sizes,
                         "--reps", str(args.reps), "--report", str(report)]
        procs = [lab.popen(k, cmd(k), env={**os.environ, **lab.node_env(k)}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True) for k in range(NODES)]
        outs = [p.communicate(timeout=900)[0] for p in procs]
        if any(p.returncode for p in procs) or not report.exists():
            print(outs[0][-3000:], file=sys.stderr)
            return 1
        rep = json.loads(report.read_text())

    rows, pairs = [], []
    for e in rep["pairs"]:
        shaped = set(e["ranks"]) == {a, b}
        bws = [e["directions"][d]["fit"]["bandwidth_gbps"] for d in ("down", "up")]
        err = [None if bw is None else (bw - want_gbs) / want_gbs for bw in bws] if shaped else [None, None]
        lat = e["latency_ms"]["median"]
        pairs.append({"ranks": e["ranks"], "shaped": shaped, "bandwidth_gbs": bws, "latency_ms": lat, "slow": e["slow"],
                      "error_vs_rate": err})
        rows.append([f"{e['ranks'][0]}-{e['ranks'][1]}", "yes" if shaped else "", f"{lat:.3f}",
                     " / ".join("-" if x is None else f"{x:.4f}" for x in bws),
                     " / ".join(f"{x:+.1%}" for x in err if x is not None) or "",
                     e["slow"] or ""])
    shaped = next(p for p in pairs if p["shaped"])
    # The lab limits bandwidth and adds no latency: a latency flag on a pair is the machine's scheduling
    # (2 shared cores), reported in the table, not a verdict on the links.
    ok = ("bandwidth" in shaped["slow"] and all(x is not None and abs(x) <= 0.10 for x in shaped["error_vs_rate"])
          and not any("bandwidth" in p["slow"] for p in pairs if not p["shaped"]))
    print_table(f"profile-links --all-pairs on {NODES} lab nodes, pair {a}-{b} limited to {args.rate} "
                f"({want_gbs:.4f} GB/s) both ways", ["pair", "shaped", "latency ms", "GB/s a>b / b>a", "vs rate", "slow"], rows)
    load = os.getloadavg()[0]
    print(f"shaped pair found within 10 % of its rate and no other pair slow in bandwidth: {ok} "
          f"(load average {load:.1f} on {os.cpu_count()} cores)")
    write_json(args.out, {"nodes": NODES, "rate_bit_s": rate, "rate_gbs": want_gbs, "pair": [a, b],
                          "sizes": args.sizes, "reps": args.reps, "pairs": pairs, "ok": ok,
                          "load_average": load, "cores": os.cpu_count()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
