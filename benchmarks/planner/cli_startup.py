"""Whole-process wall time of the planning commands: ``pipemorph --help``, ``pipemorph plan`` on the
4 x 12 profile of PipeMorph Fig. 4 and ``pipemorph simulate`` of that plan, each a fresh process through
the installed console script, as a user runs them. None of them imports torch or deepspeed; the
interpreter's own start-up and ``import torch`` are timed beside them for scale.

Per command: median and minimum wall time over ``--runs`` runs, and the median CPU time (user + system)
of the process, which is less sensitive to other work on the machine. The load average is recorded.

    python benchmarks/planner/cli_startup.py --runs 9
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, write_json

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "recipes" / "profiles" / "paper_fig4.yaml"
TARGET_PLAN_S = 0.5


def pipemorph() -> list[str]:
    """The console script next to this interpreter (what ``pip install`` puts on PATH)."""
    script = Path(sys.executable).parent / "pipemorph"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ds_pipemorph_cli.app"]


def timed(cmd: list[str], cwd: Path) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run of ``cmd``; it must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with code {p.returncode}: {p.stderr.strip()[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=9, help="runs per command (the median is reported)")
    ap.add_argument("--torch-runs", type=int, default=3, help="runs of the `import torch` reference (0: skip)")
    ap.add_argument("--out", default=str(REPO / "out" / "cli_startup.json"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pipemorph-cli-startup-"))
    plan = work / "plan.yaml"
    cli = pipemorph()
    cases = [
        ("python -c pass", [sys.executable, "-c", "pass"], args.runs),
        ("pipemorph --help", cli + ["--help"], args.runs),
        ("pipemorph plan paper_fig4.yaml -o plan.yaml", cli + ["plan", str(PROFILE), "-o", str(plan)], args.runs),
        ("pipemorph simulate plan.yaml --links-ms 0,0,20", cli + ["simulate", str(plan), "--links-ms", "0,0,20"],
         args.runs),
        ("python -c 'import torch' (reference)", [sys.executable, "-c", "import torch"], args.torch_runs),
    ]
    load_before = os.getloadavg()
    rows, results = [], []
    try:
        for name, cmd, runs in cases:
            if runs <= 0:
                continue
            samples = [timed(cmd, work) for _ in range(runs)]
            walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
            res = {"command": name, "argv": cmd, "runs": runs, "median_wall_s": statistics.median(walls),
                   "min_wall_s": min(walls), "median_cpu_s": statistics.median(cpus), "wall_s": walls}
            results.append(res)
            rows.append([name, f"{res['median_wall_s']:.3f}", f"{res['min_wall_s']:.3f}",
                         f"{res['median_cpu_s']:.3f}", runs])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    print_table(f"CLI start-up, whole process (load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, "
                f"{os.cpu_count()} CPUs)", ["command", "median wall s", "min wall s", "median CPU s", "runs"], rows)
    plan_row = next(r for r in results if r["command"].startswith("pipemorph plan"))
    ok = plan_row["median_wall_s"] < TARGET_PLAN_S
    print(f"pipemorph plan: median {plan_row['median_wall_s']:.3f} s, target < {TARGET_PLAN_S} s: "
          f"{'met' if ok else 'NOT met'}")
    write_json(args.out, {"benchmark": "cli_startup", "target_plan_s": TARGET_PLAN_S, "plan_target_met": ok,
                          "load_average_before": load_before, "load_average_after": load_after,
                          "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
