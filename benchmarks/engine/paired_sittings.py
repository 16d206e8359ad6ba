"""The same paired comparison in several sittings: do its intervals agree from one run to the next?

Separate jobs on this machine land near one of two speeds, so a ratio of two separate runs can flip
between sittings. Each sitting here is one ``pipemorph paired A B`` run (by default ordered against
ready dispatch of the ``zb`` plan, 4 stages x 12 micro-batches, F = B = W = 10 ms emulated on one CPU
rank per stage): A and B alternate every iteration in one job (A B A' B ...), the result is the
median of per-pair ratios B/A with its bootstrap 95 % interval, next to the A/A noise check. The
table has one row per sitting; below it, whether every pair of sittings' B/A intervals overlap and
whether every A/A interval holds 1. Writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/engine/paired_sittings.py [--a zb] [--b zb+ready] [--sittings 2]
        [--pairs 20] [--warmup 4] [--stages 4] [--microbatches 12] [--op-ms 10] [--links-ms 0,0,0]
        [--out out/paired_sittings.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import exit_on_bad_input, print_table, work_folder, write_json

from ds_pipemorph.paired import cycles_for
from ds_pipemorph.bench.paired_launch import run
from ds_pipemorph.bench.paired_spec import PairedSpec, parse_side


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="zb")
    ap.add_argument("--b", default="zb+ready")
    ap.add_argument("--sittings", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=12)
    ap.add_argument("--op-ms", type=float, default=10.0)
    ap.add_argument("--links-ms", default=None)
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--out", default="out/paired_sittings.json")
    args = ap.parse_args()
    links = [float(x) for x in args.links_ms.split(",")] if args.links_ms else [0.0] * (args.stages - 1)
    sittings = []
    for k in range(args.sittings):
        work = work_folder("pipemorph-paired-")
        spec = PairedSpec(a=parse_side(args.a, "--a"), b=parse_side(args.b, "--b"), stages=args.stages,
                          microbatches=args.microbatches, op_ms=args.op_ms, links_ms=links,
                          cycles=cycles_for(args.pairs), warmup=args.warmup, seed=0,
                          out=str(work / "iterations.json"), progress_file=str(work / "progress"))
        t0 = time.monotonic()
        res = run(spec, work, args.timeout_s)
        res["sitting"], res["wall_s"] = k + 1, round(time.monotonic() - t0, 1)
        sittings.append(res)
        print(f"sitting {k + 1}: {res['comparison']['verdict']} ({res['wall_s']:.0f} s)", flush=True)
    rows = []
    for s in sittings:
        c = s["comparison"]
        r, n = c["ratio"], c["noise"]
        rows.append([s["sitting"], f"{r['median']:.3f}", f"[{r['lo']:.3f}, {r['hi']:.3f}]", r["pairs"],
                     f"{c['a_median_ms']:.1f}", f"{c['b_median_ms']:.1f}",
                     "-" if n is None else f"{n['median']:.3f} [{n['lo']:.3f}, {n['hi']:.3f}]"])
    print_table(f"{args.b} / {args.a}: {args.stages} stages x {args.microbatches} micro-batches, "
                f"F=B=W={args.op_ms:g} ms, links {links} ms, one job per sitting",
                ["sitting", "B/A", "95% interval", "pairs", "A median ms", "B median ms", "A'/A [95%]"], rows)
    ivs = [s["comparison"]["ratio"] for s in sittings]
    overlap = all(x["lo"] <= y["hi"] and y["lo"] <= x["hi"] for x, y in combinations(ivs, 2))
    noise_ok = all(s["comparison"]["noise"] is not None and s["comparison"]["noise"]["lo"] <= 1.0
                   <= s["comparison"]["noise"]["hi"] for s in sittings)
    print(f"B/A intervals of all sittings overlap: {overlap}; every A/A interval holds 1: {noise_ok}")
    write_json(args.out, {"a": args.a, "b": args.b, "intervals_overlap": overlap, "noise_holds_1": noise_ok,
                          "sittings": sittings})


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
