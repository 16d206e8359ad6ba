"""PipeMorphEngine: DeepSpeed's PipelineEngine running a plan with split backward and tagged p2p.

Differences from the stock engine, all needed for orders other than DeepSpeed's own 1F1B:

- the schedule is ``PipeMorphSchedule`` (one stage's plan), through the 0.19.8 ``_train_schedule``
  hook; evaluation keeps DeepSpeed's own schedule and handlers;
- B (``BackwardInputPass``) and W (``BackwardWeightPass``) split the backward without
  recomputation (``bw_split``); all W of an iteration run before ``ReduceTiedGrads``;
- received activations, received gradients, input gradients and the loss live per pipe buffer
  (the stock engine shares one receive buffer, one gradient buffer and ``self.loss``);
- it executes the plan's lowered stream (``plan.ir.lower.LoweringPolicy``, the one ``pipemorph
  simulate --lowered`` prints: receives posted a window ahead of their consumers, each send right
  after the op that produced it), dry-run for deadlocks before it is used, and keeps the stream of
  the last batch in ``executed_stream``; under NCCL's point-to-point rules (``nccl_rules``: the
  NCCL backend, or a plug-in's test double) the stream is ``plan.ir.nccl_lowering.NcclLowering``'s,
  dry-run under those rules, with ordered dispatch only (docs/nccl.md);
  messages go through a transport (``runtime.transport``): non-blocking sends, a tag per (kind,
  micro-batch), a timeout on every wait;
- every instruction runs in an NVTX range and leaves an ``OpRecord`` in ``op_records``;
  ``measured_peak_inflight`` is this stage's peak of in-flight activations in the last batch;
- the iteration's loss is summed at the last forward and, where every rank can tell it may, its
  broadcast starts there (``runtime.train_loss``);
- forwards may run out of micro-batch order (the data of an iteration is read in order and kept
  until its F), and floating-point inputs of the first stage require grad so that B is the same
  backward-to-the-input on every stage (its input gradient is dropped).

bf16 and fp16 (DeepSpeed's ``BF16_Optimizer``, ``FP16_Optimizer``) and ZeRO stage 1 train through
DeepSpeed's own gradient path: W fires the hooks on parameters and stock's calls around each
micro-batch's backward are made around W (``runtime.precision``). Activation checkpointing
recomputes once, in B (``runtime.recompute``). Refused at start-up, with one sentence: fp16 on a
device without it, ZeRO above stage 1 (``unsupported_reason``), moving layers or ranks under a
bf16/fp16/ZeRO optimizer (``moving_refusal``), and dispatch "ready" under NCCL's rules. Tensor
parallelism inside a stage trains under ordered dispatch; what it refuses is
``runtime.tensor_parallel``'s.

``runtime.assembly`` builds the engine: ``__init__`` names its steps (the refusals, DeepSpeed's own
engine, the split backward, the parts); the control loops are built from the engine and its memory
budget alike and their typed decisions apply in ``_apply``.
"""
from __future__ import annotations

import inspect
import logging
import time
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import TrainSchedule

from ..plan.ir.links import DIRECT, Delegated
from ..plan.ir.lower import BadStream, Dispatch, Lowering
from ..plan.ir.nccl import nccl_groups
from ..plan.ir.ops import Kind, Op, Schedule
from . import instructions as I
from . import assembly
from .assembly import moving_refusal
from .engine_builder import EngineBuilder
from .bw_split import backward_input, backward_whole, forget_parameters
from .precision import GradPath
from . import tensor_parallel
from .recompute import Recompute
from .checkpoint import default_tag, restore_parts, save_parts
from .config import PipeMorphConfig, PipeMorphConfigError
from .ds_compat import REQUIRED_DEEPSPEED, UnsupportedDeepSpeedError
from ..control.policy import Decision
from .boundary import Migration, Remap
from .clip import clip_as_built
from .inbox import Inbox
from .migrate import MigrationReport
from .grad_reduce import reduction_is_identity
from .hooks import EngineHooks, Hooks
from .plans import NCCL_READY_REFUSED, build_plan, for_nccl, granted_budget, window_kinds, within_budget
from .ready_exec import ReadyProgram, refuse_after_a_failed_iteration, run_ready
from .act_meter import SavedBytes, tensor_bytes
from .act_bytes import describe_activation_bytes, gather_activation_bytes
from .schedule import PipeMorphSchedule
from .shutdown import release_at_exit
from .train_loss import sum_in_order
from .transport.direct import bound_sends
from .transport.protocol import sender_waits_on

logger = logging.getLogger(__name__)


class PipeMorphEngine(PipelineEngine):
    """A PipelineEngine that executes a PipeMorph plan (``plan[s]`` is stage s's op order)."""

    def __init__(self, *super_args, pipemorph: PipeMorphConfig, plan: Schedule,
                 builder: Optional[EngineBuilder] = None, **super_kwargs):
        """DeepSpeed's arguments, the job's ``pipemorph`` section, the plan to start with and how to
        build the engine again (``builder``; None when ``initialize`` did not make it)."""
        assembly.refuse_job(pipemorph, super_kwargs["config_class"], super_kwargs["model"])
        super().__init__(*super_args, **super_kwargs)
        assembly.split_backward(self)
        router_hooks = assembly.router_hooks(self, pipemorph)
        assembly.refuse_engine(self, pipemorph, plan, router_hooks)
        assembly.assemble(self, pipemorph, plan, builder, router_hooks)
        release_at_exit(self)  # a script that just returns exits in order too (runtime.shutdown)

    def destroy(self):
        """Stop this rank's delegate processes (they also exit when the training process dies). Once."""
        if getattr(self, "_destroyed", False):
            return
        self._destroyed = True
        if getattr(self, "compare", None) is not None:  # the comparison's line, if it did not end before
            self.compare.finish(self)
        if self.adapter is not None:  # rank 0: the final profile_out and the profiler's overhead line
            self.adapter.close()
        for inbox in (self.inbox, getattr(self, "_idle_inbox", None)):
            if inbox is not None:
                inbox.close()
        self.transport.close()
        forget_parameters()
        parent = getattr(super(), "destroy", None)
        if parent is not None:
            parent()

    # -- state ----------------------------------------------------------------------------------
    @property
    def op_records(self):
        """OpRecords (op, start_ns, end_ns on time.monotonic_ns) of the last train_batch."""
        return self.recorder.records

    def _reset_iteration_state(self) -> None:
        self._batches: list = []  # this iteration's micro-batches, in data-iterator order
        self._losses: dict[int, torch.Tensor] = {}  # buffer -> loss (last stage)
        self._detached_losses: dict[int, torch.Tensor] = {}  # micro-batch -> its loss, detached (last stage)
        self._detached_extras: dict[int, dict] = {}  # micro-batch -> the module's additional losses, detached
        self._output_grads: dict[int, object] = {}  # buffer -> received gradient(s) of the outputs
        self._input_grads: dict[int, object] = {}  # micro-batch -> gradient(s) to send upstream
        self._weight_work: dict[int, list] = {}  # micro-batch -> WeightGradWorks: the stage's, then its checkpointed chunks'
        self._inflight = 0
        self.measured_peak_inflight = 0
        self.whole_ran: set[int] = set()  # micro-batches whose B ran their W too (one pass): no B/W split measured
        # The trainable parameters B differentiates (layers move only between iterations).
        self._trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.grad_path = GradPath(self)  # stock's calls around each micro-batch's backward (runtime.precision)

    def reset_activation_shape(self):
        """DeepSpeed's hook for a change of activation shapes (e.g. curriculum): re-send layouts."""
        super().reset_activation_shape()
        if hasattr(self, "transport"):
            self.transport.reset_shapes()

    def _direct_link_model(self):
        """The control loop's model of each direct link, the same on every rank (each plans from the same
        table): one message in flight with a blocked sender where any rank's direct sends on it block
        (NCCL, a link a delay injector delays), else one FIFO whose sender never waits (gloo's isend; the
        model leaves out the ``send_window``'s wait once that many messages to the peer are not
        received). One model when every link has the same, else one per link."""
        direct, links = self.transport.direct, max(1, self.num_stages - 1)
        waits = [sender_waits_on(direct, link) for link in range(links)]
        if dist.get_backend() == "gloo":  # NCCL: every rank's sends block; no host collective needed
            flag = torch.tensor(waits, dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            waits = [bool(w) for w in flag.tolist()]
        models = [DIRECT if w else Delegated(1) for w in waits]
        return models[0] if all(m == models[0] for m in models) else models

    def _set_plan(self, plan: Schedule, lowering: Optional[Lowering] = None,
                  dispatch: Optional[Dispatch] = None) -> None:
        """Lower ``plan`` with ``lowering`` (default: the policy in force) for ``dispatch`` (default:
        the one in force; the other's stream is lowered when it is first asked for) and dry-run every
        rank's streams before this rank uses them (the same plan gives the same result on every rank,
        so all adopt it or all refuse it)."""
        lowering = lowering or self.lowering
        plan = within_budget(self.pipemorph, plan, share=self.w_share, budget=self.budget)  # any plan, from any loop
        if self.nccl_rules:  # a plan file's receive window does not apply under NCCL's rules
            lowering = for_nccl(lowering)
        dispatch = dispatch or self.dispatch
        streams = {dispatch: self._lowered(plan, lowering, dispatch)}
        self.plan, self.lowering = plan, lowering
        self.stage_plan: list[Op] = list(plan[self.stage_id])
        if hasattr(self, "transport"):  # (the first plan is set before the transport is built)
            self._bound_sends()
        self._streams = streams
        self._compiled: dict[Dispatch, tuple] = {}  # dispatch -> its program, built at the next batch

    def _bound_sends(self) -> None:
        """Name the kinds the direct path's send window bounds under the plan in force (none under
        NCCL's rules, where no send waits): ``plans.window_kinds``, cached for the last plan."""
        key = (id(self.plan), id(self.lowering))
        cached = getattr(self, "_window_cache", None)
        if cached is None or cached[0] != key:
            kinds = [] if self.nccl_rules else window_kinds(self.plan, self.lowering,
                                                              self.pipemorph.send_window_in_force)[self.stage_id]
            self._window_cache = cached = (key, kinds, self.plan, self.lowering)  # (plan, lowering kept alive)
        bound_sends(self.transport.direct, cached[1])

    def _lowered(self, plan: Schedule, lowering: Lowering, dispatch: Dispatch) -> list[Op]:
        """This stage's stream of ``plan`` under ``dispatch``, every stage's dry-run first."""
        try:
            return lowering.for_dispatch(dispatch).lower(plan)[self.stage_id]
        except BadStream as e:
            raise PipeMorphConfigError(f"the plan cannot run: {e}") from None

    def _stream_for(self, dispatch: Dispatch) -> list[Op]:
        if dispatch not in self._streams:
            self._streams[dispatch] = self._lowered(self.plan, self.lowering, dispatch)
        return self._streams[dispatch]

    @property
    def dispatch(self) -> Dispatch:
        """``Dispatch.ORDERED`` or ``Dispatch.READY``: how the next ``train_batch`` runs its stream."""
        return Dispatch.READY if self.inbox is not None else Dispatch.ORDERED

    @property
    def stream(self) -> list[Op]:
        """This stage's lowered stream under the dispatch in force (``Lowering.for_dispatch``)."""
        return self._stream_for(self.dispatch)

    def switch_to(self, plan: Optional[Schedule] = None, dispatch: Optional[Dispatch] = None,
                  lowering: Optional[Lowering] = None) -> None:
        """Run ``plan`` and/or ``dispatch`` ("ordered" or "ready") from the next ``train_batch``, as a
        re-plan takes effect at an iteration boundary: every rank calls it with the same arguments
        between two ``train_batch`` calls; ``lowering`` (a plan file's ``PlanFile.lowering``) lowers
        ``plan``, default the policy in force. Ready dispatch switched off keeps its receive threads for
        when it is switched on again (a paired benchmark switches every iteration). Every argument
        is checked before anything changes: a refused call leaves the plan and dispatch as they were."""
        if dispatch is not None:  # a Dispatch or its text, read once here
            try:
                dispatch = Dispatch.parse(dispatch)
            except ValueError:
                raise PipeMorphConfigError(f"dispatch must be 'ordered' or 'ready', not '{dispatch}'") from None
        if dispatch is Dispatch.READY and self.nccl_rules:
            raise PipeMorphConfigError(NCCL_READY_REFUSED)
        refusal = tensor_parallel.switch_refusal(self, dispatch)
        if refusal:
            raise PipeMorphConfigError(refusal)
        if dispatch is Dispatch.READY and self.inbox is None and self.hooks is not None and self.hooks.ready_refused:
            raise PipeMorphConfigError(self.hooks.ready_refused)
        target = dispatch or self.dispatch
        if lowering is not None and self.nccl_rules:
            lowering = for_nccl(lowering)
        if plan is not None and (plan is not self.plan or lowering not in (None, self.lowering)):
            self._check_micro_batches(plan[self.stage_id])
            self._set_plan(plan, lowering, target)  # dry-runs the plan before adopting it
        elif target != self.dispatch:
            self._stream_for(target)  # lowered and dry-run before anything changes
        if target == self.dispatch:
            self._train_schedule()  # its program is built now, not inside the next train_batch
            return
        if dispatch is Dispatch.ORDERED:
            self._idle_inbox, self.inbox = self.inbox, None
        else:
            idle = getattr(self, "_idle_inbox", None)
            self.inbox = idle or Inbox(self.transport, 2 * self.micro_batches, self.pipemorph.timeout_s,
                                       self.global_rank)
            self._idle_inbox = None
        self._train_schedule()  # built once per plan and dispatch, not inside the next train_batch

    def add_hooks(self, *items: EngineHooks) -> None:
        """Run the engine hooks ``items`` (``runtime.hooks``) from the next ``train_batch`` on, after
        those in force: their ``after_op`` is composed into the handlers of the compiled program
        (built again at the next batch), their ``start_iteration`` runs before its first instruction."""
        if not items:
            return
        hooks = Hooks((*(self.hooks.items if self.hooks is not None else ()), *items))
        if self.inbox is not None and hooks.ready_refused:  # refused before anything changes
            raise PipeMorphConfigError(hooks.ready_refused)
        self.hooks = hooks
        self._handlers = hooks.around(self._INSTRUCTION_MAP)
        if getattr(self, "transfer", None) is not None:  # built after the plug-ins' hooks at start-up
            self.transfer.drop_payload_at = hooks.migration_drop

    def _check_micro_batches(self, stage_plan) -> None:
        n = max((op.mb for op in stage_plan), default=-1) + 1
        if n != self.micro_batches:
            raise PipeMorphConfigError(
                f"stage {self.stage_id}: the plan has {n} micro-batches but the engine now runs "
                f"{self.micro_batches} (gradient_accumulation_steps changed after start-up)")

    def _train_schedule(self):
        self._check_micro_batches(self.stage_plan)
        dispatch, handlers = self.dispatch, self._handlers
        compiled = self._compiled.get(dispatch)
        if compiled is None or compiled[1] is not handlers:  # a new plan, or hooks added since (add_hooks)
            stream = self._stream_for(dispatch)
            groups = nccl_groups([stream])[0] if self.nccl_rules else ()  # issued as batch_isend_irecv
            # One pass for B m + W m where the policy fuses them, and on the first stage (it sends no
            # input gradient) where the order runs them back to back, unless the control loop re-plans
            # (it measures B and W apart); checkpointed chunks always split.
            whole = not self.checkpointing and (self.lowering.fused or (
                self.is_first_stage() and dispatch is Dispatch.ORDERED and self.adapter is None))
            schedule = PipeMorphSchedule(stream, self.micro_batches, self.num_stages, self.stage_id, groups, whole)
            # Per instruction: (recorded?, op text, handler, kwargs), built once per plan and dispatch.
            program = [(type(cmd) not in I.UNRECORDED, I.op_text(cmd), handlers[type(cmd)], cmd.kwargs)
                       for step in schedule.steps() for cmd in step]
            tail = len(list(schedule.steps())[-1])  # the end of the iteration: sends, reductions, step
            ready = ReadyProgram(schedule, handlers, self.lowering.fused, self.hooks) if dispatch is Dispatch.READY else None
            compiled = self._compiled[dispatch] = (schedule, handlers, program, tail, ready,
                                                   [str(op) for op in schedule.stream])
        self._schedule, _, self._program, self._tail, self._ready_program, self._stream_texts = compiled
        return self._schedule

    # -- execution ------------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """DeepSpeed's train_batch inside one NVTX range ``ITER<k>`` (k: this engine's batches so far).
        The first one also measures the activation memory (``runtime.act_meter``); with
        ``pipemorph.compare`` each one runs and is timed on its side (``runtime.ab_compare``)."""
        if self.compare is None or self.compare.done:
            return self._train_batch(data_iter)
        self.compare.before(self)
        try:
            loss = self._train_batch(data_iter)
        except BaseException:
            self.compare.abandon()  # the iteration did not run to its end: it is not measured
            raise
        self.compare.after(self)
        return loss

    def comparison(self):
        """The A/B result of ``pipemorph.compare`` (``paired.Comparison``) over the iterations measured
        so far; it changes nothing, so any rank may ask. None without ``compare`` or before a pair."""
        return None if self.compare is None else self.compare.current()

    def _train_batch(self, data_iter):
        if self.activation_bytes is not None:
            with self.recorder.iteration():
                return super().train_batch(data_iter)
        with self.recorder.iteration(), SavedBytes(self.module.parameters()) as meter:
            _set(self, "_meter", meter)
            try:
                loss = super().train_batch(data_iter)
            finally:
                _set(self, "_meter", None)
        measured = gather_activation_bytes(self, meter.peak)
        if self.pipemorph.memory.budget_mb is not None:
            self._grant_memory(measured)  # refused: nothing changed, and the next batch measures again
        _set(self, "activation_bytes", measured)
        if self.adapter is not None:  # profile_out gets the bytes form of memory
            self.adapter.export.set_memory([a.f for a in self.activation_bytes], [a.w for a in self.activation_bytes],
                                           self.budget.units)
        if self.global_rank == 0:
            logger.warning(describe_activation_bytes(self.activation_bytes, self.w_share, self.budget))
        return loss

    def _grant_memory(self, measured) -> None:
        """``memory.budget_mb`` in force from the next batch: converted with every stage's bytes
        (``activation_bytes``, all-gathered: the same on every rank), then ``zb`` and ``adaptive``
        planned anew within it (Alg. 1's warm-up from its caps), any other plan fitted to it. Every rank
        runs this at the same point, after the iteration's last collective; a grant below one
        micro-batch's activations, or one the plan cannot keep, raises the same sentence on every rank
        before anything changes, so none waits for another."""
        cfg, S, N = self.pipemorph, self.num_stages, self.micro_batches
        granted = granted_budget(cfg, S, N, [a.f for a in measured], self.w_share)
        if cfg.schedule in ("zb", "adaptive"):
            plan = build_plan(cfg, S, N, self.w_share, granted)
        else:  # the job's own plan (not a comparison's other side, planned anew below)
            plan = within_budget(cfg, self.compare.b_plan if self.compare is not None else self.plan,
                                 f"the '{cfg.schedule}' plan", self.w_share, granted)
        a_plan = None if self.compare is None else self.compare.plan_within(self, granted)
        self.budget.grant(granted)
        self._set_plan(plan)
        if self.adapter is not None:
            self.adapter.policy.rebase(self.plan)
        if self.compare is not None:
            self.compare.rebudget(self, a_plan)

    def _exec_schedule(self, pipe_schedule):
        if not isinstance(pipe_schedule, PipeMorphSchedule):  # evaluation: DeepSpeed's own path
            if isinstance(pipe_schedule, TrainSchedule):  # never train stock 1F1B in the plan's place
                raise UnsupportedDeepSpeedError(
                    f"stage {self.stage_id}: DeepSpeed handed the engine its own TrainSchedule instead of "
                    f"asking _train_schedule for the plan (ds_pipemorph needs DeepSpeed >= {REQUIRED_DEEPSPEED})")
            return self._exec_stock_schedule(pipe_schedule)
        refuse_after_a_failed_iteration(self)
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self._reset_iteration_state()
        self.recorder.reset()
        if self.early_loss is not None and not self.is_last_stage():
            self.early_loss.post(self.device)
        if self.hooks is not None:
            self.hooks.start_iteration(self)
        run = self.recorder.run
        program = self._program
        self.executed_stream = []
        if self.inbox is not None:  # dispatch "ready": the stream's ops in readiness order, then the tail
            self.choosing_ns.append(run_ready(self, self._ready_program))
            program = program[-self._tail:]
        for recorded, name, handler, kwargs in program:
            if recorded:
                run(name, handler, self, **kwargs)
            else:
                handler(self, **kwargs)
        if self.inbox is None:  # ordered dispatch ran every op of its stream, in order
            self.executed_stream = list(self._stream_texts)
        if self._weight_work:
            raise RuntimeError(f"stage {self.stage_id}: W never ran for micro-batches {sorted(self._weight_work)}")
        self._at_iteration_boundary()

    def _at_iteration_boundary(self) -> None:
        """The one place where work between iterations happens, the same on every rank: the control
        loops exchange what they measured (``runtime.boundary``, one all-gather, at the iterations the
        boundary's schedule names) and their decisions apply in a fixed order (``_apply``), from the
        next batch; then the timeline."""
        self._apply(self.boundary.exchange(self, self.recorder.records))
        if self.timeline is not None:
            self.timeline.after_iteration(self.recorder.records)

    def _apply(self, decisions) -> None:
        """Apply one boundary's decisions, in the loops' order, on every rank alike: the adapter's
        ``Decision`` (its plan, the links' routes), a ``Migration`` (layers move; if that succeeds
        everywhere its plan, if any, replaces the adapter's), a ``Remap`` (run by ``EngineHandle``
        after this ``train_batch``). The plan is replaced once, here."""
        plan = None
        self.pending_remap = None
        for decision in decisions:
            if isinstance(decision, Decision):
                plan = decision.plan
                t = time.perf_counter()
                for link, route in decision.link_modes.items():  # slow links go delegated ("auto")
                    self.transport.set_link_mode(link, route, queues=decision.queues.get(link))
                self.switch_ms.append((self.adapter.iteration, round((time.perf_counter() - t) * 1e3, 1)))
            elif isinstance(decision, Migration):
                t = time.perf_counter()
                report = self.migrator.migrate(self, decision.parts)
                self._trainable = []  # the layers that left are freed now, not at the next batch
                forget_parameters()
                self.rebalance.applied(self, decision, report, time.perf_counter() - t)
                if report.ok and decision.plan is not None:
                    plan = decision.plan
            elif isinstance(decision, Remap):
                self.pending_remap = decision.ranks
        if plan is not None:
            self._set_plan(plan)

    def _aggregate_total_loss(self):
        """Stock DeepSpeed's result; collected from the broadcast the last forward started where it
        could start early (``runtime.train_loss``)."""
        if self.early_loss is None:
            return super()._aggregate_total_loss()
        self.dp_group_loss, agg_loss = self.early_loss.collect()
        if self.is_last_stage():
            self.agg_additional_losses = self.total_additional_losses
        return agg_loss

    def clip_fp32_gradients(self):
        """DeepSpeed's clipping, its norm over the parameters it counted before anything moved
        (``runtime.clip``): moving layers or ranks does not change the clip coefficient."""
        if self.clip_set is None:
            return super().clip_fp32_gradients()
        return clip_as_built(self, self.clip_set, self.gradient_clipping())

    def repartition(self, parts) -> MigrationReport:
        """Move layers between neighbouring stages so that stage s holds layers
        ``parts[s]..parts[s+1]-1`` (DeepSpeed's ``parts`` list), keeping their parameters, gradients
        and optimizer state (``runtime.migrate``). Every rank calls it with the same ``parts``,
        between two ``train_batch`` calls. If any rank's part fails, every rank keeps the partition
        it had (``report.ok`` is False) and training can go on."""
        refusal = moving_refusal(self, self.pipemorph)
        if refusal:
            raise PipeMorphConfigError(refusal)
        report = self.migrator.migrate(self, list(parts))
        if report.ok and self.rebalance is not None:  # the loop predicts from the partition in force
            self.rebalance.rebalancer.moved(report.after)
        if report.moved and self.global_rank == 0:
            logger.warning(f"pipemorph: {report.describe()}")
        return report

    def remap(self, topology):
        """Give every rank its coordinate in ``topology`` (same stages and replicas, other ranks):
        stage states move to their new ranks, DeepSpeed's groups are formed anew, and training
        goes on (``runtime.remap``). Every rank calls it with the same topology, between two
        ``train_batch`` calls; returns ``(engine, report)``: the engine to train with from now on
        (this one, unchanged, if any rank's part failed) and what happened on this rank."""
        from .remap import remap

        refusal = moving_refusal(self, self.pipemorph)
        if refusal:
            raise PipeMorphConfigError(refusal)
        fresh, report = remap(self, topology)
        if self.global_rank == 0:
            ranks = [[topology.get_rank(pipe=s, data=d) for d in range(topology.get_dim("data"))]
                     for s in range(topology.get_dim("pipe"))]
            outcome = "done" if report.ok else f"failed ({report.reason}), every rank kept its stage"
            logger.warning(f"pipemorph: re-mapping to ranks {ranks} (per stage, per replica): {outcome} in "
                           f"{report.seconds * 1e3:.0f} ms")
        return fresh, report

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint, with the partition in force written into it first
        (``runtime.checkpoint``): a job whose layers moved resumes on the stages that hold their
        optimizer state."""
        tag = default_tag(self) if tag is None else str(tag)
        if save_dir:  # DeepSpeed refuses an empty one
            save_parts(self, save_dir, tag)
        return super().save_checkpoint(save_dir, tag=tag, client_state={} if client_state is None else client_state,
                                       save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, *args, **kwargs):
        """DeepSpeed's ``load_checkpoint`` (same arguments), after moving layers (live migration) to
        the partition the checkpoint was saved on, if it says one and optimizer states are loaded
        (``runtime.checkpoint``). Every rank calls it."""
        bound = inspect.signature(PipelineEngine.load_checkpoint).bind(self, load_dir, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["load_optimizer_states"] and not a["load_module_only"] and not self.load_universal_checkpoint():
            restore_parts(self, load_dir, a["tag"])
        return super().load_checkpoint(load_dir, *args, **kwargs)

    def _exec_stock_schedule(self, pipe_schedule):
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                PipelineEngine._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)

    # -- handlers -------------------------------------------------------------------------------
    def _exec_load_micro_batch(self, buffer_id, micro_batch):
        while len(self._batches) <= micro_batch:  # plans may run forwards out of order
            self._batches.append(self._next_batch())
        batch = self._batches[micro_batch]
        self._batches[micro_batch] = None  # loaded once per micro-batch: free it now
        if self.is_first_stage():
            loaded = _to_device(batch[0], self.device, detach=True)
            # Floating-point inputs of the first stage require grad, as every other stage's input
            # does: B then means the same on every stage (the backward down to the stage input) and
            # the plan's B/W split of costs holds on stage 0 too. The input gradient is dropped.
            for t in _as_list(loaded):
                t.requires_grad_(t.is_floating_point())
            self.pipe_buffers["inputs"][buffer_id] = loaded
        if self.is_last_stage():
            self.pipe_buffers["labels"][buffer_id] = _to_device(batch[1], self.device, detach=False)

    def _exec_forward_pass(self, buffer_id, micro_batch):
        self.tput_timer.start()
        inputs = self.pipe_buffers["inputs"][buffer_id]
        # Called on the module, not through DeepSpeedEngine.forward: that one hooks the outputs for
        # torch-style ``out.backward()`` (timers, 1/GAS scaling on the last stage), which B and W
        # do explicitly here. The module's own forward pre/post hooks still run.
        held = None if self._meter is None else self._meter.live
        outputs = self.module(inputs)
        inflight = self._inflight + 1
        _set(self, "_inflight", inflight)
        if inflight > self.measured_peak_inflight:
            _set(self, "measured_peak_inflight", inflight)
        self.pipe_buffers["outputs"][buffer_id] = outputs
        if self.is_last_stage():
            if self._compute_loss and self.module.loss_fn is not None:
                loss = self.module.loss_fn(outputs, self.pipe_buffers["labels"][buffer_id])
            else:
                loss = outputs
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise PipeMorphConfigError(
                    f"stage {self.stage_id}: F{micro_batch} must produce a scalar loss tensor for B")
            self._losses[buffer_id] = loss
            self._detached_losses[micro_batch] = loss.detach()
            if len(self._detached_losses) == self.micro_batches:  # the last forward: the iteration's loss
                # Added in micro-batch order, the order of stock's forwards, whatever order ready
                # dispatch ran them in (activations can be in out of order): another order can round
                # a bf16 sum differently.
                self.fwd_outputs = [self._detached_losses[m] for m in sorted(self._detached_losses)]
                self.total_loss = sum_in_order(self.fwd_outputs)
                if self.early_loss is not None:
                    self.early_loss.send(self._scale_loss_by_gas(self.total_loss))
            extra = self.module.get_additional_losses()
            if extra is not None:  # copied now (a module may update them in place), added up in micro-batch order
                self._detached_extras[micro_batch] = {name: value.detach().clone() for name, value in extra.items()}
            if self._detached_extras and len(self._detached_losses) == self.micro_batches:
                per_mb = [self._detached_extras[m] for m in sorted(self._detached_extras)]
                names = dict.fromkeys(name for extras in per_mb for name in extras)
                self.total_additional_losses = {name: sum_in_order([e[name] for e in per_mb if name in e])
                                                for name in names}
        if held is not None:  # what F saved for B, the loss's included
            self._mem_ops.setdefault("F", {})[micro_batch] = self._meter.live - held

    def _exec_send_activations(self, buffer_id, micro_batch):
        self.transport.send(Kind.F, micro_batch, self.pipe_buffers["outputs"][buffer_id])

    def _exec_recv_activations(self, buffer_id, micro_batch):
        self._take_activation(buffer_id, self.transport.recv(Kind.F, micro_batch))

    def _take_activation(self, buffer_id, recvd) -> None:
        """A received activation becomes the input of the pipe buffer (it needs its gradient)."""
        for t in _as_list(recvd):
            t.requires_grad_(t.is_floating_point())
        self.pipe_buffers["inputs"][buffer_id] = recvd

    def _exec_recv_grads(self, buffer_id, micro_batch):
        self._output_grads[buffer_id] = self.transport.recv(Kind.B, micro_batch)

    def _exec_post_recv_activation(self, micro_batch):
        self.transport.post_recv(Kind.F, micro_batch)

    def _exec_post_recv_grad(self, micro_batch):
        self.transport.post_recv(Kind.B, micro_batch)

    def _exec_begin_p2p_group(self):
        self.transport.begin_group()

    def _exec_end_p2p_group(self):
        self.transport.end_group()

    def _exec_backward_input(self, buffer_id, micro_batch, whole: bool = False):
        if self.is_last_stage():
            outs = [self.grad_path.scale_loss(self._scale_loss_by_gas(self._losses.pop(buffer_id)))]
            grads = [None]
        else:
            outs = [t for t in _as_list(self.pipe_buffers["outputs"][buffer_id]) if t.is_floating_point()]
            grads = _as_list(self._output_grads.pop(buffer_id))
            if len(grads) != len(outs):
                raise RuntimeError(f"stage {self.stage_id}: B{micro_batch} got {len(grads)} gradients "
                                   f"for {len(outs)} floating-point outputs")
        inputs = self.pipe_buffers["inputs"][buffer_id]
        ins = _as_list(inputs)
        if whole and self._meter is None:  # B and W in one pass (not while the meter counts what W keeps)
            with self.grad_path.around_w():
                dins = backward_whole(outs, grads, ins)
            self._weight_work[micro_batch] = []
            self.whole_ran.add(micro_batch)
        elif self.checkpointing:  # checkpointed chunks recompute here and leave their W work too
            with Recompute(self._trainable) as chunks:
                dins, work = backward_input(outs, grads, ins, self._trainable)
            self._weight_work[micro_batch] = [work, *chunks.works]
        else:
            dins, work = backward_input(outs, grads, ins, self._trainable)
            self._weight_work[micro_batch] = [work]
        if self._meter is not None:  # the output gradients W needs, beside the graph it keeps
            self._mem_ops.setdefault("G", {})[micro_batch] = tensor_bytes(
                g for w in self._weight_work[micro_batch] for g in w.kept_grads())
        if not self.is_first_stage():
            sent = [torch.zeros_like(t) if g is None else g for t, g in zip(ins, dins) if t.is_floating_point()]
            self._input_grads[micro_batch] = sent[0] if isinstance(inputs, torch.Tensor) else tuple(sent)
        # The activation is released here (W keeps only what bw_split documents).
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["inputs"][buffer_id] = None
        self.pipe_buffers["labels"][buffer_id] = None
        _set(self, "_inflight", self._inflight - 1)

    def _exec_send_grads(self, buffer_id, micro_batch):
        self.transport.send(Kind.B, micro_batch, self._input_grads.pop(micro_batch))

    def _exec_backward_weight(self, micro_batch):
        works = self._weight_work.pop(micro_batch)
        if not works:  # its B ran the whole backward
            return
        held = None if self._meter is None else self._meter.live
        self._run_w(works)
        if held is not None:  # W freed what B left for it (the works dropped with it)
            self._mem_ops.setdefault("W", {})[micro_batch] = held - self._meter.live

    def _run_w(self, works: list) -> None:
        with self.grad_path.around_w():
            if self.checkpointing:  # chunks whose recomputation waited for W (no input gradient) run here
                with Recompute(self._trainable) as chunks:
                    for work in works:
                        work.run()
                    chunks.drain()
            else:
                for work in works:
                    work.run()

    def _exec_wait_sends(self):
        self.transport.wait_sends()

    def _exec_reduce_grads(self):
        """DeepSpeed's, skipped where it cannot change a gradient (one replica: ``runtime.grad_reduce``)."""
        if reduction_is_identity(self, self._reduce_can_be_identity):
            self.reductions_skipped += 1
        else:
            super()._exec_reduce_grads()

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        I.LoadMicroBatch: _exec_load_micro_batch,
        I.ForwardPass: _exec_forward_pass,
        I.BackwardInputPass: _exec_backward_input,
        I.BackwardWeightPass: _exec_backward_weight,
        I.SendActivation: _exec_send_activations,
        I.RecvActivation: _exec_recv_activations,
        I.SendGrad: _exec_send_grads,
        I.RecvGrad: _exec_recv_grads,
        I.WaitSends: _exec_wait_sends,
        I.ReduceGrads: _exec_reduce_grads,
        I.PostRecvActivation: _exec_post_recv_activation,
        I.PostRecvGrad: _exec_post_recv_grad,
        I.BeginP2PGroup: _exec_begin_p2p_group,
        I.EndP2PGroup: _exec_end_p2p_group,
    }


# The handlers' per-op flags and counters are plain attributes (no parameter, buffer or module):
# set without nn.Module.__setattr__'s checks, which cost more than the rest of a small handler.
_set = object.__setattr__


def _as_list(x) -> list:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _to_device(x, device, detach: bool):
    if torch.is_tensor(x):
        x = x.to(device)
        return x.clone().detach() if detach else x
    if isinstance(x, (tuple, list)):
        return tuple(_to_device(t, device, detach) for t in x)
    raise TypeError(f"a batch holds tensors or tuples of tensors, got {type(x).__name__}")
