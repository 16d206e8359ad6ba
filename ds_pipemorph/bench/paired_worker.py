"""The rank side of ``pipemorph paired`` in one job: one engine, two sides switched every iteration.

Started by torchrun, one rank per stage. One ``PipeMorphEngine`` trains the emulated pipeline of
``pipemorph bench`` (F, B, W each ``op_ms`` around real tiny math); before every iteration every
rank switches to that iteration's side (``paired.sequence``: ``A B A' B ...``) the way a re-plan
takes effect, at the iteration boundary: the side's plan and dispatch (``engine.switch_to``) and each
link's transport (``transport.set_link_mode``). The switch is outside the timed span, which runs, as
in ``pipemorph bench``, from a barrier before ``train_batch`` to the last rank's return. Each
iteration leaves its side, its time, its loss and (``record_ops``) every rank's F/B/W order in the
JSON rank 0 writes: what really ran, to check against the side.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..fileio import load_model, write_atomic
from ..paired import A_SIDE, sequence
from ..plan.ir.lower import Dispatch
from ..plan.ir.ops import Kind, parse_op
from ..runtime.shutdown import exit_process
from .paired_spec import PairedSpec, Side


def build_engine(spec: PairedSpec):
    """The engine, built with side A's settings; delegates are prepared if either side uses them."""
    import ds_pipemorph
    from deepspeed.pipe import LayerSpec, PipelineModule

    from ..inject.emulated import EmulatedStage

    torch.manual_seed(0)
    t = spec.op_ms
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, t, t, t) for _ in range(spec.stages)],
                           num_stages=spec.stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    section = spec.a.section(spec.budget)
    if spec.a.delegated or spec.b.delegated:  # links switch between paths: both must exist
        section["delegation"] = {"mode": "auto"}
    delays = {str(i): {"delay_ms": c} for i, c in enumerate(spec.links_ms) if c > 0}
    if delays:
        section["inject"] = {"links": delays}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": spec.microbatches,
           "train_batch_size": spec.microbatches, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9, "pipemorph": section}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def plan_of(side: Side, stages: int, microbatches: int, budget: Optional[float] = 1.0):
    """The plan the engine builds for ``side`` from its ds_config section (the same on every rank)."""
    from ..runtime.config import parse_config
    from ..runtime.plans import build_plan

    return build_plan(parse_config(side.section(budget)), stages, microbatches)


def switch(engine, side: Side, plan, stages: int, budget: Optional[float] = 1.0) -> None:
    """Make ``side`` the configuration of the next ``train_batch`` (every rank, between two batches)."""
    from ..runtime.config import parse_config
    from ..runtime.plans import lowering_for

    engine.switch_to(plan=plan, dispatch=side.dispatch, lowering=lowering_for(parse_config(side.section(budget))))
    mode = "delegated" if side.delegated else "direct"
    for link in range(stages - 1):
        if engine.transport.link_mode(link) != mode:
            engine.transport.set_link_mode(link, mode)


def timed_step(step) -> float:
    """``step()`` from a barrier to the last rank's return, in ms (every rank gets the same value)."""
    dist.barrier()
    t0 = time.monotonic_ns()
    step()
    span = torch.tensor([-t0, time.monotonic_ns()], dtype=torch.int64)
    dist.all_reduce(span, op=dist.ReduceOp.MAX)
    return (span[0].item() + span[1].item()) / 1e6


def posted_before_compute(stream: list[str]) -> dict[str, int]:
    """Receives of each kind (``RECV_F``, ``RECV_B``) in the rank's lowered stream as the engine ran it
    under ordered dispatch (``1RECV_F0``, ``1F0``, ...), before its first F, B or W: the receive
    window the lowering in force gave it (fewer where a kind has fewer receives)."""
    posted = {str(Kind.RECV_F): 0, str(Kind.RECV_B): 0}
    for text in stream:
        op = parse_op(text)
        if op.kind.is_compute:
            break
        if op.kind.is_recv:
            posted[str(op.kind)] += 1
    return posted


def alternate(spec: PairedSpec, engine) -> list[dict]:
    """Run every iteration of ``spec`` on its side; per iteration: side, ms, loss, this rank's ops."""
    sides = sequence(spec.iterations, spec.warmup)
    plans = {"A": plan_of(spec.a, spec.stages, spec.microbatches, spec.budget),
             "B": plan_of(spec.b, spec.stages, spec.microbatches, spec.budget)}
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(spec.microbatches)]
    out = []
    for i, label in enumerate(sides):
        key = "A" if label in A_SIDE else "B"
        side = spec.a if key == "A" else spec.b
        switch(engine, side, plans[key], spec.stages, spec.budget)
        ready_before = len(engine.choosing_ns)
        losses: list[float] = []
        ms = timed_step(lambda: losses.append(float(engine.train_batch(iter(data)).item())))
        ran = [r.op for r in engine.op_records if r.plan_op is not None and r.plan_op.kind.is_compute]
        posted_first = posted_before_compute(engine.executed_stream)
        out.append({"index": i, "side": label, "config": side.text, "ms": ms, "measured": i >= spec.warmup,
                    "loss": losses[0], "dispatch": Dispatch.READY if len(engine.choosing_ns) > ready_before else Dispatch.ORDERED,
                    "links": [engine.transport.link_mode(k) for k in range(spec.stages - 1)],
                    "ops": ran if spec.record_ops else None, "posted_first": posted_first})
        if dist.get_rank() == 0:
            with open(spec.progress_file, "a") as f:
                f.write(f"{i + 1} {len(sides)} {label}\n")
    return out


def main(spec_path: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    spec = load_model(spec_path, PairedSpec)
    from ..staging.builder import prepare_comm_op

    prepare_comm_op()  # DeepSpeed's CPU collectives op, loaded under the build guard before init_distributed does
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build_engine(spec)
    rows = alternate(spec, engine)
    stage = engine.stage_id
    engine.destroy()
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"stage": stage, "ops": [r.pop("ops") for r in rows],
                                      "links": [r.pop("links") for r in rows],
                                      "posted_first": [r.pop("posted_first") for r in rows],
                                      "dispatch": [r.pop("dispatch") for r in rows]})
    if dist.get_rank() == 0:
        stages = {}
        for rank_rows in per_rank:
            stages[str(rank_rows["stage"])] = rank_rows
        for k, r in enumerate(rows):  # what every stage ran in iteration k
            r["stages"] = {s: {"ops": v["ops"][k], "links": v["links"][k], "dispatch": v["dispatch"][k],
                               "posted_first": v["posted_first"][k]}
                           for s, v in sorted(stages.items(), key=lambda kv: int(kv[0]))}
        write_atomic(spec.out, json.dumps({"spec": spec.model_dump(), "iterations": rows}, indent=2))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # releases the groups while nothing holds them (``runtime.shutdown``)
