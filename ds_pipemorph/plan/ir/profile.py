"""The profile file (docs/design.md contract): per-stage F/B/W times, per-link delays, memory caps.

A profile is what the planner plans for and what the runtime profiler writes. ``Costs`` is the
plain cost model the scheduler and simulator consume.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .ops import KINDS, Kind

Number = Union[float, int]
OpTimes = Callable[[int, str, int], float]  # (stage, kind, micro-batch) -> ms
Durations = list[list[list[float]]]  # dur[stage][kind code][micro-batch] in ms


class ComputeMs(BaseModel):
    """F, B and W ms per stage; one number for a kind means every stage, and ``compute_ms: 10``
    alone means F = B = W = 10 ms on every stage."""

    model_config = ConfigDict(extra="forbid")
    forward: Union[list[float], float]
    backward_input: Union[list[float], float]
    backward_weight: Union[list[float], float]

    @model_validator(mode="before")
    @classmethod
    def _one_number(cls, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return {"forward": v, "backward_input": v, "backward_weight": v}
        return v


class Memory(BaseModel):
    """Either ``max_inflight`` per stage, or ``activation_mb`` + ``capacity_mb`` per stage, and with
    these ``weight_mb``: what B leaves for W of a micro-batch (the graph W still needs and the output
    gradients it keeps), which the engine and ``profile-stages`` measure (``plan.ir.memory``)."""

    model_config = ConfigDict(extra="forbid")
    max_inflight: Optional[list[int]] = None
    activation_mb: Optional[Union[list[float], float]] = None
    capacity_mb: Optional[Union[list[float], float]] = None
    weight_mb: Optional[Union[list[float], float]] = None

    @model_validator(mode="after")
    def _one_form(self) -> "Memory":
        by_bytes = self.activation_mb is not None or self.capacity_mb is not None
        if self.max_inflight is not None and by_bytes:
            raise ValueError("give either max_inflight or activation_mb + capacity_mb, not both")
        if by_bytes and (self.activation_mb is None or self.capacity_mb is None):
            raise ValueError("activation_mb and capacity_mb go together: give both")
        if self.weight_mb is not None and self.activation_mb is None:
            raise ValueError("weight_mb goes with activation_mb and capacity_mb")
        return self


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stages: int = Field(ge=1)
    microbatches: int = Field(ge=1)
    compute_ms: ComputeMs
    links_ms: Optional[list[float]] = None
    memory: Optional[Memory] = None

    @field_validator("links_ms")
    @classmethod
    def _links_nonneg(cls, v):
        return v if v is None else check_delays(v)

    @model_validator(mode="after")
    def _shapes(self) -> "Profile":
        s = self.stages
        for key in ("forward", "backward_input", "backward_weight"):
            vals = _per_stage(getattr(self.compute_ms, key), s, f"compute_ms.{key}")
            for i, t in enumerate(vals):
                if not 0 <= t < math.inf:
                    raise ValueError(f"compute_ms.{key}: stage {i} takes {t:g} ms; a time is a finite number >= 0")
            setattr(self.compute_ms, key, vals)
        if self.links_ms is None:
            self.links_ms = [0.0] * (s - 1)
        elif len(self.links_ms) != s - 1:
            raise ValueError(
                f"links_ms: expected {s - 1} values (one per link between {s} stages), got {len(self.links_ms)}"
            )
        m = self.memory
        if m is not None:
            if m.max_inflight is not None:
                if len(m.max_inflight) != s:
                    raise ValueError(f"memory.max_inflight: expected {s} values (one per stage), got {len(m.max_inflight)}")
                for i, c in enumerate(m.max_inflight):
                    if c < 1:
                        raise ValueError(f"memory.max_inflight: stage {i} must hold at least 1 activation, got {c}")
            elif m.activation_mb is not None:
                m.activation_mb = _per_stage(m.activation_mb, s, "memory.activation_mb")
                m.capacity_mb = _per_stage(m.capacity_mb, s, "memory.capacity_mb")
                for i, (a, c) in enumerate(zip(m.activation_mb, m.capacity_mb)):
                    if not 0 < a < math.inf:
                        raise ValueError(f"memory.activation_mb: stage {i} must be a finite number > 0, got {a}")
                    if not math.isfinite(c):
                        raise ValueError(f"memory.capacity_mb: stage {i} must be a finite number, got {c}")
                    if c < a:
                        raise ValueError(
                            f"memory.capacity_mb: stage {i} cannot hold one activation ({c} MB < {a} MB)"
                        )
                if m.weight_mb is not None:
                    m.weight_mb = _per_stage(m.weight_mb, s, "memory.weight_mb")
                    for i, w in enumerate(m.weight_mb):
                        if not 0 <= w < math.inf:
                            raise ValueError(f"memory.weight_mb: stage {i} must be a finite number >= 0, got {w}")
        return self

    def units(self) -> Optional[list[float]]:
        """Per stage, ``capacity_mb`` in micro-batches' activations (``plan.ir.memory``); None without
        the bytes form."""
        m = self.memory
        if m is None or m.activation_mb is None:
            return None
        return [c / a for a, c in zip(m.activation_mb, m.capacity_mb)]

    def w_share(self) -> float:
        """What B leaves for W against what F leaves for B, the largest over the stages (1 when not
        measured: the generic split keeps at most F's graph)."""
        m = self.memory
        if m is None or m.weight_mb is None:
            return 1.0
        return max(w / a for w, a in zip(m.weight_mb, m.activation_mb))

    def caps(self) -> list[int]:
        """Per-stage cap on in-flight activations (Alg. 1 line 2 from bytes), never above N."""
        n, s = self.microbatches, self.stages
        m = self.memory
        if m is None or (m.max_inflight is None and m.activation_mb is None):
            return [n] * s
        if m.max_inflight is not None:
            return [min(n, c) for c in m.max_inflight]
        # (a hair of slack: capacities written as k x activation_mb, rounded, still hold k)
        return [min(n, int(math.floor(c / a + 1e-6))) for a, c in zip(m.activation_mb, m.capacity_mb)]

    def costs(self) -> "Costs":
        c = self.compute_ms
        return Costs(list(c.forward), list(c.backward_input), list(c.backward_weight), list(self.links_ms))


MIB = 1024 * 1024


def memory_in_mb(f_bytes: Sequence[int], w_bytes: Sequence[int], units: Sequence[float]) -> dict:
    """A profile's ``memory`` section from measured bytes per micro-batch (what F keeps for B, what W
    frees) and each stage's room in micro-batches (``capacity_mb`` = room x ``activation_mb``). Nine
    significant digits: small activations stay above zero, and a capacity of k divides back to k."""
    def mb(x: float) -> float:
        return float(f"{x:.9g}")

    act = [f / MIB for f in f_bytes]
    return {"activation_mb": [mb(a) for a in act], "capacity_mb": [mb(a * u) for a, u in zip(act, units)],
            "weight_mb": [mb(w / MIB) for w in w_bytes]}


def check_delays(delays: list[float]) -> list[float]:
    """Per-link delays in ms, each a finite number >= 0 (ValueError naming the first that is not)."""
    for i, c in enumerate(delays):
        if not 0 <= c < math.inf:
            raise ValueError(f"link {i} has a delay of {c:g} ms; a delay is a finite number >= 0")
    return delays


def _per_stage(v, s: int, key: str) -> list[float]:
    if isinstance(v, (int, float)):
        return [float(v)] * s
    if len(v) != s:
        raise ValueError(f"{key}: expected {s} values (one per stage), got {len(v)}")
    return [float(x) for x in v]


@dataclass(frozen=True)
class Costs:
    """Cost model: per-stage op times and per-link one-way extra delay, all in ms."""

    f: list[float]
    b: list[float]
    w: list[float]
    links: list[float]

    def __post_init__(self):
        # NaN compares false with every time, so a scheduler waiting for it would never end. (Files
        # and options refuse negative and infinite times too; code may probe with them.)
        for what, values in ((Kind.F, self.f), (Kind.B, self.b), (Kind.W, self.w), ("link", self.links)):
            for i, v in enumerate(values):
                if v != v:
                    where = f"link {i}" if what == "link" else f"stage {i}'s {what}"
                    raise ValueError(f"{where} takes nan ms; times and delays are numbers")

    @property
    def stages(self) -> int:
        return len(self.f)

    def op_time(self, stage: int, kind: str) -> float:
        return (self.f if kind == Kind.F else self.b if kind == Kind.B else self.w)[stage]

    def with_links(self, links: list[float]) -> "Costs":
        return Costs(self.f, self.b, self.w, list(links))

    @staticmethod
    def uniform(stages: int, t: float = 10.0, links: Optional[list[float]] = None) -> "Costs":
        return Costs([t] * stages, [t] * stages, [t] * stages, list(links or [0.0] * (stages - 1)))


def op_durations(costs: Costs, microbatches: int,
                 op_times: Union[OpTimes, Mapping[tuple[int, str, int], float], None] = None) -> Durations:
    """``dur[s][kind code][m]`` in ms, the one form the replays take op times in: the times of
    ``costs`` (taken as they are), or ``op_times``: a callable ``(stage, kind, mb) -> ms`` or a
    mapping ``{(stage, kind, mb): ms}`` (a missing key takes the time of ``costs``), each time
    checked to be finite and >= 0 (ValueError naming the first that is not)."""
    S, N = costs.stages, microbatches
    if op_times is None:
        return [[[costs.op_time(s, k)] * N for k in KINDS] for s in range(S)]
    if isinstance(op_times, Mapping):
        table = op_times

        def op_times(s, k, m):
            return table.get((s, k, m), costs.op_time(s, k))

    out = []
    for s in range(S):
        per = []
        for k in KINDS:
            row = [float(op_times(s, k, m)) for m in range(N)]
            for m, t in enumerate(row):
                if not (math.isfinite(t) and t >= 0):
                    raise ValueError(f"op times: stage {s} {k}{m} takes {t} ms; times are finite and >= 0")
            per.append(row)
        out.append(per)
    return out
