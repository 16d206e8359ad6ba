"""The ``pipemorph.inject`` section of a ds_config: what the injection plug-in is asked to make.

Validated as every other section is (``runtime.config.SectionModel``: unknown keys refused, types
checked, not converted, one sentence naming the key): the runtime's ``PipeMorphConfig`` keeps the
``inject`` key and hands its value to ``InjectConfig`` through the registered plug-in
(``inject.plugin``). Torch-free: ``ds_pipemorph`` imports it at start.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from ..runtime.config import SectionModel


class LinkInject(SectionModel):
    delay_ms: float = Field(0.0, ge=0, allow_inf_nan=False)


class KillDelegateInject(SectionModel):
    link: int = Field(ge=0)
    after: int = Field(ge=1)  # activation messages on the link before the kill
    side: Literal["send", "recv"] = "send"


class FaultsInject(SectionModel):
    # link -> K: each direction of the link's direct path carries K messages, then fails (``inject.faults``)
    link_fails_after: dict[str, int] = Field(default_factory=dict)
    kill_delegate: Optional[KillDelegateInject] = None

    @field_validator("link_fails_after")
    @classmethod
    def _fail_keys(cls, v):
        for k, n in v.items():
            if not k.isdigit():
                raise ValueError(f"link '{k}' is not a link index (write \"0\", \"1\", ...)")
            if n < 0:
                raise ValueError(f"link {k} cannot fail after a negative number of messages ({n})")
        return v


def stage_keys(v):
    """Stage keys of a factor mapping as text: ``{2: 2.0}`` (Python, YAML) means ``{"2": 2.0}`` (JSON)."""
    if isinstance(v, dict):
        return {k if isinstance(k, str) else str(k): f for k, f in v.items()}  # True -> 'True': refused below
    return v


def check_factors(v: dict[str, float]) -> dict[str, float]:
    """Stage -> slow-down factor: keys are stage indices, factors finite and >= 1 (1 = unchanged).

    A factor below 1 would need a faster op, which waiting cannot make: it is refused, not ignored."""
    for k, f in v.items():
        if not k.isdigit():
            raise ValueError(f"stage '{k}' is not a stage index (write \"0\", \"1\", ...)")
        if not 1.0 <= f < math.inf:
            raise ValueError(f"stage {k}'s factor must be a finite number >= 1 (1 = unchanged, 2.0 = its F, B and W "
                             f"take twice as long), got {f:g}")
    return v


# Stage -> slow-down factor, as a config or a trace file writes it (see ``check_factors``).
StageFactors = Annotated[dict[str, float], BeforeValidator(stage_keys), AfterValidator(check_factors)]


class InjectConfig(SectionModel):
    links: dict[str, LinkInject] = Field(default_factory=dict)
    trace: Optional[str] = None
    faults: Optional[FaultsInject] = None  # testing only: failover (PipeMorph §5.3)
    # Testing only: stage -> factor; each F, B and W of the stage waits (factor - 1) x its own measured
    # time after it ran (``inject.compute``), from the first iteration on.
    compute: StageFactors = Field(default_factory=dict)
    # Testing only: a file ``points: [{iteration: k, factors: {"2": 2.0}}, ...]``; from train_batch k on
    # (0 = the engine's first), the point's factors (stages it does not name: 1; before the first point: 1).
    compute_trace: Optional[str] = None
    # Testing only: "a-b" (global ranks) -> one-way ms on the link between them: a pipeline link
    # between them pays it per message, an all-reduce ring that uses it 2(D - 1) times (``inject.rank_links``).
    rank_links: dict[str, float] = Field(default_factory=dict)
    # Testing only: messages each part of a ring all-reduce travels as (its size over the bucket
    # size); each pays a slow ring link's delay once.
    allreduce_messages: int = Field(1, ge=1)
    # Testing only: migration attempts (0 = the first) at which every sending rank sends the size of
    # its layers' state but never the state itself, as a connection lost mid-transfer would.
    migration_drop: list[int] = Field(default_factory=list)
    # Testing only: the direct path runs under NCCL's point-to-point rules on gloo (``inject.nccl_double``):
    # one serial queue per pair of ranks, tags ignored, a send completes with its receive.
    nccl_rules: bool = False

    @field_validator("links")
    @classmethod
    def _link_keys(cls, v):
        for k in v:
            if not k.isdigit():
                raise ValueError(f"link '{k}' is not a link index (write \"0\", \"1\", ...)")
        return v

    @field_validator("rank_links")
    @classmethod
    def _rank_pairs(cls, v):
        for k, ms in v.items():
            a, _, b = k.partition("-")
            if not (a.isdigit() and b.isdigit()) or a == b:
                raise ValueError(f"rank_links: '{k}' is not a pair of two different global ranks (write \"0-4\")")
            if not 0.0 <= ms < math.inf:
                raise ValueError(f"rank_links: the delay of '{k}' must be a finite number of ms >= 0, got {ms:g}")
        return v

    @field_validator("compute_trace")
    @classmethod
    def _compute_trace_path(cls, v):
        if v is not None and not v.strip():
            raise ValueError("compute_trace must be a file path (or null)")
        return v

    @model_validator(mode="after")
    def _one_compute_form(self):
        if self.compute and self.compute_trace:
            raise ValueError("give inject.compute (factors from the first iteration) or inject.compute_trace "
                             "(factors by iteration), not both")
        return self
