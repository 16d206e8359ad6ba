"""The rank side of ``pipemorph bench``: started by torchrun, one rank per stage, one host.

For every scenario (a delay per link, injected as DESIGN.md models a slow link) it probes each
link's one-way delay with timestamped messages (ranks share one host clock), then trains each
schedule for ``warmup + iterations`` iterations on an emulated pipeline (F, B, W each take
``op_ms``, real tiny math) and records per iteration the time from a barrier before
``train_batch`` to the last rank's return. The PipeMorph row is planned by ``search`` from the
probed delays only (never from the injection settings). Rank 0 writes the results as JSON.
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
from ..plan.baselines import deepspeed_1f1b, zb_h1
from ..plan.planfile import PlanFile
from ..plan.profile import Costs, Profile
from ..plan.search import search
from ..plan.simulate import replay
from ..runtime.inject import DelayInjector, DelaySchedule
from ..runtime.transport import DirectTransport
from .spec import BenchSpec

PROBES = 3


def probe_links(spec: BenchSpec, delays: DelaySchedule) -> list[float]:
    """One-way delay per link (median of PROBES stamped messages, paced by an echo)."""
    rank, S = dist.get_rank(), spec.stages
    tr = DelayInjector(DirectTransport(rank, rank, list(range(S)), 60.0), rank, delays, 60.0)
    found = torch.zeros(S - 1, dtype=torch.float64)
    for link in range(S - 1):
        samples = []
        for k in range(PROBES):
            if rank == link:
                tr.send("F", k, torch.tensor([time.monotonic()], dtype=torch.float64))
                tr.recv("B", k)
            elif rank == link + 1:
                stamp = tr.recv("F", k)
                samples.append((time.monotonic() - stamp.item()) * 1e3)
                tr.send("B", k, torch.zeros(1))
        if rank == link + 1:
            found[link] = sorted(samples)[len(samples) // 2]
        tr.wait_sends()
        dist.barrier()
    tr.close()
    dist.all_reduce(found)
    return [round(v, 3) for v in found.tolist()]


def build_engine(spec: BenchSpec, schedule: str, links_ms: list[float], plan_path: str):
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
    section = {"delegation": {"mode": "off"}, "adapt": {"enabled": False}, "inject": inject, "nvtx": False}
    section.update({"schedule": "zb"} if schedule == "zb" else {"schedule": "plan", "plan_file": plan_path})
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


def plan_for(spec: BenchSpec, probed: list[float], path: str) -> float:
    """Rank 0 plans for the probed delays (memory relaxed: delegated staging holds activations)."""
    prof = Profile(stages=spec.stages, microbatches=spec.microbatches,
                   compute_ms={"forward": spec.op_ms, "backward_input": spec.op_ms, "backward_weight": spec.op_ms},
                   links_ms=probed)
    res = search(prof.costs(), spec.microbatches, budget_s=1.0, max_evals=3000)
    pf = PlanFile.build(res.schedule, prof)
    write_atomic(path, json.dumps(pf.model_dump(mode="json")))
    return pf.predicted.iteration_ms


def predicted_ms(spec: BenchSpec, schedule: str, costs: Costs, plan_path: str) -> float:
    S, N = spec.stages, spec.microbatches
    if schedule == "stock-1f1b":
        return replay(deepspeed_1f1b(S, N), costs, N, fused_backward=True).iteration_ms
    if schedule == "zb":
        return replay(zb_h1(Costs.uniform(S, spec.op_ms), N), costs, N).iteration_ms
    return replay(load_model(plan_path, PlanFile).ops(), costs, N).iteration_ms


def main(spec_path: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    spec = load_model(spec_path, BenchSpec)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    tmp = os.path.dirname(os.path.abspath(spec.progress_file))  # the run's work directory
    results, step, total = [], 0, len(spec.scenarios) * len(spec.schedules)
    for sc in spec.scenarios:
        delays = DelaySchedule(sc.links_ms)
        probed = probe_links(spec, delays)
        plan_path = os.path.join(tmp, f"plan_{sc.name}.json")
        if rank == 0 and "pipemorph" in spec.schedules:
            plan_for(spec, probed, plan_path)
        dist.barrier()
        costs = Costs.uniform(spec.stages, spec.op_ms, sc.links_ms)
        for schedule in spec.schedules:
            patch = None
            if schedule == "stock-1f1b" and any(sc.links_ms):
                from ..runtime.stock_inject import install

                patch = install(delays)
            engine = build_engine(spec, schedule, sc.links_ms, plan_path)
            times = measure(spec, engine)
            if patch:
                patch["drain"]()
                patch["uninstall"]()
            del engine
            gc.collect()
            dist.barrier()
            step += 1
            if rank == 0:
                results.append({"scenario": sc.name, "links_ms": sc.links_ms, "probed_links_ms": probed,
                                "schedule": schedule, "iterations_ms": times,
                                "median_ms": sorted(times)[len(times) // 2],
                                "predicted_ms": predicted_ms(spec, schedule, costs, plan_path)})
                with open(spec.progress_file, "a") as f:
                    f.write(f"{step} {total} {sc.name} {schedule}\n")
    if rank == 0:
        write_atomic(spec.out, json.dumps({"spec": spec.model_dump(), "results": results}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
