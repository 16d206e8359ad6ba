"""Real compute, paired inside one job: the GPT recipe's blocks on 2 ranks x 1 thread, our engine in
DeepSpeed's 1F1B order (A) against ``zb`` and ``adaptive`` (B), alternating at iteration boundaries.

    DS_ACCELERATOR=cpu python benchmarks/engine/real_compute_ab.py [--micro-batches 8 16] [--steps 44]
        [--budgets 1,null] [--out out/real_compute_ab.json]

Each row is one training job of ``recipes/gpt/train.py --stages 2`` (the recipe's model: d = 128,
4 blocks, 64-byte windows, 4 windows per micro-batch; fp32, no ZeRO, no checkpointing, so that
the split backward is the one measured; ``OMP_NUM_THREADS=1``, one rank per core) with
``pipemorph.compare`` set to ``1f1b``: the job's schedule is B, the engine's 1F1B order is A, and
the engine's own comparison (``runtime.ab_compare``: the cycle A B A' B, 4 unmeasured iterations,
B/A per pair with its bootstrap 95 % interval) is the row. ``--budgets``: each B schedule runs under
each ``memory.budget`` given (``null``: no limit; the default 1 keeps stock 1F1B's memory, which
leaves ``zb`` little to reorder). The ``adaptive`` job of each row group runs first and writes the
control loop's measured op times (``profile_out``); the replay of the ``zb`` plan and of 1F1B with
them (``plan.sim.simulate``) gives the predicted B/A beside the measured one.

Stock DeepSpeed runs in jobs of its own, so that each engine has the cores to itself: ``--stock-pairs P``
(0 skips it) alternates whole jobs, stock DeepSpeed 1F1B (A) against our engine with ``schedule:
1f1b`` and every other setting at its default (B), in the cycle A B A' B until P B/A pairs
(``ds_pipemorph.paired``), per micro-batch count. Each job is ``_common/_timed_gpt_job.py`` (the
same model, data and config; each ``train_batch`` timed from a barrier to a barrier) and its sample
is the median of its iterations after the first ``--stock-warmup``.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "_common"))  # the shared helpers

from _util import check_out, exit_on_bad_input, print_table, two_rank_job, write_json  # noqa: E402
from ds_pipemorph import paired  # noqa: E402
from ds_pipemorph.fileio import BadInput  # noqa: E402

LINE = re.compile(r"pipemorph compare: B = (\S+), A = (\S+), (\d+) measured iterations: (.*) \(median ([\d.]+) ms "
                  r"against ([\d.]+) ms per iteration\)")
RATIO = re.compile(r"B/A ([\d.]+) \[([\d.]+), ([\d.]+)\]")
TIMES = re.compile(r"^STARTUP_TIMES (\{.*\})$", re.M)


def config(schedule: str, n: int, budget, steps: int, profile: str | None) -> dict:
    section = {"schedule": schedule, "delegation": {"mode": "off"}, "memory": {"budget": budget},
               "compare": {"schedule": "1f1b", "warmup": 4, "iterations": steps - 4}}
    if profile:
        section["profile_out"] = profile
    else:
        section["adapt"] = {"enabled": False}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": n,
            "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "gradient_clipping": 1.0,
            "steps_per_print": 1000000, "pipemorph": section}


def run_job(cfg: dict, steps: int, tmp: Path, name: str) -> tuple[dict, str]:
    m, out = two_rank_job(name, cfg, tmp, ROOT / "recipes" / "gpt" / "train.py",
                          ["--stages", "2", "--steps", str(steps), "--config", "{config}", "--log-every", str(steps)],
                          LINE, "logged no comparison")
    r = RATIO.search(m.group(4))
    return {"b": m.group(1), "a": m.group(2), "measured": int(m.group(3)), "verdict": m.group(4),
            "ratio": [float(r.group(i)) for i in (1, 2, 3)], "b_ms": float(m.group(5)), "a_ms": float(m.group(6))}, out


def stock_whole_jobs(n: int, pairs: int, steps: int, warmup: int, tmp: Path) -> dict:
    """Stock DeepSpeed 1F1B (A) against our engine in 1F1B order with its defaults (B), whole jobs
    alternating; each job's sample is the median of its iterations after ``warmup``."""
    base = {k: v for k, v in config("1f1b", n, 1.0, steps, None).items() if k != "pipemorph"}
    base["pipemorph"] = {"schedule": "1f1b"}
    sides = paired.sequence(len(paired.CYCLE) * paired.cycles_for(pairs))
    samples = []
    for i, side in enumerate(sides):
        args = ["{config}", str(steps)] + (["stock"] if side in paired.A_SIDE else [])
        m, _ = two_rank_job(f"whole_n{n}_{i}", base, tmp, HERE.parent / "_common" / "_timed_gpt_job.py", args,
                            TIMES, "printed no times", timeout=1800)
        times = json.loads(m.group(1))["times"]
        samples.append(statistics.median(times[warmup:]))
    c = paired.compare(sides, samples, warmup=0)
    return {"micro_batches": n, "sides": sides, "job_medians_ms": samples, **c.as_dict()}


def predicted(profile: Path, schedule: str, n: int, budget) -> float | None:
    """B/A of the replay with the op times the control loop measured (None without a profile)."""
    if not profile.exists():
        return None
    from ds_pipemorph.fileio import load_model
    from ds_pipemorph.plan.ir.profile import Profile
    from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
    from ds_pipemorph.plan.sim.simulate import replay
    from ds_pipemorph.runtime.config import parse_config
    from ds_pipemorph.runtime.plans import build_plan

    costs = load_model(str(profile), Profile).costs()
    plan = build_plan(parse_config({"schedule": schedule, "memory": {"budget": budget}}), 2, n)
    return replay(plan, costs, n).iteration_ms / replay(deepspeed_1f1b(2, n), costs, n).iteration_ms


def _budget(text: str):
    if text == "null":
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value >= 1.0:
        raise BadInput(f"--budgets: '{text}' is not a memory budget; use numbers of at least 1, or null")
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--steps", type=int, default=44, help="iterations per job (4 of them unmeasured)")
    ap.add_argument("--schedules", default="zb,adaptive")
    ap.add_argument("--budgets", default="1,null", help="memory.budget values, comma-separated (null: no limit)")
    ap.add_argument("--stock-pairs", type=int, default=6,
                    help="B/A pairs of whole jobs, stock DeepSpeed 1F1B against ours in 1F1B order (0: none)")
    ap.add_argument("--stock-steps", type=int, default=24, help="iterations per whole job")
    ap.add_argument("--stock-warmup", type=int, default=4, help="unmeasured iterations of each whole job")
    ap.add_argument("--out", default="out/real_compute_ab.json")
    args = ap.parse_args()
    check_out(args.out)
    budgets = [_budget(b) for b in args.budgets.split(",")]
    if args.steps < 16:
        raise BadInput(f"--steps {args.steps}: use at least 16 (4 unmeasured and 12 measured iterations: 6 pairs)")
    if min(args.micro_batches) < 2:
        raise BadInput("--micro-batches: use at least 2 per job (a pipeline of 2 stages)")
    if args.stock_pairs < 0 or (args.stock_pairs and args.stock_steps - args.stock_warmup < 1):
        raise BadInput("--stock-pairs/--stock-steps/--stock-warmup: use pairs >= 0 and more steps than warm-up ones")
    unknown = [s for s in args.schedules.split(",") if s not in ("zb", "adaptive")]
    if unknown:
        raise BadInput(f"--schedules: unknown '{unknown[0]}'; use a comma-separated list of zb, adaptive")
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for n in args.micro_batches:
            for budget in budgets:
                profile = tmp / f"n{n}_b{budget}.profile.yaml"  # the adaptive job's measured op times
                for schedule in sorted(args.schedules.split(","), key=lambda s: s != "adaptive"):
                    name = f"{schedule}_n{n}_b{budget}"
                    own = str(profile) if schedule == "adaptive" else None
                    res, _ = run_job(config(schedule, n, budget, args.steps, own), args.steps, tmp, name)
                    # The replay of a fixed plan with the measured op times; adaptive's plan is re-planned
                    # by the job itself from the same measurements, so it has no fixed plan to replay here.
                    pred = predicted(profile, schedule, n, budget) if schedule != "adaptive" else None
                    res.update({"micro_batches": n, "schedule": schedule, "budget": budget, "predicted": pred})
                    results.append(res)
                    lo, hi = res["ratio"][1:]
                    rows.append([n, schedule, "null" if budget is None else f"{budget:g}", f"{res['a_ms']:.1f}",
                                 f"{res['b_ms']:.1f}", f"{res['ratio'][0]:.3f} [{lo:.3f}, {hi:.3f}]",
                                 "-" if pred is None else f"{pred:.3f}"])
        stock = [stock_whole_jobs(n, args.stock_pairs, args.stock_steps, args.stock_warmup, tmp)
                 for n in args.micro_batches] if args.stock_pairs else []
    print_table("our engine in 1F1B order (A) against zb / adaptive (B), GPT recipe blocks, 2 ranks x 1 thread, "
                "paired in one job", ["micro-batches", "B", "budget", "A ms", "B ms", "B/A [95 % CI]",
                                      "replay B/A"], rows)
    if stock:
        print_table("stock DeepSpeed 1F1B (A) against our engine in 1F1B order with its defaults (B), GPT recipe "
                    "blocks, 2 ranks x 1 thread, whole jobs alternating",
                    ["micro-batches", "jobs", "A ms", "B ms", "B/A [95 % CI]", "A'/A [95 % CI]", "verdict"],
                    [[r["micro_batches"], len(r["sides"]), f"{r['a_median_ms']:.1f}", f"{r['b_median_ms']:.1f}",
                      _ci(r["ratio"]), "-" if r["noise"] is None else _ci(r["noise"]), r["verdict"]] for r in stock])
    write_json(args.out, {"benchmark": "real_compute_ab", "steps": args.steps, "results": results,
                          "stock_whole_jobs": stock})
    return 0


def _ci(interval: dict) -> str:
    return f"{interval['median']:.3f} [{interval['lo']:.3f}, {interval['hi']:.3f}]"


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
