"""The parts file (docs/partition.md contract) and DeepSpeed's own partition methods, torch-free.

A partition is DeepSpeed's ``parts`` list: ``parts[0] = 0 < ... < parts[S] = L``, stage s owns layers
``parts[s]..parts[s+1]-1``. ``pipemorph partition`` writes it with what it predicts for it and the
planned schedule; ``runtime.parts_module`` builds a ``PipelineModule`` on it. ``uniform_parts``
and ``balanced_parts`` are DeepSpeed's ``partition_method="uniform"`` and ``"parameters"`` (same
results as ``deepspeed.runtime.utils.partition_uniform`` / ``partition_balanced``), the baselines
a chosen partition is compared with.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...fileio import BadInput, load_model


class StageMs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    forward: list[float]
    backward_input: list[float]
    backward_weight: list[float]


class PartsPredicted(BaseModel):
    model_config = ConfigDict(extra="forbid")
    iteration_ms: float  # the planned schedule (``schedule``) replayed under the stage costs below
    search_ms: Optional[float] = None  # the partition search's objective: best of four greedy plans
    lower_bound_ms: Optional[float] = None  # no partition of the profile, with any plan, is faster
    complete: Optional[bool] = None  # the search ran to the end: no partition beats it on search_ms


class PartsFile(BaseModel):
    """What ``pipemorph partition`` writes; only ``parts`` is required (docs/partition.md)."""

    model_config = ConfigDict(extra="forbid")
    version: Literal[1] = 1
    parts: list[int]
    microbatches: Optional[int] = Field(default=None, ge=1)
    predicted: Optional[PartsPredicted] = None
    stage_ms: Optional[StageMs] = None  # per-stage sums of the layer times
    links_ms: Optional[list[float]] = None  # per-link delay: latency + boundary transfer
    max_inflight: Optional[list[int]] = None  # per-stage cap on in-flight activations
    memory_mb: Optional[list[float]] = None  # per stage: static + stash of max_inflight micro-batches
    warmup: Optional[list[int]] = None  # the planned schedule's warm-up counts
    schedule: Optional[list[list[str]]] = None  # the planned schedule: one op list per stage

    @model_validator(mode="after")
    def _shape(self) -> "PartsFile":
        check_parts(self.parts)
        s = self.stages
        for key, n in (("links_ms", s - 1), ("max_inflight", s), ("memory_mb", s), ("warmup", s), ("schedule", s)):
            v = getattr(self, key)
            if v is not None and len(v) != n:
                raise ValueError(f"{key}: expected {n} values for {s} stages, got {len(v)}")
        if self.stage_ms is not None:
            for key in ("forward", "backward_input", "backward_weight"):
                got = len(getattr(self.stage_ms, key))
                if got != s:
                    raise ValueError(f"stage_ms.{key}: expected {s} values (one per stage), got {got}")
        return self

    @property
    def stages(self) -> int:
        return len(self.parts) - 1

    @property
    def layers(self) -> int:
        return self.parts[-1]


def check_parts(parts: list[int], *, layers: Optional[int] = None, stages: Optional[int] = None) -> list[int]:
    """``parts`` if it cuts ``layers`` layers into ``stages`` non-empty stages; else BadInput (a
    ValueError) saying why."""
    if len(parts) < 2:
        raise BadInput(f"parts: expected at least 2 values (0 and the layer count), got {len(parts)}")
    if parts[0] != 0:
        raise BadInput(f"parts: must start at 0 (the first layer), got {parts[0]}")
    for s in range(len(parts) - 1):
        if parts[s + 1] <= parts[s]:
            raise BadInput(f"parts: stage {s} is empty or reversed ({parts[s]} then {parts[s + 1]}); values must increase")
    if stages is not None and len(parts) - 1 != stages:
        raise BadInput(f"parts: {len(parts) - 1} stages, but the pipeline has {stages}")
    if layers is not None and parts[-1] != layers:
        raise BadInput(f"parts: ends at {parts[-1]} but the model has {layers} layers; the last value must be {layers}")
    return list(parts)


def read_parts(path, *, layers: Optional[int] = None, stages: Optional[int] = None) -> PartsFile:
    """The parts file at ``path``, checked against the model's layer and stage counts when given."""
    pf = load_model(path, PartsFile)
    try:
        check_parts(pf.parts, layers=layers, stages=stages)
    except ValueError as e:
        raise BadInput(f"{path}: {e}") from None
    return pf


def uniform_parts(layers: int, stages: int) -> list[int]:
    """DeepSpeed's ``partition_uniform``: equal layer counts, the first stages one more."""
    if layers <= stages:
        return [min(p, layers) for p in range(stages + 1)]
    chunk, residual = divmod(layers, stages)
    return [p * chunk + min(p, residual) for p in range(stages + 1)]


def balanced_parts(weights: list[float], stages: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: the linear partition that minimises the spread
    (largest minus smallest stage weight), last split found winning ties as DeepSpeed's does."""
    n, m = len(weights), stages
    if n <= m:
        return uniform_parts(n, m)
    inf = float("inf")
    pre = [0.0]
    for x in weights:
        pre.append(pre[-1] + x)
    dmax = [[inf] * (m + 1) for _ in range(n + 1)]
    dmin = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    pos = [[0] * (m + 1) for _ in range(n + 1)]
    dmax[0][0] = 0.0
    cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                hi = max(dmax[k][j - 1], pre[i] - pre[k])
                lo = min(dmin[k][j - 1], pre[i] - pre[k])
                c = hi - lo
                if cost[i][j] >= c:
                    cost[i][j], dmax[i][j], dmin[i][j], pos[i][j] = c, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(pos[parts[-1]][j])
    return parts[::-1]


def owner(parts: list[int], layer: int) -> int:
    """The stage that holds ``layer`` under ``parts``."""
    for s in range(len(parts) - 1):
        if parts[s] <= layer < parts[s + 1]:
            return s
    raise BadInput(f"layer {layer} is outside parts {parts}")


def layer_moves(old: list[int], new: list[int]) -> dict[int, tuple[int, int]]:
    """Layer -> (stage it leaves, stage it joins) for every layer whose stage differs between two
    partitions of the same layers and stages. Live migration moves layers between neighbouring
    stages only (each stage talks to its pipeline neighbours), so a layer that would skip a stage is
    refused: reach such a partition in steps."""
    check_parts(old)
    check_parts(new, layers=old[-1], stages=len(old) - 1)
    moves = {}
    for layer in range(old[-1]):
        a, b = owner(old, layer), owner(new, layer)
        if a != b:
            if abs(a - b) != 1:
                raise BadInput(f"parts {new}: layer {layer} would move from stage {a} to stage {b}; live "
                               f"migration moves layers between neighbouring stages only (reach it in steps)")
            moves[layer] = (a, b)
    return moves


def neighbour_steps(old: list[int], new: list[int]) -> list[list[int]]:
    """Partitions leading from ``old`` to ``new`` (the last one is ``new``; none if they are equal),
    each reachable from the one before by one live migration (``layer_moves`` accepts it).

    Every step moves each cut towards its place in ``new``, but not past the neighbouring cuts'
    positions before the step: no layer is crossed by two cuts, so each moves one stage at most, and
    no stage empties. A cut never passes its place, so a layer whose stage is the same in ``old``
    and ``new`` never moves; every step brings the layers it moves one stage nearer to
    theirs, and some cut always can move, so the steps end."""
    check_parts(old)
    check_parts(new, layers=old[-1], stages=len(old) - 1)
    cur, out = list(old), []
    while cur != new:
        nxt = list(cur)
        for i in range(1, len(cur) - 1):
            nxt[i] = min(max(new[i], cur[i - 1] + 1), cur[i + 1] - 1)
        out.append(nxt)
        cur = nxt
    return out
