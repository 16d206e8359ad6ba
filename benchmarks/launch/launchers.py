"""The tiny GPT recipe on CPU under torchrun and under the deepspeed launcher: same training time?

Runs ``recipes/tiny_gpt/train.py --steps N`` on 4 ranks (DS_ACCELERATOR=cpu, gloo) with

- ``torchrun --standalone --nproc_per_node 4`` (torchrun sets ``OMP_NUM_THREADS=1``),
- ``deepspeed --num_gpus 4`` with ``OMP_NUM_THREADS`` unset (the launcher sets no thread count;
  ``ds_pipemorph.initialize`` gives each rank its share of the cores),
- ``deepspeed --num_gpus 4`` with ``OMP_NUM_THREADS=1`` set by hand (what torchrun's ranks get), and
  with ``OMP_NUM_THREADS`` = the usable cores, torch's own default count per process, i.e. what
  every rank used before ``initialize`` chose (``--no-baseline`` skips these two),

interleaved ``--repeats`` times, and reports the training time rank 0 prints for the N steps (start-up
excluded) and the whole launch, median over repeats. Target: deepspeed and torchrun within 1.2x of
each other.

    DS_ACCELERATOR=cpu python benchmarks/launch/launchers.py [--steps 40] [--repeats 2] [--out out/launchers.json]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, write_json  # noqa: E402
from ds_pipemorph.procs import free_port, torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "tiny_gpt" / "train.py"
RANKS = 4
STEP_LINE = re.compile(r"step\s+(\d+)\s+loss\s+([\d.]+)\s+\(([\d.]+) s\)")
TARGET = 1.2


def launchers(steps: int, baseline: bool, logs: Path) -> dict[str, tuple[list[str], dict]]:
    """name -> (command, environment changes; None as a value removes the variable); torchrun's log
    folders go to ``logs``."""
    cores = len(os.sched_getaffinity(0))
    script = [str(TRAIN), "--steps", str(steps)]
    out = {
        "torchrun": (torchrun(logs, "--standalone", f"--nproc_per_node={RANKS}", *script), {"OMP_NUM_THREADS": None}),
        "deepspeed": ([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(RANKS), "--master_port",
                       "{port}", *script], {"OMP_NUM_THREADS": None}),
    }
    if baseline:  # what initialize's choice should equal, and what every rank ran with before it chose
        out["deepspeed, OMP_NUM_THREADS=1"] = (out["deepspeed"][0], {"OMP_NUM_THREADS": "1"})
        out[f"deepspeed, OMP_NUM_THREADS={cores}"] = (out["deepspeed"][0], {"OMP_NUM_THREADS": str(cores)})
    return out


def run_once(cmd: list[str], changes: dict, timeout: float) -> dict:
    from ds_pipemorph.procs import run_group

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    cmd = [c.replace("{port}", str(free_port())) for c in cmd]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    p = run_group(cmd, timeout, cwd=ROOT, env=env)
    wall = time.monotonic() - t0
    steps = STEP_LINE.findall(p.stdout)
    if p.returncode != 0 or not steps:
        raise SystemExit(f"{cmd[2]} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    last = steps[-1]
    return {"train_s": float(last[2]), "launch_s": round(wall, 2), "steps": int(last[0]),
            "final_loss": float(last[1]), "load_1min": round(load, 2),
            "thread_note": next((line.split("] ")[-1] for line in (p.stdout + p.stderr).splitlines()
                                 if "OMP_NUM_THREADS is unset" in line), None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2, help="runs per launcher, interleaved")
    ap.add_argument("--no-baseline", action="store_true", help="skip the deepspeed run with torch's default threads")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    ap.add_argument("--out", default="out/launchers.json")
    a = ap.parse_args()
    if a.steps < 1 or a.repeats < 1:
        ap.error("--steps and --repeats must be at least 1")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="launchers-") as logs:
        plan = launchers(a.steps, not a.no_baseline, Path(logs))
        for r in range(a.repeats):
            for name, (cmd, changes) in plan.items():
                res = run_once(cmd, changes, a.timeout)
                print(f"[{r + 1}/{a.repeats}] {name}: {res['train_s']:.1f} s for {res['steps']} steps "
                      f"(launch {res['launch_s']:.1f} s, load {res['load_1min']})", flush=True)
                runs.setdefault(name, []).append(res)
    med = {name: statistics.median(x["train_s"] for x in rs) for name, rs in runs.items()}
    ref = med["torchrun"]
    rows = [[name, f"{med[name]:.1f}", f"{statistics.median(x['launch_s'] for x in rs):.1f}",
             " / ".join(f"{x['train_s']:.1f}" for x in rs), f"{med[name] / ref:.2f}x", f"{rs[-1]['final_loss']:.4f}"]
            for name, rs in runs.items()]
    print_table(f"tiny_gpt, {RANKS} CPU ranks, {a.steps} steps ({len(os.sched_getaffinity(0))} usable cores)",
                ["launcher", "train s (median)", "launch s (median)", "train s (runs)", "vs torchrun", "final loss"],
                rows)
    ratio = med["deepspeed"] / ref
    met = max(ratio, 1 / ratio) <= TARGET
    print(f"deepspeed / torchrun: {ratio:.2f}x (target: within {TARGET}x of each other): {'met' if met else 'MISSED'}")
    write_json(a.out, {"steps": a.steps, "ranks": RANKS, "usable_cores": len(os.sched_getaffinity(0)),
                       "median_train_s": med, "deepspeed_over_torchrun": round(ratio, 3), "target_within": TARGET, "met": met,
                       "runs": runs})


if __name__ == "__main__":
    main()
