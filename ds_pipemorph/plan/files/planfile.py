"""The plan file (docs/design.md contract): warm-up counts, per-stage op orders, prediction, profile."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ...fileio import BadInput, load_mapping, validate_model
from ..ir.lower import RECV_WINDOW, LoweringPolicy
from ..ir.ops import Schedule, format_stage, warmup_counts
from ..ir.profile import Costs, Profile
from ..sim.simulate import replay
from ..sim.validate import InvalidPlan, parse_schedule, validate_schedule
from .kinds import refuse_other_kind


class Predicted(BaseModel):
    model_config = ConfigDict(extra="allow")
    iteration_ms: float
    bubble_rate: float
    peak_inflight: list[int]


class PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Literal[1] = 1
    stages: int = Field(ge=1)
    microbatches: int = Field(ge=1)
    warmup: list[int]
    schedule: list[list[str]]
    # Extension: "fused" marks a plan whose B m is fused with the W m right after it (stock
    # DeepSpeed's BackwardPass); the input gradient then leaves the stage after W. Default "split".
    backward: Literal["split", "fused"] = "split"
    # Extension: receives of each kind posted ahead of the ops that consume them when the plan is
    # lowered (``plan.ir.lower.LoweringPolicy``); files without it get the default.
    recv_window: int = Field(RECV_WINDOW, ge=1)
    predicted: Optional[Predicted] = None
    profile: Optional[Profile] = None

    def ops(self) -> Schedule:
        """Parsed and validated orders; raises InvalidPlan naming the first offending op."""
        if self.profile is not None:
            for key in ("stages", "microbatches"):
                if getattr(self.profile, key) != getattr(self, key):
                    raise InvalidPlan(
                        f"profile.{key} is {getattr(self.profile, key)} but the plan has {getattr(self, key)} {key}"
                    )
        sched = parse_schedule(self.schedule)
        validate_schedule(sched, self.stages, self.microbatches)
        if len(self.warmup) != self.stages:
            raise InvalidPlan(f"warmup: expected {self.stages} values (one per stage), got {len(self.warmup)}")
        actual = warmup_counts(sched)
        for s, (x, a) in enumerate(zip(self.warmup, actual)):
            if x != a:
                raise InvalidPlan(f"warmup: stage {s} says {x} but its schedule runs {a} forwards before its first B")
        return sched

    @classmethod
    def read(cls, path) -> tuple["PlanFile", Schedule]:
        """The plan file at ``path`` and its validated orders; BadInput names the file and the op."""
        data = _read_json(path)
        if data is None:
            data = load_mapping(path)
        refuse_other_kind(path, data, "plan")  # e.g. the profile a plan is made from
        pf = validate_model(path, data, cls)
        try:
            return pf, pf.ops()
        except InvalidPlan as e:
            raise BadInput(f"{path}: {e}") from None

    @property
    def fused(self) -> bool:
        return self.backward == "fused"

    @property
    def lowering(self) -> LoweringPolicy:
        """How this plan becomes per-rank streams, for the engine, ``simulate --lowered`` and ``export``."""
        return LoweringPolicy(recv_window=self.recv_window, fused=self.fused)

    @classmethod
    def build(cls, schedule: Schedule, profile: Profile, *, fused: bool = False) -> "PlanFile":
        tl = replay(schedule, profile.costs(), profile.microbatches, fused_backward=fused)
        return cls(
            stages=profile.stages,
            microbatches=profile.microbatches,
            warmup=warmup_counts(schedule),
            schedule=[format_stage(r) for r in schedule],
            backward="fused" if fused else "split",
            predicted=Predicted(
                iteration_ms=round(tl.iteration_ms, 6),
                bubble_rate=round(tl.bubble_rate, 6),
                peak_inflight=tl.peak_inflight,
            ),
            profile=profile,
        )

    def costs(self) -> Optional[Costs]:
        return self.profile.costs() if self.profile else None


def _read_json(path) -> Optional[dict]:
    """A ``.json`` plan's mapping through the json module (a C parser: a 64 x 1024 plan in a tenth of
    the time the YAML loader takes); None if the file is not such, and ``load_mapping`` then reads
    it and says what is wrong."""
    p = Path(path)
    if p.suffix.lower() != ".json" or not p.is_file():
        return None
    try:
        data = json.loads(p.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None
