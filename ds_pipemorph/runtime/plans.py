"""The plan a job runs, from its ``pipemorph.schedule`` setting; errors are one sentence.

``1f1b``: DeepSpeed's 1F1B order, each backward run as B immediately followed by its W (the fused backward's
results; the input gradient just leaves after B instead of after the whole backward). ``zb``: the list
scheduler with ZB-H1 warm-up (S − s) or ``memory.max_inflight``. ``adaptive``: Alg. 1 warm-up
from the memory caps and the list scheduler on a uniform cost model (the control loop then
re-plans from measurements). ``plan``: a plan file, validated.

Every message takes some time even on a fast link (a wake-up, a kernel launch, the wire). A plan
with zero slack on its critical path pays that latency at every hop: the ZB-H1 order the list
scheduler makes for a zero-latency model runs 401 ms instead of 390 with 0.5 ms per message (4
stages, 12 micro-batches, 10 ms ops), while the order it makes when told of the latency takes the
same 390 ms without latency and 393 with it. So ``zb`` and ``adaptive`` are planned both ways and
the faster plan with no latency wins, ties going to the one less hurt by ``HOP_LATENCY_MS``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from ..fileio import BadInput, load_model
from ..plan.files.planfile import PlanFile
from ..plan.ir.lower import RECV_WINDOW, Dispatch, Lowering, LoweringPolicy, window_deadlock
from ..plan.ir.memory import EPS, MemoryBudget, OverBudget, caps_within, fit_budget, peak_units, stock_units, units_of_bytes
from ..plan.ir.nccl_lowering import NcclLowering
from ..plan.ir.ops import Kind, Schedule, warmup_counts
from ..plan.ir.profile import Costs
from ..plan.sched.baselines import deepspeed_1f1b, zb_h1_warmup
from ..plan.sched.listsched import list_schedule
from ..plan.sim.listsched_py import Policy
from ..plan.sched.warmup import check_lemma1, initial_warmup
from ..plan.sim.simulate import makespan
from ..plan.sim.validate import InvalidPlan, validate_schedule
from .act_bytes import MIB
from .config import PipeMorphConfig, PipeMorphConfigError

DEFAULT_OP_MS = 10.0
HOP_LATENCY_MS = 0.5  # the per-message latency a plan should not be fragile to (see above)


# What B leaves for W of a micro-batch's saved activations, as a share of what F left for B
# (``plan.ir.memory``). The generic graph split (``runtime.bw_split``) keeps F's retained graph until
# W and saves nothing new: at most all of it, 1. A checkpointed chunk saves only its inputs in F and
# recomputes its graph in B, which W then needs: far more than F left, so no W of a checkpointed
# job waits behind another F or B while the budget binds (the share stands for "more than any budget").
W_SHARE = 1.0
CHECKPOINTED_W_SHARE = 1e6


def w_share(checkpointing: bool) -> float:
    return CHECKPOINTED_W_SHARE if checkpointing else W_SHARE


def _caps(cfg: PipeMorphConfig, stages: int, microbatches: int, units: Optional[Sequence[float]]) -> list[int]:
    """Per-stage cap on in-flight activations (F done, B not done): ``memory.max_inflight`` (default:
    N), within ``units`` (default budget: stock 1F1B's S − s)."""
    per_stage = cfg.memory.per_stage(stages)
    out = [microbatches] * stages if per_stage is None else [min(c, microbatches) for c in per_stage]
    if units is not None:
        out = [min(c, u) for c, u in zip(out, caps_within(units))]
    return out


def memory_budget(cfg: PipeMorphConfig, stages: int, microbatches: int) -> MemoryBudget:
    """The limits in force at start-up (the caps and ``memory.units``): with ``memory.budget_mb``,
    stock 1F1B's until ``granted_budget`` can convert the grant (a list of the wrong length is refused
    here, at start-up)."""
    cfg.memory.mib_per_stage(stages)
    units = cfg.memory.units(stages)
    return MemoryBudget(_caps(cfg, stages, microbatches, units), units)


def granted_budget(cfg: PipeMorphConfig, stages: int, microbatches: int, f_bytes: Sequence[int],
                   share: float = W_SHARE) -> MemoryBudget:
    """``memory.budget_mb`` as limits, once the first iteration measured ``f_bytes`` (per stage, what
    one micro-batch's F keeps for B; the same figures on every rank): each stage's grant in units of
    its own micro-batch's activations (``plan.ir.memory.units_of_bytes``), and the caps within them.
    Less than one micro-batch's activations on a stage cannot run: refused naming the first such stage,
    the same on every rank."""
    mib = cfg.memory.mib_per_stage(stages)
    units = units_of_bytes([m * MIB for m in mib], f_bytes, microbatches * max(1.0, share))
    # What each stage must hold: one micro-batch; stock's S - s under the 1f1b order, which no W can relieve.
    one_f_one_b = cfg.schedule == "1f1b"
    need = [min(stages - s, microbatches) if one_f_one_b else 1 for s in range(stages)]
    for s, u in enumerate(units):
        if u < need[s] - EPS:
            least = [_mib_up(n * f / MIB) for n, f in zip(need, f_bytes)]
            what = (f"the {need[s]} micro-batches the 1f1b order holds there ({need[s]} x {f_bytes[s] / MIB:.4g} MiB"
                    if one_f_one_b else f"one micro-batch's activations there ({f_bytes[s] / MIB:.4g} MiB")
            raise PipeMorphConfigError(
                f"pipemorph.memory.budget_mb gives stage {s} {mib[s]:.4g} MiB, less than {what} measured in the "
                f"first iteration): the smallest budget_mb that runs is {least[s]:.4g} MiB on stage {s} "
                f"({_listed(least)} per stage, or {max(least):.4g} for every stage)")
    return MemoryBudget(_caps(cfg, stages, microbatches, units), units, tuple(mib))


def _mib_up(x: float) -> float:
    """``x`` rounded up to 4 significant digits (a budget printed so that it holds what it names)."""
    if x <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(x)) - 3)
    return math.ceil(x / step - 1e-9) * step


def _listed(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"


def within_budget(cfg: PipeMorphConfig, plan: Schedule, what: str = "the plan", share: float = W_SHARE,
                  budget: Optional[MemoryBudget] = None) -> Schedule:
    """``plan`` with its weight-gradient ops moved where the memory budget needs them
    (``plan.ir.memory.fit_budget``); unchanged without a budget or when it fits. ``budget``: the
    limits in force (default: ``memory_budget``'s, from ``cfg`` alone)."""
    budget = memory_budget(cfg, len(plan), 1) if budget is None else budget
    if budget.units is None:
        return plan
    try:
        return fit_budget(plan, budget.units, ratio=share)
    except OverBudget as e:
        if budget.mib is not None:  # one unit of stage s is budget.mib[s] / budget.units[s] MiB
            held = peak_units(plan, 0.0)  # forwards held between F and B: no W can relieve those
            least = [_mib_up(max(1.0, h, u) * m / u) for h, u, m in zip(held, budget.units, budget.mib)]
            raise PipeMorphConfigError(f"{what} needs more activation memory than pipemorph.memory.budget_mb "
                                       f"({_listed(budget.mib)} MiB per stage) allows: {e}; raise memory.budget_mb "
                                       f"to at least {least[e.stage]:.4g} MiB on stage {e.stage} ({_listed(least)} "
                                       f"per stage, or {max(least):.4g} for every stage)") from None
        raise PipeMorphConfigError(f"{what} needs more activation memory than pipemorph.memory.budget "
                                   f"({cfg.memory.budget_in_force:g}x stock 1F1B) allows: {e}; raise memory.budget "
                                   f"or set it to null") from None


def build_plan(cfg: PipeMorphConfig, stages: int, microbatches: int, share: float = W_SHARE,
               budget: Optional[MemoryBudget] = None) -> Schedule:
    """The plan ``cfg`` asks for; ``share``: see ``w_share``; ``budget``: the limits in force
    (default: ``memory_budget``'s, those at start-up)."""
    S, N = stages, microbatches
    budget = memory_budget(cfg, S, N) if budget is None else budget
    policy = Policy(units=budget.units, w_share=share)
    if cfg.schedule == "1f1b":
        plan = deepspeed_1f1b(S, N)
    elif cfg.schedule == "zb":
        if cfg.memory.max_inflight is None:  # ZB-H1's, within a budget's caps (kept non-increasing: Lemma 1)
            warmup = [min(x, c) for x, c in zip(zb_h1_warmup(S, N), budget.caps)]
            warmup = [min(warmup[:s + 1]) for s in range(S)]
        elif budget.mib is None:  # the user's count, checked as given
            warmup = list(budget.caps)
        else:  # a grant in bytes may give a later stage more than an earlier one: kept non-increasing
            warmup = [min(budget.caps[:s + 1]) for s in range(S)]
        _check_warmup(warmup)
        plan = latency_robust_schedule(Costs.uniform(S, DEFAULT_OP_MS), N, warmup, policy=policy)
    elif cfg.schedule == "adaptive":
        warmup = initial_warmup(list(budget.caps))
        plan = latency_robust_schedule(Costs.uniform(S, DEFAULT_OP_MS), N, warmup, policy=policy)
    else:
        plan = load_plan_file(cfg.plan_file, S, N)
    plan = within_budget(cfg, plan, f"the '{cfg.schedule}' plan" if cfg.schedule != "plan" else
                         f"plan file {cfg.plan_file}", share, budget)
    try:
        validate_schedule(plan, S, N)
    except InvalidPlan as e:  # a planner bug, not a user error, but still one sentence
        raise PipeMorphConfigError(f"the '{cfg.schedule}' plan is invalid: {e}") from None
    return plan


def latency_robust_schedule(costs: Costs, microbatches: int, warmup: list[int],
                            latency_ms: float = HOP_LATENCY_MS, policy: Policy = Policy()) -> Schedule:
    """The list scheduler's order for ``costs``, or for ``costs`` with at least ``latency_ms`` on every
    link: whichever is faster under ``costs``, then under the latency (deterministic)."""
    N = microbatches
    slow = costs.with_links([max(c, latency_ms) for c in costs.links])
    candidates = [list_schedule(costs, N, warmup, policy=policy), list_schedule(slow, N, warmup, policy=policy)]
    return min(candidates, key=lambda p: (makespan(p, costs, N), makespan(p, slow, N)))


def load_plan_file(path: str, stages: int, microbatches: int) -> Schedule:
    try:
        pf = load_model(path, PlanFile)
    except BadInput as e:
        raise PipeMorphConfigError(f"ds_config pipemorph.plan_file {e}") from None
    if pf.stages != stages:
        raise PipeMorphConfigError(
            f"plan file {path} is for {pf.stages} stages but the job has {stages} pipeline stages")
    if pf.microbatches != microbatches:
        raise PipeMorphConfigError(
            f"plan file {path} is for {pf.microbatches} micro-batches but the job runs {microbatches} "
            f"(gradient_accumulation_steps)")
    try:
        return pf.ops()
    except InvalidPlan as e:
        raise PipeMorphConfigError(f"plan file {path} is invalid: {e}") from None


NCCL_READY_REFUSED = ("dispatch 'ready' posts every receive of an iteration up front, which NCCL's in-order "
                      "point-to-point cannot run: set pipemorph.dispatch to \"ordered\"")


def lowering_for(cfg: PipeMorphConfig, nccl: bool = False) -> Lowering:
    """How the job's plans are lowered: a plan file's own ``recv_window`` and ``backward``, else the
    config's ``recv_window`` (default ``RECV_WINDOW``) and ``backward`` (default split) for the plans
    ``1f1b``, ``zb`` and ``adaptive`` build.

    ``nccl`` (NCCL's point-to-point rules on the direct path: the NCCL backend, or a plug-in's
    ``TransportHooks.p2p_rules``): ``NcclLowering`` with the plan file's ``backward``; a plan file's
    ``recv_window`` does not apply there (each receive is issued where the NCCL lowering puts it)."""
    if cfg.schedule != "plan":  # (the config refuses recv_window with schedule "plan")
        policy = LoweringPolicy(recv_window=cfg.recv_window or RECV_WINDOW, fused=cfg.backward == "fused")
    else:
        try:
            policy = load_model(cfg.plan_file, PlanFile).lowering
        except BadInput as e:
            raise PipeMorphConfigError(f"ds_config pipemorph.plan_file {e}") from None
    return NcclLowering(policy.fused) if nccl else policy


def for_nccl(lowering: Lowering) -> NcclLowering:
    """``lowering`` under NCCL's rules: its fused backward kept, its receive window dropped."""
    return lowering if isinstance(lowering, NcclLowering) else NcclLowering(lowering.fused)


def _check_warmup(warmup: list[int]) -> None:
    try:
        check_lemma1(warmup)
    except ValueError as e:
        raise PipeMorphConfigError(f"ds_config pipemorph.memory.max_inflight cannot be a zb warm-up: {e}") from None


def sent_in_order(plan: Schedule, stage: int) -> set[Kind]:
    """The kinds of message ``stage`` sends that their receiver takes in the order sent: "F" (its
    activations) when the next stage runs its forwards in this stage's order of micro-batches, "B"
    (its input gradients) when the previous stage runs its backwards in this stage's order. Only those
    may wait for an earlier message to be received (``DirectTransport.bound_sends``)."""
    def order(s: int, kind: Kind) -> list[int]:
        return [op.mb for op in plan[s] if op.kind is kind]

    kinds = set()
    if stage + 1 < len(plan) and order(stage, Kind.F) == order(stage + 1, Kind.F):
        kinds.add(Kind.F)
    if stage > 0 and order(stage, Kind.B) == order(stage - 1, Kind.B):
        kinds.add(Kind.B)
    return kinds


def window_kinds(plan: Schedule, lowering: Lowering, window: Optional[int]) -> list[set[Kind]]:
    """Per stage, the kinds whose sends ``window`` may bound (``DirectTransport.bound_sends``): those
    its receiver takes in the order sent (``sent_in_order``), if a dry run of every stage's ordered
    stream with the window bounding them all finds no deadlock (``plan.ir.lower.window_deadlock``);
    else activations only, if that passes; else none. The same on every rank (it reads the plan only).
    Ready dispatch receives every message as it arrives, so what is safe in order is safe there too."""
    S = len(plan)
    none: list[set[Kind]] = [set() for _ in range(S)]
    if window is None:
        return none
    streams = lowering.for_dispatch(Dispatch.ORDERED).lower(plan)
    in_order = [sent_in_order(plan, s) for s in range(S)]
    for kinds in (in_order, [k & {Kind.F} for k in in_order]):
        if window_deadlock(streams, kinds, window) is None:
            return kinds
    return none


def describe_start(cfg: PipeMorphConfig, plan: Schedule, stages: int, microbatches: int,
                   share: float = W_SHARE) -> str:
    """The start-up log line: schedule, dispatch, the plan (its warm-up) and its predicted iteration time.

    A plan file's own prediction (from the profile it was made for) when it has one; otherwise the
    makespan with ``DEFAULT_OP_MS`` per F, B and W and free links, the model the built-in plans start from."""
    S, N = stages, microbatches
    what = {"1f1b": "DeepSpeed's 1F1B order", "zb": "zero-bubble order", "adaptive": "Alg. 1 warm-up",
            "plan": f"plan file {cfg.plan_file}"}[cfg.schedule]
    predicted = None
    if cfg.schedule == "plan":
        try:
            pf = load_model(cfg.plan_file, PlanFile)
            predicted = pf.predicted.iteration_ms if pf.predicted is not None else None
        except BadInput:  # read a moment ago: only a file changed since could get here
            predicted = None
    if predicted is not None:
        when = f"predicted iteration {predicted:.1f} ms (the plan file's prediction)"
    else:
        ms = makespan(plan, Costs.uniform(S, DEFAULT_OP_MS), N)
        when = f"predicted iteration {ms:.1f} ms at {DEFAULT_OP_MS:g} ms per F, B and W before any measurement"
    adapt = ""
    if cfg.schedule == "adaptive" and cfg.adapt.enabled:
        adapt = f"; re-planned from measurements ({cfg.adapt.replan}, every {cfg.adapt.every_iterations} iteration(s))"
    backward = ", backward 'fused' (a B directly followed by its W runs as one pass)" if cfg.backward == "fused" else ""
    return (f"pipemorph: schedule '{cfg.schedule}' ({what}), dispatch '{cfg.dispatch}'{backward}, plan for {S} stages x "
            f"{N} micro-batches with warm-up {warmup_counts(plan)}, {when}{adapt}; {describe_memory(cfg, plan, share)}")


def describe_memory(cfg: PipeMorphConfig, plan: Schedule, share: float = W_SHARE) -> str:
    """The plan's peak activations per stage in micro-batches (the F-to-B ones and, at ``share``, the
    B-to-W ones, a single B's own transient aside), against stock 1F1B's and the budget."""
    S = len(plan)
    peak = [f"{u:g}" for u in peak_units(plan, min(share, 1.0))]
    factor = cfg.memory.budget_in_force
    grant = f"memory.budget {factor:g}x" if factor is not None else "no memory.budget"
    if cfg.memory.budget_mb is not None:
        grant = (f"memory.budget_mb {_listed(cfg.memory.mib_per_stage(S))} MiB per stage from the second iteration "
                 f"on, once the first has measured the activations (stock 1F1B's until then)")
    window = cfg.send_window_in_force
    sends = f"at most {window} per peer" if window is not None else "unbounded"
    posted = ("every receive of an iteration posted up front" if cfg.dispatch is Dispatch.READY
              else f"{cfg.recv_window or RECV_WINDOW} receives posted per kind")
    if cfg.delegation.mode == "off":
        rings = ""
    elif window is not None:
        rings = (f"; a delegated link's staging rings hold at most one message per queue and end on CPU "
                 f"(each message cut into at most {cfg.delegation.slots} pieces; up to {cfg.delegation.queue_cap} queues "
                 f"per direction)")
    else:
        rings = (f"; a delegated link's staging ring: {cfg.delegation.slots} slots of up to "
                 f"{cfg.delegation.slot_mb} MiB per queue and end")
    return (f"activations held at most [{', '.join(peak)}] micro-batches per stage (stock 1F1B: "
            f"{stock_units(S)}; {grant}); messages: sends not known received {sends}, {posted}{rings}")
