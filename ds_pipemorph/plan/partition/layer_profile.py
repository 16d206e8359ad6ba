"""The layer profile file (docs/partition.md contract): per-layer costs and sizes, for partitioning.

A stage profile (``profile.Profile``) says what each stage costs once the model is cut; a layer
profile says what each layer costs, so that ``plan.partition`` can choose the cut. A partition
(DeepSpeed's ``parts`` list) turns a layer profile into a stage profile: stage times are sums of
layer times, a link's delay is its latency plus the boundary's transfer time, and the memory of a
stage gives its cap on in-flight activations. Per-stage slowdown factors (``check_slowdown``) scale
a stage's layer times, for a stage that shares its device with other work.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from ...fileio import BadInput, describe, load_mapping
from ..files.kinds import refuse_other_kind
from ..ir.profile import ComputeMs, Costs, Memory, Profile
from .parts import check_parts

PerItem = Union[list[float], float]


_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


class Layers(BaseModel):
    """One value per layer, in model order (a single number: the same for every layer)."""

    model_config = _CONFIG
    forward_ms: list[float]
    backward_input_ms: PerItem
    backward_weight_ms: PerItem
    activation_mb: PerItem = 0.0  # sent forward when a stage boundary is right after this layer
    gradient_mb: Optional[PerItem] = None  # sent back across that boundary; default: activation_mb
    memory_mb: PerItem = 0.0  # held for the whole iteration: parameters, gradients, optimizer state
    stash_mb: PerItem = 0.0  # held per in-flight micro-batch (F done, B not done: the planner's cap)
    param_count: Optional[PerItem] = None  # for the parameter-balanced baseline; default: memory_mb


class Links(BaseModel):
    """One value for every link, or one per link (stages − 1)."""

    model_config = _CONFIG
    bandwidth_gbs: Optional[PerItem] = None  # None: transfers take no time, only the latency
    latency_ms: PerItem = 0.0


class StageMemory(BaseModel):
    """Per-stage limits: one value for every stage, or one per stage."""

    model_config = _CONFIG
    capacity_mb: Optional[PerItem] = None
    max_inflight: Optional[Union[list[int], int]] = None


class LayerProfile(BaseModel):
    model_config = _CONFIG
    stages: int = Field(ge=1)
    microbatches: int = Field(ge=1)
    layers: Layers
    links: Links = Links()
    memory: StageMemory = StageMemory()
    _bandwidth: list[float] = PrivateAttr(default_factory=list)  # GB/s per link, inf when not given
    _prefix: tuple = PrivateAttr(default=())  # prefix sums of forward, backward_input, backward_weight

    @model_validator(mode="before")
    @classmethod
    def _not_a_stage_profile(cls, data):
        if isinstance(data, dict) and "compute_ms" in data and "layers" not in data:
            raise ValueError("this is a stage profile (compute_ms); partitioning needs per-layer times under 'layers'")
        return data

    @model_validator(mode="after")
    def _shapes(self) -> "LayerProfile":
        lay, n_layers, s = self.layers, len(self.layers.forward_ms), self.stages
        if n_layers < s:
            raise ValueError(f"layers.forward_ms: {n_layers} layers cannot fill {s} stages (give at least one per stage)")
        if lay.gradient_mb is None:
            lay.gradient_mb = lay.activation_mb
        if lay.param_count is None:
            lay.param_count = lay.memory_mb
        for key in ("forward_ms", "backward_input_ms", "backward_weight_ms", "activation_mb", "gradient_mb",
                    "memory_mb", "stash_mb", "param_count"):
            vals = _expand(getattr(lay, key), n_layers, f"layers.{key}", "layer")
            _non_negative(vals, f"layers.{key}", "layer")
            setattr(lay, key, vals)
        bw = _expand(float("inf") if self.links.bandwidth_gbs is None else self.links.bandwidth_gbs,
                     s - 1, "links.bandwidth_gbs", "link")
        for i, v in enumerate(bw):
            if not v > 0:
                raise ValueError(f"links.bandwidth_gbs: link {i} must be positive, got {v}")
        self._bandwidth = bw
        lat = _expand(self.links.latency_ms, s - 1, "links.latency_ms", "link")
        _non_negative(lat, "links.latency_ms", "link")
        self.links.latency_ms = lat
        self._prefix = tuple(_prefix_sums(v) for v in (lay.forward_ms, lay.backward_input_ms, lay.backward_weight_ms))
        mem = self.memory
        if mem.capacity_mb is not None:
            mem.capacity_mb = _expand(mem.capacity_mb, s, "memory.capacity_mb", "stage")
            for i, v in enumerate(mem.capacity_mb):
                if not v > 0:
                    raise ValueError(f"memory.capacity_mb: stage {i} must be positive, got {v}")
        if mem.max_inflight is not None:
            caps = [mem.max_inflight] * s if isinstance(mem.max_inflight, int) else list(mem.max_inflight)
            if len(caps) != s:
                raise ValueError(f"memory.max_inflight: expected 1 or {s} values (one per stage), got {len(caps)}")
            for i, c in enumerate(caps):
                if c < 1:
                    raise ValueError(f"memory.max_inflight: stage {i} must hold at least 1 activation, got {c}")
            mem.max_inflight = caps
        return self

    @property
    def num_layers(self) -> int:
        return len(self.layers.forward_ms)

    def link_ms(self, layer: int, link: int) -> float:
        """Delay of link ``link`` when a boundary is right after ``layer``: latency + transfer.

        The planner's cost model has one delay per link for both directions, so the activation
        (down) and gradient (up) transfers are averaged: every round trip, Eq. 7's (A + G) / b,
        stays exact. MB / (GB/s) is ms."""
        lay = self.layers
        size = (lay.activation_mb[layer] + lay.gradient_mb[layer]) / 2
        return self.links.latency_ms[link] + size / self._bandwidth[link]

    def stage_cap(self, stage: int, start: int, stop: int) -> Optional[int]:
        """In-flight cap of ``stage`` holding layers ``start..stop-1``; None if it cannot hold them."""
        lay, mem, n = self.layers, self.memory, self.microbatches
        cap = n if mem.max_inflight is None else min(n, mem.max_inflight[stage])
        if mem.capacity_mb is None:
            return cap
        free = mem.capacity_mb[stage] - sum(lay.memory_mb[start:stop])
        stash = sum(lay.stash_mb[start:stop])
        if free < 0 or (stash > 0 and free < stash):
            return None
        return cap if stash <= 0 else min(cap, int(free // stash))

    def stage_memory_mb(self, parts: list[int]) -> list[float]:
        """Per stage: static memory plus the stash of a full cap of in-flight micro-batches."""
        lay, out = self.layers, []
        caps = self.caps(parts)
        for s in range(self.stages):
            a, e = parts[s], parts[s + 1]
            k = caps[s] if caps is not None and caps[s] is not None else self.microbatches
            out.append(sum(lay.memory_mb[a:e]) + k * sum(lay.stash_mb[a:e]))
        return out

    def caps(self, parts: list[int]) -> list[Optional[int]]:
        """Per stage, ``stage_cap`` of its layers (None where they do not fit)."""
        return [self.stage_cap(s, parts[s], parts[s + 1]) for s in range(self.stages)]

    def check(self, parts: list[int]) -> list[int]:
        """``parts`` if it cuts this profile's layers into its stages; else BadInput saying why."""
        return check_parts(parts, layers=self.num_layers, stages=self.stages)

    def costs(self, parts: list[int], slowdown: Optional[Sequence[float]] = None) -> Costs:
        """The stage cost model of a partition: per-stage sums of the layer times (from prefix
        sums, so every caller gets the same floats) and per-link delays. With ``slowdown`` (one
        factor per stage, ``check_slowdown``), stage s's F, B and W sums are multiplied by
        ``slowdown[s]``; link delays are not scaled."""
        S = self.stages
        scale = check_slowdown(slowdown, S)
        f, b, w = ([(p[parts[s + 1]] - p[parts[s]]) * scale[s] for s in range(S)] for p in self._prefix)
        return Costs(f, b, w, [self.link_ms(parts[i + 1] - 1, i) for i in range(S - 1)])

    def stage_profile(self, parts: list[int], slowdown: Optional[Sequence[float]] = None) -> Profile:
        """The stage profile of a partition (what ``pipemorph plan`` reads), with stage times
        scaled by ``slowdown`` as in ``costs``; BadInput if a stage does not fit its memory or
        ``parts`` does not cut the layers into the stages."""
        self.check(parts)
        caps = self.caps(parts)
        for s, c in enumerate(caps):
            if c is None:
                raise BadInput(f"stage {s} (layers {parts[s]}..{parts[s + 1] - 1}) does not fit memory.capacity_mb")
        c = self.costs(parts, slowdown)
        limited = any(k < self.microbatches for k in caps)
        return Profile(
            stages=self.stages, microbatches=self.microbatches,
            compute_ms=ComputeMs(forward=c.f, backward_input=c.b, backward_weight=c.w),
            links_ms=[round(x, 9) for x in c.links],
            memory=Memory(max_inflight=caps) if limited else None,
        )


def check_slowdown(slowdown: Optional[Sequence[float]], stages: int) -> list[float]:
    """One finite factor > 0 per stage (stage s runs each of its layers ``slowdown[s]`` times as
    long as profiled); None means 1.0 everywhere. BadInput naming what to fix otherwise."""
    if slowdown is None:
        return [1.0] * stages
    if isinstance(slowdown, (str, bytes)) or not hasattr(slowdown, "__len__"):
        raise BadInput(f"slowdown: expected a list of {stages} factors (one per stage), got {slowdown!r}")
    if len(slowdown) != stages:
        raise BadInput(f"slowdown: expected {stages} factors (one per stage), got {len(slowdown)}")
    out = []
    for s, v in enumerate(slowdown):
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        if not ok:
            raise BadInput(f"slowdown: stage {s}'s factor must be a finite number above 0, got {v!r}")
        out.append(float(v))
    return out


def read_layer_profile(path, *, stages: Optional[int] = None, microbatches: Optional[int] = None) -> LayerProfile:
    """The layer profile at ``path`` (YAML or JSON), with ``stages`` / ``microbatches`` in place of
    the file's when given; BadInput naming the file and the first key at fault."""
    data = load_mapping(path)
    refuse_other_kind(path, data, "layer profile",
                      instead={"profile": "partitioning needs per-layer times under 'layers'"})
    if stages is not None:
        data["stages"] = stages
    if microbatches is not None:
        data["microbatches"] = microbatches
    try:
        return LayerProfile.model_validate(data)
    except ValidationError as e:
        raise BadInput(f"{path}: {describe(e)}") from None


def _prefix_sums(v: list[float]) -> list[float]:
    out = [0.0]
    for x in v:
        out.append(out[-1] + x)
    return out


def _expand(v, n: int, key: str, what: str) -> list[float]:
    if isinstance(v, (int, float)):
        return [float(v)] * n
    if len(v) != n:
        raise ValueError(f"{key}: expected {n} values (one per {what}) or one for all, got {len(v)}")
    return [float(x) for x in v]


def _non_negative(vals: list[float], key: str, what: str) -> None:
    for i, v in enumerate(vals):
        if v < 0:
            raise ValueError(f"{key}: {what} {i} is negative ({v})")
