"""The ``"pipemorph"`` section of a ds_config (docs/design.md), validated with pydantic.

Unknown keys and wrong types are refused naming the key; types are checked, not converted
(``SectionModel``). Settings accepted but without effect in the chosen schedule (``delegation: auto``
without the adaptive control loop) are named in a warning at start-up (``pending_notes``). The
``inject`` key belongs to a plug-in (``runtime.hooks``): its value is validated by the model the
registered plug-in gives, with the same one-sentence errors.
"""
from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..control.exchange import MAX_GAP
from ..control.modes import DelegationMode, ReplanMode
from ..fileio import describe
from ..plan.ir.lower import Dispatch
from ..plan.ir.memory import budget_units
from . import hooks
from .compat import BUDGET_MB_PLAN_FILE_REFUSED


class PipeMorphConfigError(ValueError):
    """A ``pipemorph`` setting (or the plan it names) cannot be used; the message is one sentence."""


class SectionModel(BaseModel):
    """The base of every model of the section, a plug-in's included (``inject.section``): unknown keys
    are refused, and types are checked, not converted. A JSON config's ``"7"`` is no integer, ``true``
    no integer or number and ``"yes"`` no boolean; an integer stands for a number (``30`` for 30.0),
    as JSON writes whole numbers."""

    model_config = ConfigDict(extra="forbid", strict=True)


# Messages per peer sent but not known received on a direct link (``send_window``) by default.
SEND_WINDOW = 2


class MemoryConfig(SectionModel):
    # Cap on in-flight activations: one value for every stage or one per stage; None derives it
    # from the micro-batch count. Read through ``per_stage`` (the form a job uses: one per stage).
    max_inflight: Optional[Union[int, list[int]]] = None
    # Activation memory a stage may hold, as a multiple of what stock DeepSpeed 1F1B holds on it
    # (S - s micro-batches' activations): 1.0 by default, None for no limit but ``max_inflight``.
    # A ``max_inflight`` given without ``budget`` is the user's grant: the default budget is then off;
    # so is a plan file (``schedule: plan``, set by ``PipeMorphConfig``): it runs as written.
    budget: Optional[float] = 1.0
    # The same memory granted in MiB (what F keeps for B plus what B keeps for W): one value for every
    # stage or one per stage. It becomes micro-batches' activations when the first iteration has
    # measured them (``budget`` 1.0 holds until then); given instead of ``budget``, not with it.
    budget_mb: Optional[Union[float, list[float]]] = None
    _plan_file: bool = PrivateAttr(False)

    @field_validator("max_inflight")
    @classmethod
    def _positive(cls, v):
        for c in _as_list(v):
            if c < 1:
                raise ValueError(f"every stage must hold at least 1 activation, got {c}")
        return v

    @field_validator("budget")
    @classmethod
    def _one_micro_batch(cls, v):
        if v is not None and v < 1.0:
            raise ValueError(f"{v:g} leaves the last stage less than one micro-batch's activations (stock 1F1B "
                             f"holds one there): use at least 1.0, or null for no limit")
        return v

    @field_validator("budget_mb")
    @classmethod
    def _some_mib(cls, v):
        for mib in [v] if isinstance(v, (int, float)) else v or []:
            if not 0 < mib < float("inf"):
                raise ValueError(f"every stage needs some activation memory: {mib:g} MiB is not a positive number "
                                 f"of MiB")
        return v

    @model_validator(mode="after")
    def _one_grant(self):
        if self.budget_mb is not None and "budget" in self.model_fields_set:
            raise ValueError("budget and budget_mb both grant activation memory: give one of them "
                             "(budget: a factor over stock 1F1B's, budget_mb: MiB per stage)")
        return self

    def mib_per_stage(self, stages: int) -> Optional[list[float]]:
        """``budget_mb`` as one value per stage of a ``stages``-stage job (None: not set)."""
        if self.budget_mb is None:
            return None
        mib = [float(self.budget_mb)] * stages if isinstance(self.budget_mb, (int, float)) else list(self.budget_mb)
        if len(mib) != stages:
            raise PipeMorphConfigError(
                f"ds_config pipemorph.memory.budget_mb has {len(mib)} values but the job has {stages} stages: give one "
                f"value per stage, or one for all")
        return mib

    def per_stage(self, stages: int) -> Optional[list[int]]:
        """``max_inflight`` as one value per stage of a ``stages``-stage job (None: not set); the
        config keeps the form it was given in, so that it reads the same when parsed again."""
        if self.max_inflight is None:
            return None
        caps = _as_list(self.max_inflight, stages)
        if len(caps) != stages:
            raise PipeMorphConfigError(
                f"ds_config pipemorph.memory.max_inflight has {len(caps)} values but the job has {stages} stages")
        return caps

    @property
    def budget_in_force(self) -> Optional[float]:
        """The budget factor that applies: ``budget`` as given, or None when ``max_inflight`` was
        given without it (the count is then the grant) or the job runs a plan file (its order and
        memory are the plan's, as ``pipemorph plan`` printed them). With ``budget_mb``, 1.0 until the
        first iteration has measured what that grant holds (the engine's ``MemoryBudget`` then)."""
        if self.budget_mb is not None:
            return 1.0
        if "budget" not in self.model_fields_set and (self.max_inflight is not None or self._plan_file):
            return None
        return self.budget

    def units(self, stages: int) -> Optional[list[float]]:
        """The per-stage budget in micro-batches' activations (``plan.ir.memory``); None: no limit."""
        factor = self.budget_in_force
        return None if factor is None else budget_units(stages, factor)


def _as_list(v: Optional[Union[int, list[int]]], stages: int = 1) -> list[int]:
    """The one place the two forms of ``max_inflight`` meet: a single value stands for every stage."""
    if v is None:
        return []
    return [v] * stages if isinstance(v, int) else list(v)


class AdaptConfig(SectionModel):
    enabled: bool = True
    every_iterations: int = Field(1, ge=1)
    # background: a re-plan first adopts Alg. 2's closed-form warm-up (or keeps the plan in force
    # where that replays faster and still fits the memory), and rank 0's worker process
    # runs the search beside training; every rank switches to its plan at the first boundary after
    # it lands. inline: the search runs at the boundary while every rank waits for it.
    replan: ReplanMode = "background"
    # The search's effort per re-plan, in replays (an evaluation bound: the same input gives the
    # same plan on any machine).
    search_evals: int = Field(2000, ge=1)


class RebalanceConfig(SectionModel):
    """Compute stragglers (DynPipe): move layers away from a stage that runs slower than expected."""

    enabled: bool = False
    # A stage is a straggler when its F + B + W run this fraction above what its layers are expected
    # to cost (or recovers when back within it) ...
    noise: float = Field(0.15, gt=0)
    # ... for this many iterations in a row.
    patience: int = Field(2, ge=1)
    # Layers move only if the predicted iteration time improves by at least this fraction.
    min_gain: float = Field(0.05, ge=0, lt=1)
    # Iterations measured at the start to learn what each layer costs, when layer_profile is not given
    # (layers of the same signature cost the same on every stage; see docs/rebalance.md).
    warmup_iterations: int = Field(2, ge=1)
    # A layer profile (docs/partition.md): per-layer times, used instead of the warm-up measurement.
    layer_profile: Optional[str] = None
    # Seconds a migration's transfer may take; past it the attempt is abandoned, every rank keeps the
    # old partition, and the next detection tries again.
    timeout_s: float = Field(60.0, gt=0)


class CompareConfig(SectionModel):
    # Alternate the job's own schedule and dispatch (B) with this schedule and dispatch (A) at
    # iteration boundaries, in the cycle A B A' B, and log B/A per pair with its 95 % interval when
    # the comparison ends (runtime/ab_compare.py). None: no comparison.
    schedule: Optional[Literal["1f1b", "zb"]] = None
    dispatch: Dispatch = Field(Dispatch.ORDERED, strict=False)  # its text, read as a Dispatch
    # A's backward ("split" or "fused", as pipemorph.backward); None: the job's own.
    backward: Optional[Literal["split", "fused"]] = None
    # Iterations at the start that alternate but are not measured (the first ones build programs,
    # start threads and measure memory; an adaptive B re-plans in its first ones).
    warmup: int = Field(4, ge=0)
    # Measured iterations; then the result is logged and the job runs B only. None: until training
    # ends (the result is logged when the engine is destroyed or the process exits).
    iterations: Optional[int] = Field(None, ge=12)  # fewer give fewer than 6 B/A pairs: no 95 % interval


class OrchestrateConfig(SectionModel):
    """A slow data-parallel link moved into the pipeline while training runs (PipeMorph §6)."""

    # The link matrix of `pipemorph profile-links --all-pairs` (null: off).
    matrix: Optional[str] = None
    # Gradient MB per stage the all-reduce moves (null: each stage's parameter bytes, measured).
    grad_mb: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    # The size of each all-reduce message in MB, as in `pipemorph place --chunk-mb` (null: one per part).
    chunk_mb: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    # A stage's all-reduce this fraction above what the best placement's ring would take ...
    noise: float = Field(0.25, gt=0)
    # ... in each of this many iterations in a row is a data-parallel straggler.
    patience: int = Field(2, ge=1)
    # Re-map only if the predicted iteration time improves by at least this fraction.
    min_gain: float = Field(0.05, ge=0, lt=1)


class DelegationConfig(SectionModel):
    mode: DelegationMode = "auto"
    queues: int = Field(2, ge=1)  # delegate FIFOs per link direction at the start
    # The control loop gives a delegated link more queues, up to this many, when its delay needs them
    # to keep pace with the stages (§5.2: k FIFOs carry k messages per delay); = queues: never grows.
    # Their delegates start with the link's first (so growing is a switch, not a start). Default:
    # max(queues, 4).
    max_queues: Optional[int] = Field(None, ge=1)
    # Network interfaces for the delegates' Gloo groups, in turn (§5.3): a delegate pair that meets
    # again after its connection broke (generation g) uses interfaces[g % len]; None: Gloo's default.
    # Each rank checks at start-up that its host has them.
    interfaces: Optional[list[str]] = None
    # Staging ring per delegate queue: ``slots`` slots of ``slot_mb`` MiB. A message larger than a
    # slot travels in pieces, and every piece costs the delegates round trips on the wire. On CPU a
    # slot's pages are allocated only as far as messages reach; on a GPU the whole ring is pinned.
    slot_mb: int = Field(64, ge=1)
    slots: int = Field(4, ge=2)

    @field_validator("interfaces")
    @classmethod
    def _interface_names(cls, v):
        if v is not None and (not v or any(not n.strip() for n in v)):
            raise ValueError("must be a non-empty list of network interface names, e.g. [\"eth0\", \"eth1\"]")
        return v

    @model_validator(mode="after")
    def _max_at_least_queues(self):
        if self.max_queues is not None and self.max_queues < self.queues:
            raise ValueError(f"delegation.max_queues ({self.max_queues}) must be at least delegation.queues "
                             f"({self.queues})")
        return self

    @property
    def queue_cap(self) -> int:
        """Queues a delegated link may grow to (and starts delegates for)."""
        return self.max_queues if self.max_queues is not None else max(self.queues, 4)


class PipeMorphConfig(SectionModel):
    # 1f1b: DeepSpeed's 1F1B order, each backward run as B immediately followed by its W; zb: ZB-H1
    # warm-up (S - s) or memory.max_inflight; adaptive: Alg. 1 warm-up, re-planned from measurements;
    # plan: the plan in plan_file (runtime/plans.py builds each).
    schedule: Literal["1f1b", "zb", "adaptive", "plan"] = "adaptive"
    plan_file: Optional[str] = None
    # ordered: each stage runs its plan's order as written; ready: the order is a hint, each stage
    # runs the first ready op in it (RRFP), holding no more activations than the plan does.
    dispatch: Dispatch = Field(Dispatch.ORDERED, strict=False)  # its text, read as a Dispatch
    # Receives of each kind posted ahead under ordered dispatch (plan.ir.lower); None: the default
    # (RECV_WINDOW). A plan file names its own (refused here with schedule "plan").
    recv_window: Optional[int] = Field(None, ge=1)
    # split: B and W apart (the input gradient leaves after B); fused: a B directly followed by its W
    # in the plan runs as one backward pass, as stock's, its input gradient leaving after it. A plan
    # file names its own (refused here with schedule "plan").
    backward: Literal["split", "fused"] = "split"
    # Messages a stage keeps sent but not known received, per peer, on a direct link where a send
    # completes only when waited for (gloo); each holds its tensors, so the window bounds that memory. None: the
    # default (SEND_WINDOW), unbounded where no memory budget is in force.
    send_window: Optional[int] = Field(None, ge=1)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    adapt: AdaptConfig = Field(default_factory=AdaptConfig)
    delegation: DelegationConfig = Field(default_factory=DelegationConfig)
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig)
    orchestrate: OrchestrateConfig = Field(default_factory=OrchestrateConfig)
    compare: CompareConfig = Field(default_factory=CompareConfig)
    # The control loops (adapt, rebalance, orchestrate) exchange their measurements (one collective)
    # every iteration while anything changes, and 2, 4, ... up to this many iterations apart while
    # nothing does (control/exchange.py): a change is acted on at most this many - 1 iterations
    # later. 1: every iteration.
    max_exchange_gap: int = Field(MAX_GAP, ge=1)
    # Testing only: validated by the plug-in registered for it (``ds_pipemorph.inject``).
    inject: Any = Field(None, validate_default=True)
    nvtx: bool = True
    timeline: Optional[str] = None
    # Path: with the adaptive control loop, rank 0 writes the smoothed measurements there as a profile
    # file (docs/design.md; input of `pipemorph plan`) at every re-plan and at the end of training.
    profile_out: Optional[str] = None
    # Seconds any wait on another rank may take before failing with a message naming the op.
    timeout_s: float = Field(300.0, gt=0)

    @property
    def send_window_in_force(self) -> Optional[int]:
        """The direct path's send window: ``send_window``, else ``SEND_WINDOW``; none (no bound) when no
        memory budget is in force (``memory.budget: null``, a ``max_inflight`` grant, a plan file) and
        ``send_window`` is not set."""
        if self.send_window is not None:
            return self.send_window
        return None if self.memory.budget_in_force is None else SEND_WINDOW

    @field_validator("profile_out")
    @classmethod
    def _a_path(cls, v):
        if v is not None and not v.strip():
            raise ValueError("profile_out must be a file path (or null)")
        return v

    @field_validator(*hooks.PLUGIN_SECTIONS, mode="before")
    @classmethod
    def _plugin_section(cls, v, info):
        plugin = hooks.plugin(info.field_name)
        if plugin is not None:
            return plugin.parse(v)
        if v:
            raise ValueError(f"no plug-in reads '{info.field_name}' in this process (import ds_pipemorph first)")
        return None

    @model_validator(mode="after")
    def _plan_file(self) -> "PipeMorphConfig":
        if self.schedule == "plan" and not self.plan_file:
            raise ValueError("schedule 'plan' needs plan_file: the path of a plan from `pipemorph plan`")
        self.memory._plan_file = self.schedule == "plan"
        if self.schedule == "plan" and self.memory.budget_mb is not None:
            raise ValueError(BUDGET_MB_PLAN_FILE_REFUSED)
        if self.schedule != "plan" and self.plan_file:
            raise ValueError(f"plan_file is only read with schedule 'plan', not '{self.schedule}'")
        if self.schedule == "adaptive" and self.backward == "fused":
            raise ValueError("backward 'fused' runs the orders of schedule '1f1b' and 'zb' as written; 'adaptive' "
                             "plans and re-plans for a split backward: set backward to 'split' or choose "
                             "another schedule")
        if self.schedule == "plan" and self.backward != "split":
            raise ValueError("backward does not apply to a plan file, which names its own: set backward in the "
                             "plan file instead")
        if self.schedule == "plan" and self.recv_window is not None:
            raise ValueError("recv_window does not apply to a plan file, which names its own: set recv_window in "
                             "the plan file instead")
        for plugin, settings in hooks.active_plugins(self):
            plugin.check(settings, self)
        return self


def parse_config(section) -> PipeMorphConfig:
    """Validate the ``pipemorph`` section (a dict or None); raise PipeMorphConfigError naming the key."""
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise PipeMorphConfigError("ds_config 'pipemorph' must be a mapping of keys")
    try:
        cfg = PipeMorphConfig.model_validate(section)
    except ValidationError as e:
        raise PipeMorphConfigError(f"ds_config pipemorph: {describe(e)}") from None
    return cfg


# Every file path of the section outside plug-in sections, as (section, key) routes: relative ones are
# resolved by ``resolve_paths``, as are those of registered plug-ins (``path_keys``).
PATH_KEYS = (("plan_file",), ("timeline",), ("profile_out",), ("rebalance", "layer_profile"),
             ("orchestrate", "matrix"))


def path_keys() -> tuple[tuple[str, ...], ...]:
    """``PATH_KEYS`` and the file-path routes of every registered plug-in's section."""
    extra = tuple((key, *route) for key in hooks.PLUGIN_SECTIONS if hooks.plugin(key) is not None
                  for route in hooks.plugin(key).path_keys)
    return PATH_KEYS + extra


def resolve_paths(section, base: str | os.PathLike):
    """A copy of the ``pipemorph`` section (a dict) with every relative path of ``path_keys()`` made absolute
    against ``base`` (``~`` expanded); anything that is not a non-blank string is left for validation.

    ``base`` is the directory of the config file when the config was given as a file, else the working
    directory: a config and the files it names can move together, and every later reader (each rank, a
    re-mapping's new engine, an error message) sees the one absolute path that was tried."""
    if not isinstance(section, dict):
        return section
    out = dict(section)
    for route in path_keys():
        *parents, key = route
        holder = out
        for name in parents:
            if not isinstance(holder.get(name), dict):
                break
            holder[name] = holder = dict(holder[name])
        else:
            v = holder.get(key)
            if isinstance(v, str) and v.strip():
                holder[key] = os.path.normpath(os.path.join(os.fspath(base), os.path.expanduser(v)))
    return out


def pending_notes(cfg: PipeMorphConfig) -> list[str]:
    """Settings accepted but without effect under the chosen schedule, one sentence each (logged at start-up)."""
    notes = []
    if ("mode" in cfg.delegation.model_fields_set and cfg.delegation.mode == "auto"
            and not (cfg.schedule == "adaptive" and cfg.adapt.enabled)):
        notes.append("pipemorph.delegation 'auto' follows the straggler detector, which runs with schedule "
                     "'adaptive' and adapt.enabled only: every link stays direct")
    if "adapt" in cfg.model_fields_set and cfg.adapt.enabled and cfg.schedule != "adaptive":
        notes.append(f"pipemorph.adapt re-plans with schedule 'adaptive' only: the '{cfg.schedule}' schedule "
                     f"runs unchanged (drop 'adapt' or set adapt.enabled false)")
    if cfg.profile_out and not (cfg.schedule == "adaptive" and cfg.adapt.enabled):
        notes.append(f"pipemorph.profile_out is written by the control loop, which runs with schedule 'adaptive' "
                     f"and adapt.enabled only: {cfg.profile_out} will not be written")
    if cfg.recv_window is not None and cfg.dispatch is Dispatch.READY:
        notes.append("pipemorph.recv_window applies to dispatch 'ordered': dispatch 'ready' posts every receive "
                     "of an iteration before the first op that needs one")
    return notes
