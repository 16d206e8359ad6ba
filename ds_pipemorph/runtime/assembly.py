"""How a ``PipeMorphEngine`` is put together: the start-up refusals, then its parts, in one place.

``PipeMorphEngine.__init__`` is a short sequence of the steps below:

1. ``refuse_job``: what is refused before DeepSpeed builds anything (a DeepSpeed without the
   pipeline hooks, fp16 on a device without it, ZeRO above stage 1, torch autocast, what tensor
   parallelism refuses, what a plug-in refuses for this job);
2. DeepSpeed's own ``PipelineEngine.__init__``;
3. ``split_backward``: checkpointed chunks recompute once, in B (``runtime.recompute``);
4. ``router_hooks`` and ``nccl_rules``: the plug-ins' transport hooks and whether the direct path
   runs under NCCL's point-to-point rules;
5. ``refuse_engine``: what is refused once the engine exists, in this order: moving layers or ranks
   under an optimizer that cannot (``moving_refusal``), a checkpointed embedding on the first stage
   (every rank refuses), dispatch "ready" under NCCL's rules, transport hooks out of the stream's
   order under them, a plan for another number of stages;
6. ``assemble``: the engine's parts, set in one place, in the order they depend on each other:
   plan and memory budget, plug-ins' engine hooks, transport, the adapter, timeline, op recorder,
   inbox, the transfer and layer migrator, the rebalance loop and the orchestrator, the boundary
   that runs the loops, the early loss broadcast, the A/B comparison.

Every control loop is built the same way, from the engine and its memory budget
(``Adapter.for_engine``, ``RebalanceLoop``, ``OrchestrateLoop``); their decisions come back from the
boundary as typed values the engine applies in one place (``PipeMorphEngine._apply``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..plan.ir.lower import Dispatch
from . import tensor_parallel
from .ab_compare import Compare
from .adapt import Adapter
from .boundary import Boundary
from .compat import (BUDGET_MB_MOVING_REFUSED, EMBEDDING_REFUSED, FUSED_CHECKPOINTING_REFUSED, MOVING_REFUSED,
                     TORCH_AUTOCAST_REFUSED, fp16_refused, zero_refused)
from .config import PipeMorphConfig, PipeMorphConfigError
from .ds_compat import require_pipeline_hooks
from .flat_optimizer import is_flat
from .grad_reduce import reduction_can_be_identity
from .hooks import TransportHooks, active_plugins, transport_hooks
from .inbox import Inbox
from .migrate import LayerMigrator
from .oprecords import OpRecorder
from .plans import NCCL_READY_REFUSED, lowering_for, memory_budget, w_share
from .recompute import embedding_refusal, split_checkpoint
from .timeline_writer import TimelineWriter
from .train_loss import EarlyLoss, broadcasts_early
from .transfer import Transfer
from .transport.router import build_transport


def nccl_rules(backend: str, delegation_mode: str, hooks: Sequence[TransportHooks] = ()) -> bool:
    """Whether the direct path runs under NCCL's point-to-point rules (``plan.ir.nccl``): on the NCCL
    backend (``"nccl"`` or e.g. ``"cpu:gloo,cuda:nccl"``) or when a plug-in's transport hooks say so
    (``TransportHooks.p2p_rules``, a test double on gloo), unless every link goes through the
    delegates (``delegation.mode`` "always"), whose own gloo groups match by tag. Under these rules
    plans are lowered with ``NcclLowering`` and dispatch is ordered."""
    if delegation_mode == "always":
        return False
    return "nccl" in backend or any(h.p2p_rules == "nccl" for h in hooks)


def unsupported_reason(config_class, model) -> Optional[str]:
    """One sentence if this DeepSpeed setup cannot run split-backward plans, else None (``runtime.compat``)."""
    from deepspeed.accelerator import get_accelerator

    if config_class.float16_config.enabled and not get_accelerator().is_fp16_supported():
        return fp16_refused(get_accelerator().device_name())
    if config_class.zero_optimization_stage > 1:
        return zero_refused(config_class.zero_optimization_stage)
    if getattr(config_class, "torch_autocast_enabled", False):
        return TORCH_AUTOCAST_REFUSED
    return None


def moving_refusal(engine, pipemorph: PipeMorphConfig) -> Optional[str]:
    """One sentence if layers or ranks cannot move under this engine's optimizer or the job's
    ``pipemorph`` section, else None: a bf16/fp16/ZeRO optimizer moves through DeepSpeed's
    per-parameter mapping into its flat partitions (``runtime.flat_optimizer``), which
    ``FP16_Optimizer`` does not keep, and is configured again from the ds_config, which an optimizer
    given to ``initialize`` is not; a ``memory.budget_mb`` grant was converted with the bytes of the
    layers in place."""
    refusal = tensor_parallel.moving_refusal(engine)
    if refusal:
        return refusal
    if pipemorph.memory.budget_mb is not None:
        return BUDGET_MB_MOVING_REFUSED
    wrapped = engine.zero_optimization() or getattr(engine, "using_bf16_optimizer", False) or engine.fp16_enabled()
    if wrapped and (not is_flat(engine.optimizer) or engine.client_optimizer is not None):
        return MOVING_REFUSED
    return None


def out_of_order_refusal(nccl: bool, hooks: Sequence[TransportHooks]) -> Optional[str]:
    """The sentence refusing transport hooks that issue the direct path's operations out of the
    stream's order while NCCL's rules hold (``TransportHooks.keeps_issue_order``); None if none does."""
    if not nccl or all(h.keeps_issue_order for h in hooks):
        return None
    return ("a transport hook issues the direct path's sends or receives out of the stream's order (injected link "
            "delays send from their own thread), which NCCL's in-order point-to-point cannot run: drop "
            "pipemorph.inject's links, trace and rank_links on the NCCL backend, or set pipemorph.delegation.mode "
            "to \"always\"")


def refuse_job(pipemorph: PipeMorphConfig, config_class, model) -> None:
    """Before DeepSpeed builds the engine: raise ``PipeMorphConfigError`` with one sentence for what
    this job cannot run (step 1 of the module docstring)."""
    require_pipeline_hooks()  # a DeepSpeed without them would train its own 1F1B instead of the plan
    reason = unsupported_reason(config_class, model) or tensor_parallel.refusal(config_class, model, pipemorph)
    if reason:
        raise PipeMorphConfigError(reason)
    for plugin, settings in active_plugins(pipemorph):  # plug-ins refuse what this job cannot use
        plugin.check_job(settings, model.num_stages)


def split_backward(engine) -> None:
    """Checkpointed chunks recompute once, in B, and leave their weight gradients for W
    (``runtime.recompute``). Sets ``engine.checkpointing``. (Linear and LayerNorm layers need
    nothing: ``runtime.wgrad_store`` recognises them in the graph the stock modules build.)"""
    engine.checkpointing = engine.module.activation_checkpoint_interval > 0
    if engine.checkpointing:
        engine.module.activation_checkpoint_func = split_checkpoint
        engine.module.is_checkpointable_results_interval = None  # DeepSpeed's choice of chunks depends on it
        engine.module._precompute_checkpointable_values()


def router_hooks(engine, pipemorph: PipeMorphConfig) -> list[TransportHooks]:
    """Plug-ins' router hooks (testing only: injection); one may put the direct path under NCCL's
    rules, which this sets as ``engine.nccl_rules``."""
    hooks = transport_hooks(pipemorph, engine.num_stages, engine=engine)
    engine.nccl_rules = nccl_rules(dist.get_backend(), pipemorph.delegation.mode, hooks)
    return hooks


def refuse_engine(engine, pipemorph: PipeMorphConfig, plan, hooks: Sequence[TransportHooks]) -> None:
    """Once DeepSpeed built the engine: raise ``PipeMorphConfigError`` with one sentence for what it
    cannot run (step 5 of the module docstring). The embedding check is a collective: only the
    first stage can tell, every rank refuses."""
    if pipemorph.rebalance.enabled or pipemorph.orchestrate.matrix:
        refusal = moving_refusal(engine, pipemorph)
        if refusal:
            raise PipeMorphConfigError(refusal)
    if engine.checkpointing and "fused" in (pipemorph.backward, pipemorph.compare.backward):
        raise PipeMorphConfigError(FUSED_CHECKPOINTING_REFUSED)  # (the same on every rank: no collective)
    if engine.checkpointing:
        refusal = embedding_refusal(engine.module, engine.is_first_stage())
        flag = torch.tensor([int(refusal is not None)], device=engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise PipeMorphConfigError(EMBEDDING_REFUSED)
    if engine.nccl_rules and pipemorph.dispatch is Dispatch.READY:
        raise PipeMorphConfigError(NCCL_READY_REFUSED)
    refusal = out_of_order_refusal(engine.nccl_rules, hooks)
    if refusal:
        raise PipeMorphConfigError(refusal)
    if len(plan) != engine.num_stages:
        raise PipeMorphConfigError(f"the plan has {len(plan)} stages but the job has {engine.num_stages}")


def assemble(engine, pipemorph: PipeMorphConfig, plan, builder, hooks: Sequence[TransportHooks]) -> None:
    """Set every part of ``engine`` (step 6 of the module docstring); ``builder``: how to build it
    again (re-mapping), None when ``initialize`` did not make it."""
    engine.pipemorph = pipemorph
    engine.w_share = w_share(engine.checkpointing)  # what B leaves for W against what F left (plans.w_share)
    engine.builder = builder
    engine._schedule = None
    engine._program = []
    engine._ready_program = None
    engine.inbox = None  # dispatch "ready" (set below): every receive of an iteration in flight
    engine.executed_stream = []  # the lowered ops the last train_batch ran, in order
    # The memory limits every planner and ready dispatch read (one object; a ``budget_mb`` grant
    # replaces its contents once the first iteration has measured: ``_grant_memory``).
    engine.budget = memory_budget(pipemorph, engine.num_stages, engine.micro_batches)
    engine.first_plan = plan  # as given, before ``within_budget``: the adapter's first plan in force
    engine._set_plan(plan, lowering_for(pipemorph, engine.nccl_rules), pipemorph.dispatch)
    engine.adapter = None
    # Plug-ins' hooks (runtime.hooks; testing only: injection). ``_handlers`` is what the compiled
    # program runs: the class's handlers, with the hooks' ``after_op`` composed in (add_hooks).
    engine.hooks = None
    engine._handlers = engine._INSTRUCTION_MAP
    engine.add_hooks(*(h for plugin, settings in active_plugins(pipemorph) for h in plugin.engine_hooks(settings, engine)))
    # Per link: direct (torch.distributed in this process) or delegated (staging ring + delegate
    # processes); injected delays (testing only) sit on both paths as docs/design.md models them.
    ranks = [engine.grid.stage_to_global(s) for s in range(engine.num_stages)]
    engine.transport = build_transport(pipemorph, engine.global_rank, engine.stage_id, ranks, engine.device,
                                       link_mode={}, static_shapes=not engine.dynamic_shape, hooks=hooks)
    engine._bound_sends()
    if pipemorph.schedule == "adaptive" and pipemorph.adapt.enabled:
        engine.adapter = Adapter.for_engine(engine, engine.budget)  # measure ops and links, re-plan at boundaries
    engine.timeline = TimelineWriter(pipemorph.timeline, engine.stage_id) if pipemorph.timeline else None
    events = None
    if engine.device.type == "cuda":  # the host clock sees launches: time F/B/W with CUDA events
        events = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    engine.recorder = OpRecorder(pipemorph.nvtx, events, stage=engine.stage_id, rank=engine.global_rank)
    engine.measured_peak_inflight = 0
    engine._reduce_can_be_identity = reduction_can_be_identity(engine)
    engine.reductions_skipped = 0  # ReduceGrads runs that left DeepSpeed's all-reduce out (the identity)
    engine.switch_ms = []  # (iteration, ms) spent switching transports after a re-plan
    if pipemorph.dispatch is Dispatch.READY:  # every receive of an iteration in flight, completed in worker threads
        engine.inbox = Inbox(engine.transport, 2 * engine.micro_batches, pipemorph.timeout_s, engine.global_rank)
    engine.choosing_ns = []  # dispatch "ready": per iteration, time spent choosing the next op
    # (stage, parameter names) DeepSpeed's gradient clipping counted before the first migration
    # or re-mapping (runtime.clip); None while nothing has moved (DeepSpeed's own clipping).
    engine.clip_set = None
    # The gloo groups, attempts and vote that moving layers and re-mapping share (runtime.transfer).
    engine.transfer = Transfer(pipemorph.rebalance.timeout_s,
                               engine.hooks.migration_drop if engine.hooks is not None else frozenset(),
                               eager=pipemorph.rebalance.enabled)
    engine.migrator = LayerMigrator(engine.transfer)
    _control_loops(engine, pipemorph)
    # The iteration's loss leaves the last stage at its last forward where it can (runtime.train_loss).
    engine.early_loss = EarlyLoss(engine) if broadcasts_early(engine) else None
    engine._reset_iteration_state()
    # Activation memory, measured in the first train_batch (runtime.act_meter): per stage.
    engine._meter = None
    engine._mem_ops = {}  # "F"/"G"/"W" -> micro-batch -> bytes
    engine.activation_bytes = None
    # A/B inside this job: the job's own schedule against pipemorph.compare's (runtime.ab_compare).
    engine.compare = Compare(engine, pipemorph) if pipemorph.compare.schedule is not None else None
    engine._destroyed = False


def _control_loops(engine, pipemorph: PipeMorphConfig) -> None:
    """The rebalance loop (compute stragglers: move layers away from a slowed stage), the orchestrator
    (a slow data-parallel link moved into the pipeline: re-mapping, PipeMorph §6), each built from
    the engine and its budget as the adapter is, and the boundary that runs them with the adapter."""
    engine.rebalance = None
    if pipemorph.rebalance.enabled:
        from .rebalance_loop import RebalanceLoop

        engine.rebalance = RebalanceLoop(engine, engine.budget)
    engine.orchestrate = None
    engine.pending_remap = None  # ranks[stage][replica] the orchestrator chose at the last boundary
    if pipemorph.orchestrate.matrix:
        from .orchestrate_loop import OrchestrateLoop

        engine.orchestrate = OrchestrateLoop(engine, engine.budget)
    # The loops in the order their decisions apply: a migration's plan is the last word.
    engine.boundary = Boundary([loop for loop in (engine.adapter, engine.rebalance, engine.orchestrate) if loop is not None],
                               engine.transfer.vote_group, pipemorph.max_exchange_gap)
