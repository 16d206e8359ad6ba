"""The tiny GPT recipe run N times in a row: does every run exit cleanly?

Each run is ``torchrun --standalone --nproc_per_node 4 recipes/tiny_gpt/train.py --steps S`` on CPU
(DS_ACCELERATOR=cpu, gloo). A run is clean when torchrun exits 0 and its output holds neither
``terminate called`` (a C++ std::thread destroyed while joinable, which aborts the process) nor a
Python ``Traceback``. The table lists every run that was not clean and counts them; the JSON has every
run (exit code, seconds, whether training finished, the abort lines found).

    DS_ACCELERATOR=cpu python benchmarks/launch/recipe_stress.py [--runs 30] [--steps 40] [--out out/recipe_stress.json]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, write_json  # noqa: E402
from ds_pipemorph.procs import torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "tiny_gpt" / "train.py"
RANKS = 4
ABORT = re.compile(r"terminate called|Fatal Python error|core dumped|SIGABRT|Signal 6")
FINISHED = re.compile(r"^loss [\d.]+ -> [\d.]+ over \d+ steps", re.M)


def one_run(steps: int, timeout_s: float) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="recipe-stress-") as logs:
            cmd = torchrun(logs, "--standalone", f"--nproc_per_node={RANKS}", str(TRAIN), "--steps", str(steps))
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        out = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
    seconds = time.monotonic() - t0
    aborts = sorted({line.strip() for line in out.splitlines() if ABORT.search(line)})
    return {"exit_code": code, "seconds": round(seconds, 1), "finished_training": bool(FINISHED.search(out)),
            "aborts": aborts, "traceback": "Traceback" in out,
            "clean": code == 0 and not aborts and "Traceback" not in out,
            "tail": out.strip().splitlines()[-15:] if code != 0 or aborts else []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take before it is killed")
    ap.add_argument("--out", default=str(ROOT / "out" / "recipe_stress.json"))
    args = ap.parse_args()
    if args.runs < 1 or args.steps < 1:
        print("--runs and --steps must be at least 1", file=sys.stderr)
        return 2

    runs = []
    for i in range(1, args.runs + 1):
        r = one_run(args.steps, args.timeout)
        runs.append(r)
        state = "clean" if r["clean"] else f"NOT CLEAN (exit {r['exit_code']}, {'; '.join(r['aborts']) or 'see tail'})"
        print(f"run {i:3d}/{args.runs}: {r['seconds']:6.1f} s  {state}", flush=True)
        if i < args.runs:  # what has run so far, in case the series is stopped
            write_json(args.out, summary(args, runs))

    bad = [(i, r) for i, r in enumerate(runs, 1) if not r["clean"]]
    rows = [[i, r["exit_code"], r["finished_training"], "; ".join(r["aborts"]) or "-", r["traceback"]] for i, r in bad]
    rows.append(["all", f"{len(runs) - len(bad)}/{len(runs)} exit 0 clean", "", f"{sum(bool(r['aborts']) for r in runs)} aborts",
                 ""])
    print_table(f"tiny_gpt recipe, {args.runs} runs x {args.steps} steps on {RANKS} CPU ranks (torchrun)",
                ["run", "exit code", "finished training", "abort lines", "traceback"], rows)
    write_json(args.out, summary(args, runs))
    return 0 if not bad else 1


def summary(args, runs: list[dict]) -> dict:
    seconds = sorted(r["seconds"] for r in runs)
    return {"benchmark": "recipe_stress", "command": " ".join(sys.argv), "runs_planned": args.runs,
            "runs": len(runs), "steps": args.steps, "ranks": RANKS, "clean": sum(r["clean"] for r in runs),
            "aborts": sum(bool(r["aborts"]) for r in runs), "nonzero_exit": sum(r["exit_code"] != 0 for r in runs),
            "median_seconds": seconds[len(seconds) // 2], "per_run": runs}


if __name__ == "__main__":
    sys.exit(main())
