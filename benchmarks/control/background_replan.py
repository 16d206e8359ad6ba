"""A re-plan search beside training: what iterations cost while it runs and after its plan lands.

4 stages, 8 micro-batches, emulated ops of ``--op-ms`` each, the adaptive engine with
``replan: background`` and a search budget of ``--evals`` evaluations (about 20x the default, so the
search outlasts several iterations). Link 2 gets 40 ms of delay from iteration 3 on (a delay
injector around the engine's transport); the engine reacts with Alg. 2's closed-form warm-up, hands
the search to its worker process and switches all ranks to the searched plan when it lands.

Reported from rank 0's wall clock around each ``train_batch``: the median iteration while the search
ran (``typical``), the slowest iteration then and in the three after the switch, each as a ratio to
``typical`` (1.0: the search cost training nothing), and the search's own seconds against
``typical`` (above 1: inline, it would have stalled training for longer than an iteration). Times
are wall clock on a shared machine: the load average is recorded.

    DS_ACCELERATOR=cpu python benchmarks/control/background_replan.py [--out out/background_replan.json]
        [--max-iters 200] [--op-ms 10] [--evals 40000]

Training goes on until three iterations after the search landed (at most ``--max-iters``).

(re-launches itself with ``torchrun --standalone --nproc_per_node 4`` when not started by torchrun).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, relaunch, write_json

STAGES, MICROBATCHES, DELAY_FROM, DELAY_MS = 4, 8, 3, 40.0


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out/background_replan.json"))
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--op-ms", type=float, default=10.0)
    ap.add_argument("--evals", type=int, default=40000)
    args = ap.parse_args()
    if args.max_iters < DELAY_FROM + 8:
        ap.error(f"--max-iters must be at least {DELAY_FROM + 8}, to leave room for the search and the switch.")
    if args.op_ms <= 0 or args.evals < 1:
        ap.error("--op-ms must be above 0 and --evals at least 1.")
    return args


def run(args) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.inject.emulated import EmulatedStage
    from ds_pipemorph.inject.delays import DelaySchedule, install_delays

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    t = args.op_ms
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, t, t, t) for _ in range(STAGES)], num_stages=STAGES,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICROBATCHES,
           "train_batch_size": MICROBATCHES, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9,
           "pipemorph": {"schedule": "adaptive", "memory": {"max_inflight": [8, 6, 4, 2]}, "nvtx": False,
                         "delegation": {"mode": "off"},
                         "adapt": {"replan": "background", "search_evals": args.evals}}}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    delays = DelaySchedule([0.0] * (STAGES - 1))
    install_delays(engine, delays)
    g = torch.Generator().manual_seed(1)
    seconds = []
    for it in range(args.max_iters):
        landed = [r.iteration for r in engine.adapter.replans if r.kind == "refined"]  # the same on every rank
        if landed and it > landed[0] + 3:
            break
        if it == DELAY_FROM:
            delays.static = [0.0, 0.0, DELAY_MS]
        batch = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(MICROBATCHES)]
        t0 = time.perf_counter()
        engine.train_batch(iter(batch))
        seconds.append(time.perf_counter() - t0)
    replans = [vars(r) for r in engine.adapter.replans]
    engine.transport.wait_sends()
    engine.destroy()
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "seconds": seconds, "replans": replans}


def summary(seconds: list[float], replans: list[dict]) -> dict:
    kinds = [r["kind"] for r in replans]
    if "closed-form" not in kinds or "refined" not in kinds:
        return {"complete": False, "kinds": kinds}
    react = next(r for r in replans if r["kind"] == "closed-form")
    refined = next(r for r in replans if r["kind"] == "refined")
    during = seconds[react["iteration"] + 1: refined["iteration"] + 1]
    after = seconds[refined["iteration"] + 1: refined["iteration"] + 4]
    typical = statistics.median(during)
    return {"complete": True, "reacted_after": react["iteration"], "landed_after": refined["iteration"],
            "iterations_beside_search": len(during), "typical_ms": typical * 1e3,
            "max_during_ratio": max(during) / typical, "max_after_ratio": max(after) / typical if after else None,
            "search_s": refined["search_s"], "search_vs_iteration": refined["search_s"] / typical}


def main() -> int:
    args = parse()
    if "LOCAL_RANK" not in os.environ:
        return relaunch(__file__, STAGES)
    res = run(args)
    if res["rank"] != 0:
        return 0
    s = summary(res["seconds"], res["replans"])
    if not s["complete"]:
        print(f"The search did not land within {args.max_iters} iterations (re-plans: {s['kinds']}); "
              "raise --max-iters.", file=sys.stderr)
    else:
        print_table("re-plan search beside training (rank 0 wall clock)",
                    ["reacted after", "landed after", "iters beside", "typical ms", "max during / typ",
                     "max after / typ", "search s", "search / typ"],
                    [[s["reacted_after"], s["landed_after"], s["iterations_beside_search"], f"{s['typical_ms']:.0f}",
                      f"{s['max_during_ratio']:.2f}",
                      "-" if s["max_after_ratio"] is None else f"{s['max_after_ratio']:.2f}",
                      f"{s['search_s']:.2f}", f"{s['search_vs_iteration']:.1f}"]])
    write_json(str(args.out), {"args": {k: str(v) for k, v in vars(args).items()}, "summary": s,
                               "seconds": res["seconds"], "loadavg": os.getloadavg(),
                               "replans": [{k: r[k] for k in ("iteration", "kind", "search_s", "predicted_ms")}
                                           for r in res["replans"]]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
