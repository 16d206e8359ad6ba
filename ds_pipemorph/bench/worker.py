"""The rank side of ``pipemorph bench``: started by torchrun, one rank per stage, one host.

For every scenario (a delay per link, injected as DESIGN.md models a slow link) it trains each
schedule for ``warmup + iterations`` iterations on an emulated pipeline (F, B, W each take
``op_ms``, real tiny math) and records per iteration the time from a barrier before
``train_batch`` to the last rank's return. The PipeMorph row is the engine's ``adaptive`` schedule
with its control loop: it measures ops and links itself and re-plans (never reading the injection
settings); the warm-up iterations give it time to act. Rank 0 writes the results as JSON.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ..fileio import load_model, write_atomic
from ..plan.baselines import deepspeed_1f1b
from ..plan.profile import Costs
from ..plan.simulate import replay
from ..runtime.inject import DelaySchedule
from .spec import BenchSpec

def build_engine(spec: BenchSpec, schedule: str, links_ms: list[float]):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.runtime.emulated import EmulatedStage

    torch.manual_seed(0)
    t = spec.op_ms
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, t, t, t) for _ in range(spec.stages)],
                           num_stages=spec.stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": spec.microbatches,
           "train_batch_size": spec.microbatches, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9}
    if schedule == "stock-1f1b":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return engine
    inject = {"links": {str(i): {"delay_ms": c} for i, c in enumerate(links_ms) if c > 0}}
    delegation = {"zb": "off", "zb-delegated": "always", "pipemorph": "auto"}[schedule]
    section = {"schedule": "adaptive" if schedule == "pipemorph" else "zb", "delegation": {"mode": delegation},
               "adapt": {"enabled": schedule == "pipemorph"}, "inject": inject, "nvtx": False}
    cfg["pipemorph"] = section
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def measure(spec: BenchSpec, engine) -> list[float]:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(spec.microbatches)]
    out = []
    for i in range(spec.warmup + spec.iterations):
        dist.barrier()
        t0 = time.monotonic_ns()
        engine.train_batch(iter(data))
        span = torch.tensor([-t0, time.monotonic_ns()], dtype=torch.int64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        if i >= spec.warmup:
            out.append((span[0].item() + span[1].item()) / 1e6)
    return out


def predicted_ms(spec: BenchSpec, schedule: str, costs: Costs, engine) -> float:
    """The replay simulator's time for the plan the schedule ran last, under the injected delays; slow
    links on the direct path are modelled as such (one message in flight, the sender blocks)."""
    S, N = spec.stages, spec.microbatches
    if schedule == "stock-1f1b":
        return replay(deepspeed_1f1b(S, N), costs, N, fused_backward=True, hol=True).iteration_ms
    if schedule == "zb-delegated":
        return replay(engine.plan, costs, N).iteration_ms  # delegated links never block the sender
    if schedule == "pipemorph":  # "auto": links the control loop moved to delegates do not block
        return replay(engine.plan, costs, N, hol=engine.adapter._direct(engine.adapter.detector.planned_for)).iteration_ms
    return replay(engine.plan, costs, N, hol=True).iteration_ms


def main(spec_path: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    spec = load_model(spec_path, BenchSpec)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    results, step, total = [], 0, len(spec.scenarios) * len(spec.schedules)
    for sc in spec.scenarios:
        delays = DelaySchedule(sc.links_ms)
        costs = Costs.uniform(spec.stages, spec.op_ms, sc.links_ms)
        for schedule in spec.schedules:
            patch = None
            if schedule == "stock-1f1b" and any(sc.links_ms):
                from ..runtime.stock_inject import install

                patch = install(delays)
            engine = build_engine(spec, schedule, sc.links_ms)
            times = measure(spec, engine)
            predicted = predicted_ms(spec, schedule, costs, engine)
            adapter = getattr(engine, "adapter", None)
            replans = [vars(r) for r in adapter.replans] if adapter is not None else []
            if patch:
                patch["drain"]()
                patch["uninstall"]()
            engine.destroy()
            del engine
            gc.collect()
            dist.barrier()
            step += 1
            if rank == 0:
                results.append({"scenario": sc.name, "links_ms": sc.links_ms, "schedule": schedule,
                                "iterations_ms": times, "median_ms": sorted(times)[len(times) // 2],
                                "predicted_ms": predicted, "replans": replans})
                with open(spec.progress_file, "a") as f:
                    f.write(f"{step} {total} {sc.name} {schedule}\n")
    if rank == 0:
        write_atomic(spec.out, json.dumps({"spec": spec.model_dump(), "results": results}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
