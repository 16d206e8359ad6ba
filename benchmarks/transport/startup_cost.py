"""What the delegated transport costs a job whose links stay direct, and what its first slow link
costs: the GPT recipe's blocks on 2 ranks x 1 thread, whole jobs alternating.

    DS_ACCELERATOR=cpu python benchmarks/transport/startup_cost.py [--rounds 3] [--steps 20] [--slow-link-at 1.5]
        [--out out/startup_cost.json]

Start-up: per round, one job with the default ``delegation`` (``auto``) and one with ``delegation:
off``, otherwise the same (the recipe's model, fp32, 8 micro-batches of 4 windows; each
``train_batch`` timed from a barrier to a barrier, ``benchmarks/_common/_timed_gpt_job.py``). The row is each
job's median of iterations 3 to ``--steps`` (the first two build DeepSpeed's and torch's lazy state in
both), the ratio of the two medians per round and that of the two means (a start-up cost lasting a
few iterations shows in the mean, not the median); the goal is within 5 %.

First slow link (``--slow-link-at S``; 0 skips it): one more job per round with the default
``delegation``, whose link gets 30 ms of injected delay per message from S seconds after its first
message on (``inject.trace``): the control loop finds it and moves it to the delegates, which must
start then. The row gives the job's longest iteration after the delay began (the switch, with the
delegates' start, falls in it or next to it) and the median of the last five iterations.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

COMMON = Path(__file__).resolve().parents[1] / "_common"  # the shared helpers
sys.path.insert(0, str(COMMON))

from _util import check_out, exit_on_bad_input, print_table, two_rank_job, write_json  # noqa: E402
from ds_pipemorph.fileio import BadInput  # noqa: E402

LINE = re.compile(r"^STARTUP_TIMES (\{.*\})$", re.M)
REPLAN = re.compile(r"pipemorph: after iteration (\d+) (measured link delays .*?);")
BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "gradient_clipping": 1.0,
        "steps_per_print": 1000000}
SLOW_MS = 30.0


def run_job(section: dict, steps: int, tmp: Path, name: str) -> dict:
    m, out = two_rank_job(name, {**BASE, "pipemorph": section}, tmp, COMMON / "_timed_gpt_job.py",
                          ["{config}", str(steps)], LINE, "printed no times", timeout=1800)
    res = json.loads(m.group(1))
    replan = REPLAN.search(out)
    res["replan"] = None if replan is None else {"after_iteration": int(replan.group(1)), "what": replan.group(2)}
    return res


def slow_trace(tmp: Path, at_s: float) -> str:
    path = tmp / "slow_link.yaml"
    path.write_text(f"points:\n  - {{t: 0.0, links_ms: [0]}}\n  - {{t: {at_s}, links_ms: [{SLOW_MS}]}}\n")
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="iterations per job; iterations 3.. are measured")
    ap.add_argument("--slow-link-at", type=float, default=1.5, help="seconds; 0: no slow-link job")
    ap.add_argument("--out", default="out/startup_cost.json")
    args = ap.parse_args()
    check_out(args.out)
    if args.rounds < 1:
        raise BadInput(f"--rounds {args.rounds}: use at least 1")
    if args.steps < 8:
        raise BadInput(f"--steps {args.steps}: use at least 8 (iterations 3 to 8 and later are measured)")
    if args.slow_link_at < 0:
        raise BadInput(f"--slow-link-at {args.slow_link_at:g}: use seconds >= 0 (0: no slow-link job)")
    rounds, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            auto = run_job({}, args.steps, tmp, f"auto{r}")
            off = run_job({"delegation": {"mode": "off"}}, args.steps, tmp, f"off{r}")
            a, o = (statistics.median(j["times"][2:]) for j in (auto, off))
            am, om = (statistics.mean(j["times"][2:]) for j in (auto, off))
            entry = {"auto": auto, "off": off, "auto_ms": a, "off_ms": o, "ratio": a / o, "auto_mean_ms": am,
                     "off_mean_ms": om, "mean_ratio": am / om}
            row = [r + 1, f"{auto['init_ms'] / 1e3:.1f}", f"{off['init_ms'] / 1e3:.1f}", f"{a:.1f}", f"{o:.1f}",
                   f"{a / o:.3f}", f"{am / om:.3f}"]
            if args.slow_link_at:
                slow = run_job({"inject": {"trace": slow_trace(tmp, args.slow_link_at)}}, args.steps, tmp, f"slow{r}")
                t = slow["times"]
                onset = _onset(t, args.slow_link_at)
                entry.update(slow=slow, slow_onset=onset, slow_max_ms=max(t[onset:]) if onset < len(t) else None,
                             slow_last_ms=statistics.median(t[-5:]))
                replan = slow["replan"]
                row += [str(onset + 1), "-" if replan is None else str(replan["after_iteration"] + 1),
                        "-" if entry["slow_max_ms"] is None else f"{entry['slow_max_ms']:.0f}",
                        f"{entry['slow_last_ms']:.0f}"]
            rounds.append(entry)
            rows.append(row)
    cols = ["round", "init auto s", "init off s", "auto ms", "off ms", "auto / off", "auto / off (means)"]
    if args.slow_link_at:
        cols += ["slow from iteration", "re-planned after", "longest after ms", "last 5 ms"]
    print_table(f"GPT recipe, 2 ranks x 1 thread: medians of iterations 3-{args.steps}, delegation auto (default) "
                f"vs off, whole jobs alternating", cols, rows)
    for what, key in (("medians", "ratio"), ("means", "mean_ratio")):
        ratios = [e[key] for e in rounds]
        print(f"auto / off ({what}): median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-"
              f"{max(ratios):.3f} over {len(ratios)} rounds")
    write_json(args.out, {"benchmark": "startup_cost", "steps": args.steps, "slow_link_at_s": args.slow_link_at,
                          "slow_ms": SLOW_MS, "rounds": rounds})
    return 0


def _onset(times: list[float], at_s: float) -> int:
    """Index of the iteration running when the delay began (the trace's clock starts at the first
    message, near the first iteration's start)."""
    elapsed = 0.0
    for i, t in enumerate(times):
        elapsed += t / 1e3
        if elapsed >= at_s:
            return i
    return len(times)


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
