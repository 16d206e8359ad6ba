"""In-run re-mapping: the ranks take new (stage, replica) coordinates at an iteration boundary.

``new_engine = engine.remap(topology)`` on every rank, between two ``train_batch`` calls, with the
same topology (``runtime.topology_file.load_topology`` of a ``pipemorph place`` output, or any
DeepSpeed ``ProcessTopology`` of the same pipeline and data-parallel sizes). No process restarts:

1. **Exchange.** A rank whose stage changes receives its new stage's whole state (the module's
   ``state_dict``: parameters, buffers, tied modules; the optimizer's per-parameter state and
   group settings, by parameter name; gradients held at the boundary) from the rank that held its
   new coordinate, with the blobs and gloo transfer group live layer migration uses too
   (``runtime.transfer``). A rank that keeps its stage keeps its own state: replicas of a stage are
   identical after a step.
2. **Vote.** Every rank votes on its part; if any failed, every rank keeps the engine it has (the
   old one is returned unchanged) and training goes on.
3. **Rebuild.** Every rank builds the new engine together, through DeepSpeed's own construction: a
   ``PartsPipelineModule`` on the current partition (so migrated layers stay where they are) and the
   new topology, whose ``PipelineParallelGrid`` forms the new data-parallel, pipeline and tied-weight
   groups, and the engine's builder (``runtime.engine_builder``: what ``ds_pipemorph.initialize`` was
   given) with the same config, optimizer and scheduler settings.
   Loading the state follows, and a second vote: if a rank failed, every rank closes the new engine
   and keeps the old one (DeepSpeed's module-level pipeline state is pointed back at it). A rank
   failing *inside* the collective construction (running out of memory, say) is not covered: the
   others wait in the construction until the process group's timeout.
4. **Load.** The module's and the optimizer's state, the scheduler's state, the engine's step and
   sample counters and the running plan go into the new engine; the old one's transport, delegates
   and control loop are closed.

The data each rank loads is its *new* replica's: after a re-mapping, feed ``train_batch`` the batches
of ``new_engine.grid.data_parallel_id``. Refused in one sentence: a client optimizer or scheduler
given as an object (it cannot be rebuilt for new parameters; give the config's, or a callable), a
topology of other sizes, and a ``PipelineModule`` subclass (its own code would be lost).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule

from ..fileio import BadInput, first_line
from . import flat_optimizer
from .clip import freeze_clip_set
from .parts_module import PartsPipelineModule
from .transfer import (Purpose, blob_tags, from_blob, packed_state, recv_blob, rng_kept, send_blob, to_blob,
                       unpacked_state)


@dataclass
class RemapReport:
    ok: bool
    seconds: float
    old: tuple[int, int]  # this rank's (stage, replica) before
    new: tuple[int, int]  # and after (== old when the re-mapping failed)
    bytes_sent: int = 0
    bytes_received: int = 0
    reason: str = ""


def check_remappable(engine, topology) -> None:
    """BadInput (one sentence) if this engine cannot be rebuilt on ``topology``."""
    builder = getattr(engine, "builder", None)
    if builder is None:
        raise BadInput("re-mapping needs an engine made by ds_pipemorph.initialize")
    if type(engine.module) not in (PipelineModule, PartsPipelineModule):
        raise BadInput(f"re-mapping rebuilds the model as a PipelineModule; {type(engine.module).__name__} "
                       f"(a subclass) would lose its own code")
    why = builder.refusal()
    if why:
        raise BadInput(why)
    pp, dp = topology.get_dim("pipe"), topology.get_dim("data")
    if (pp, dp) != (engine.num_stages, engine.grid.data_parallel_size) or topology.world_size() != dist.get_world_size():
        raise BadInput(f"the new topology is {pp} stages x {dp} replicas; the job runs {engine.num_stages} x "
                       f"{engine.grid.data_parallel_size} on {dist.get_world_size()} ranks")


def remap(engine, topology):
    """(the engine to train with from now on, RemapReport); see the module docstring."""
    check_remappable(engine, topology)
    rank = dist.get_rank()
    old_topo = engine.module._topo
    old = old_topo.get_coord(rank)
    new = topology.get_coord(rank)
    t0 = time.perf_counter()
    report = RemapReport(False, 0.0, (old.pipe, old.data), (old.pipe, old.data))
    transfer = engine.transfer
    group = transfer.transfer_group()
    freeze_clip_set(engine, transfer.vote_group())  # clipping keeps counting what it counted so far
    attempt = transfer.next_attempt()
    (tag,) = blob_tags(Purpose.REMAP, attempt)
    state = None
    try:
        # bf16/ZeRO: every rank reads its stage's masters and states once, together with its replicas.
        flat = _flat_snapshot(engine) if flat_optimizer.is_flat(engine.optimizer) else None
        sends = []
        # The rank that takes my old coordinate, if it comes from another stage, gets my state.
        taker = topology.get_rank(pipe=old.pipe, data=old.data)
        if old_topo.get_coord(taker).pipe != old.pipe:
            blob = to_blob(_stage_state(engine, flat))
            report.bytes_sent = blob.numel()
            sends += send_blob(blob, taker, group, tag, drop=transfer.drops(attempt))
        if new.pipe != old.pipe:  # my new coordinate's state comes from its old holder
            blob = recv_blob(old_topo.get_rank(pipe=new.pipe, data=new.data), group, tag, transfer.timeout)
            report.bytes_received = blob.numel()
            state = from_blob(blob)
        else:
            state = _stage_state(engine, flat)
        for w in sends:
            w.wait(transfer.timeout)
        ok = 1
    except Exception as e:  # noqa: BLE001 - any failure is a no vote, never a rank missing from the vote
        report.reason = first_line(e, with_type=True)
        ok = 0
    if not transfer.vote(ok):
        report.seconds = time.perf_counter() - t0
        return engine, report
    # Every rank builds the new engine together (DeepSpeed forms its groups collectively), then loads
    # its stage and votes again: the old engine is closed only once every rank has a working new one.
    fresh = None
    saved = _deepspeed_globals()  # DeepSpeed's constructors re-point them at the new engine
    try:
        with rng_kept(engine.device):  # building draws initial weights: not from training's generators
            fresh = _rebuild(engine, topology, state)
        _load_stage(fresh, state)
        ok = 1
    except Exception as e:  # noqa: BLE001
        report.reason = first_line(e, with_type=True)
        ok = 0
    if not transfer.vote(ok):
        if fresh is not None:
            fresh.destroy()
        _restore_deepspeed_globals(saved)  # the old engine's evaluation path reads them
        report.seconds = time.perf_counter() - t0
        return engine, report
    for counter in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        setattr(fresh, counter, getattr(engine, counter))
    if engine.lr_scheduler is not None and fresh.lr_scheduler is not None:
        fresh.lr_scheduler.load_state_dict(engine.lr_scheduler.state_dict())
    fresh._set_plan(engine.plan, engine.lowering)
    # DeepSpeed's seed_layers seeds each layer by its index and the module's forward count: carry the
    # count, so layers draw the same random numbers on their new ranks. Without it, a rank continues
    # the random stream of the stage it took over.
    fresh.module.micro_offset = engine.module.micro_offset
    fresh.clip_set = engine.clip_set
    if new.pipe != old.pipe:
        _set_rng(state["rng"], engine.device)
    _hand_over_controllers(engine, fresh, topology)
    engine.destroy()
    report.ok, report.new = True, (new.pipe, new.data)
    report.seconds = time.perf_counter() - t0
    return fresh, report


def _deepspeed_globals() -> dict:
    """Module state DeepSpeed's engine constructor sets for its topology."""
    from deepspeed.runtime.pipe import p2p
    from deepspeed.utils import groups

    return {"p2p": (p2p._grid, p2p._groups), "mpu": getattr(groups, "mpu", None)}


def _restore_deepspeed_globals(saved: dict) -> None:
    from deepspeed.runtime.pipe import p2p
    from deepspeed.utils import groups

    p2p._grid, p2p._groups = saved["p2p"]
    groups.mpu = saved["mpu"]


def _hand_over_controllers(old, fresh, topology) -> None:
    """What the control loops learned survives the re-mapping: the adapter's plan in force, the
    rebalance loop's layer costs and reference (the partition is unchanged), the orchestrator's
    placement and that it has acted."""
    if old.adapter is not None and fresh.adapter is not None:
        fresh.adapter.policy.plan_in_force = old.plan
    if old.rebalance is not None and fresh.rebalance is not None:
        fresh.rebalance.rebalancer = old.rebalance.rebalancer
    if old.orchestrate is not None and fresh.orchestrate is not None and old.orchestrate.orchestrator is not None:
        ranks = [[topology.get_rank(pipe=s, data=d) for d in range(topology.get_dim("data"))]
                 for s in range(topology.get_dim("pipe"))]
        old.orchestrate.orchestrator.moved(ranks)
        fresh.orchestrate.orchestrator = old.orchestrate.orchestrator


def _rng_state(device) -> dict:
    out = {"cpu": torch.get_rng_state()}
    if getattr(device, "type", "cpu") == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _set_rng(state: dict, device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and getattr(device, "type", "cpu") == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _flat_snapshot(engine) -> dict:
    """A flat optimizer's state by parameter (``flat_optimizer.snapshot``), its state keys and counts."""
    return {"params": flat_optimizer.snapshot(engine), "keys": flat_optimizer.state_keys(engine.optimizer),
            "steps": flat_optimizer.steps(engine.optimizer)}


def _stage_state(engine, flat=None) -> dict:
    """This rank's stage: module state_dict, optimizer state and groups by parameter name, grads;
    with a flat optimizer (``flat``: ``_flat_snapshot``), each parameter's fp32 master and state."""
    module, opt = engine.module, engine.optimizer
    name_of = {p: n for n, p in module.named_parameters()}
    if flat is not None:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in engine.basic_optimizer.param_groups]
        per_param = {name_of[p]: {"group": st["group"], "grad": None, "state": packed_state(st)}
                     for p, st in flat["params"].items()}
        return {"module": {k: v.detach().cpu() for k, v in module.state_dict().items()}, "groups": hyper,
                "params": per_param, "rng": _rng_state(engine.device), "flat": {"keys": flat["keys"],
                                                                                 "steps": flat["steps"]}}
    groups, per_param = [], {}
    for g, group in enumerate(opt.param_groups):
        groups.append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            st = opt.state.get(p, {})
            per_param[name_of[p]] = {"group": g, "grad": None if p.grad is None else p.grad.detach().cpu(),
                                     "state": packed_state(st)}
    return {"module": {k: v.detach().cpu() for k, v in module.state_dict().items()}, "groups": groups,
            "params": per_param, "rng": _rng_state(engine.device)}


def _rebuild(engine, topology, state: dict):
    """The engine on ``topology``: the same layers, partition, config, optimizer and scheduler
    settings (``engine.builder``); this rank's optimizer groups as the stage it will hold has them
    (``state``)."""
    old = engine.module
    module = PartsPipelineModule(old._layer_specs, list(old.parts), topology=topology, loss_fn=old.loss_fn,
                                 seed_layers=old.seed_layers, seed_fn=old.seed_fn, base_seed=old.base_seed,
                                 checkpointable_layers=old.checkpointable_layers, dynamic_shape=old.dynamic_shape)
    named = dict(module.named_parameters())
    members: list[list] = [[] for _ in state["groups"]]
    for name, sent in state["params"].items():  # a name missing here fails the load, after every collective
        if name in named:
            members[sent["group"]].append(named[name])
    groups = [dict(settings, params=ps) for settings, ps in zip(state["groups"], members)]
    return engine.builder.rebuild(module, groups)


def _load_stage(engine, state: dict) -> None:
    module, opt = engine.module, engine.optimizer
    module.load_state_dict(state["module"])
    params = dict(module.named_parameters())
    if sorted(params) != sorted(state["params"]):
        raise RuntimeError(f"stage {engine.stage_id}: the rebuilt stage has parameters {sorted(params)}, the "
                           f"state received holds {sorted(state['params'])}")
    for g, settings in enumerate(state["groups"]):
        opt.param_groups[g].update(settings)
    device = engine.device
    if "flat" in state:  # bf16/ZeRO: masters and states into the new engine's flat partitions
        states = {params[name]: unpacked_state(sent["state"], device) for name, sent in state["params"].items()}
        flat_optimizer.load(engine, states, state["flat"]["keys"], state["flat"]["steps"])
        return
    for name, sent in state["params"].items():
        p = params[name]
        if sent["grad"] is not None:
            p.grad = sent["grad"].to(device)
        if sent["state"]:
            opt.state[p] = unpacked_state(sent["state"], device)
