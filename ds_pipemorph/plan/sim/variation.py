"""Run-time variation of op times: seeded jitter, heavy micro-batches, or a table from a file.

Each variation turns the per-stage times of a ``Costs`` into an ``OpTable``: one F, B and W time
per (stage, micro-batch), callable as ``op_times`` of ``plan.sim.ready``. Same spec, same costs, same
table: draws come from ``random.Random(seed)`` in a fixed order.

Specs (``parse_vary``; ``pipemorph simulate --vary``):

- ``jitter:SPREAD[,seed=K][,kinds=FB]``: every op of a kind in ``kinds`` (default F and B) on
  every (stage, micro-batch) is scaled by its own factor drawn uniformly from
  [1 − SPREAD, 1 + SPREAD] (mean 1; SPREAD in [0, 1]). Draw order: stage, micro-batch, kind.
- ``heavy:frac=F,factor=X,stages=K[,seed=S]``: round(F × N) micro-batches (half up), drawn
  without replacement, take X times as long for F, B and W on the first K stages (a multimodal
  batch whose images go through the encoder on the first stages). Defaults: frac=0.25,
  factor=3, stages=1, seed=0.
- ``table:PATH`` (or a path to an existing ``.yaml``/``.yml``/``.json`` file): the times of
  ``OpTimesFile``; a key left out keeps the costs' times.

Link delays that change over time come from a ``LinkTraceFile`` (``pipemorph simulate
--link-trace``), the format ``pipemorph.inject.trace`` replays: ``points: [{t: 0.0, links_ms:
[0, 0, 30]}, ...]`` with ``t`` in seconds from the start of the iteration.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...fileio import BadInput, check_ordered, load_model
from ..ir.ops import KINDS, Kind
from ..ir.profile import Costs, check_delays

Rows = tuple[tuple[float, ...], ...]  # rows[s][m]


@dataclass(frozen=True)
class OpTable:
    """F, B and W time in ms of every (stage, micro-batch): ``f[s][m]``, ``b[s][m]``, ``w[s][m]``."""

    f: Rows
    b: Rows
    w: Rows

    def __call__(self, stage: int, kind: str, mb: int) -> float:
        return (self.f if kind == Kind.F else self.b if kind == Kind.B else self.w)[stage][mb]

    @staticmethod
    def constant(costs: Costs, microbatches: int) -> "OpTable":
        """Every micro-batch at the per-stage time of ``costs``."""
        n = microbatches
        return OpTable(*(tuple((t,) * n for t in per) for per in (costs.f, costs.b, costs.w)))

    def scaled(self, factors: dict[tuple[int, str, int], float]) -> "OpTable":
        """This table with ``(stage, kind, mb) -> factor`` applied."""
        rows = {k: [list(r) for r in getattr(self, k.lower())] for k in KINDS}
        for (s, k, m), x in factors.items():
            rows[k][s][m] *= x
        return OpTable(*(tuple(map(tuple, rows[k])) for k in KINDS))


def jitter(costs: Costs, microbatches: int, spread: float, *, seed: int = 0, kinds: str = "FB") -> OpTable:
    """Each op of ``kinds`` scaled by its own factor, uniform in [1 − spread, 1 + spread]."""
    if not 0 <= spread <= 1:
        raise BadInput(f"jitter: the spread is a fraction in [0, 1], not {spread:g}")
    if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
        raise BadInput(f"jitter: kinds='{kinds}' should be letters of FBW, each at most once")
    rng = random.Random(seed)
    picked = [k for k in KINDS if k in kinds]
    factors = {}
    for s in range(costs.stages):
        for m in range(microbatches):
            for k in picked:
                factors[(s, k, m)] = rng.uniform(1.0 - spread, 1.0 + spread)
    return OpTable.constant(costs, microbatches).scaled(factors)


def heavy_microbatches(microbatches: int, frac: float, seed: int = 0) -> list[int]:
    """The micro-batches ``heavy`` picks, sorted: round(frac × N) (half up), seeded, no repeats."""
    if not 0 <= frac <= 1:
        raise BadInput(f"heavy: frac is a fraction in [0, 1], not {frac:g}")
    k = math.floor(frac * microbatches + 0.5)
    return sorted(random.Random(seed).sample(range(microbatches), k))


def heavy(costs: Costs, microbatches: int, *, frac: float = 0.25, factor: float = 3.0, stages: int = 1,
          seed: int = 0) -> OpTable:
    """A seeded fraction of micro-batches ``factor`` times heavier (F, B, W) on the first ``stages``."""
    if not (factor >= 0 and math.isfinite(factor)):
        raise BadInput(f"heavy: factor is a number >= 0, not {factor:g}")
    if not 1 <= stages <= costs.stages:
        raise BadInput(f"heavy: stages={stages} should be 1..{costs.stages} (the first stages to slow down)")
    factors = {(s, k, m): factor for m in heavy_microbatches(microbatches, frac, seed)
               for s in range(stages) for k in KINDS}
    return OpTable.constant(costs, microbatches).scaled(factors)


class OpTimesFile(BaseModel):
    """Per-(stage, micro-batch) times in ms: one row per stage, each a list of N values or one
    value for all micro-batches of that stage. A key left out keeps the profile's time."""

    model_config = ConfigDict(extra="forbid")
    forward: Optional[list[Union[float, list[float]]]] = None
    backward_input: Optional[list[Union[float, list[float]]]] = None
    backward_weight: Optional[list[Union[float, list[float]]]] = None

    @field_validator("forward", "backward_input", "backward_weight")
    @classmethod
    def _nonneg(cls, v):
        for s, row in enumerate(v or []):
            for t in row if isinstance(row, list) else [row]:
                if not (t >= 0 and math.isfinite(t)):
                    raise ValueError(f"stage {s} has a time of {t} ms; times are >= 0")
        return v

    def table(self, costs: Costs, microbatches: int, source: str) -> OpTable:
        S, N = costs.stages, microbatches
        base = OpTable.constant(costs, N)
        out = []
        for key, rows, same in (("forward", self.forward, base.f), ("backward_input", self.backward_input, base.b),
                                ("backward_weight", self.backward_weight, base.w)):
            if rows is None:
                out.append(same)
                continue
            if len(rows) != S:
                raise BadInput(f"{source}: {key}: expected {S} rows (one per stage), got {len(rows)}")
            full = []
            for s, row in enumerate(rows):
                row = [row] * N if not isinstance(row, list) else row
                if len(row) != N:
                    raise BadInput(f"{source}: {key}: stage {s} has {len(row)} values, expected {N} (one per micro-batch)")
                full.append(tuple(float(t) for t in row))
            out.append(tuple(full))
        return OpTable(*out)


def table_file(path: Union[str, Path], costs: Costs, microbatches: int) -> OpTable:
    return load_model(path, OpTimesFile).table(costs, microbatches, str(path))


class TracePoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    t: float = Field(ge=0, allow_inf_nan=False, description="seconds from the start of the iteration")
    links_ms: list[float] = Field(description="every link's one-way extra delay in ms from t on")

    @field_validator("links_ms")
    @classmethod
    def _nonneg(cls, v):
        return check_delays(v)


class LinkTraceFile(BaseModel):
    """Per-link delay over time: ``points: [{t: 0.0, links_ms: [0, 0, 30]}, {t: 0.25, ...}]``;
    each point holds until the next one, and the first one also before it."""

    model_config = ConfigDict(extra="forbid")
    points: list[TracePoint] = Field(min_length=1)

    @field_validator("points")
    @classmethod
    def _sorted(cls, v):
        check_ordered([p.t for p in v], "times", unit=" s")
        return v

    def breakpoints(self, links: int, source: str) -> list[list[tuple[float, float]]]:
        """Per link, ``(time_ms, delay_ms)`` breakpoints (``link_delays`` of ``plan.sim.ready``)."""
        out: list[list[tuple[float, float]]] = [[] for _ in range(links)]
        for p in self.points:
            if len(p.links_ms) != links:
                raise BadInput(f"{source}: the point at t={p.t:g} s has {len(p.links_ms)} delays, "
                               f"the pipeline has {links} links")
            for i, c in enumerate(p.links_ms):
                if not out[i] or out[i][-1][1] != c:
                    out[i].append((p.t * 1000.0, float(c)))
        return out


def link_trace(path: Union[str, Path], links: int) -> list[list[tuple[float, float]]]:
    """The per-link breakpoints of the trace file at ``path``; BadInput names what is wrong."""
    return load_model(path, LinkTraceFile).breakpoints(links, str(path))


_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def parse_vary(spec: str, costs: Costs, microbatches: int) -> OpTable:
    """The table a spec names (module docstring); BadInput with one sentence if it does not parse."""
    text = spec.strip()
    name, _, args = text.partition(":")
    if name == "table":
        if not args:
            raise BadInput("--vary table: give the file, e.g. table:times.yaml")
        return table_file(args, costs, microbatches)
    if not args and Path(text).suffix.lower() in _FILE_SUFFIXES:
        return table_file(text, costs, microbatches)
    if name == "jitter":
        kw = _keywords(text, args, first="spread", allowed={"spread", "seed", "kinds"})
        if "spread" not in kw:
            raise BadInput(f"--vary '{text}': give the spread, e.g. jitter:0.3,seed=1")
        return jitter(costs, microbatches, _number(text, kw, "spread"), seed=_integer(text, kw, "seed", 0),
                      kinds=kw.get("kinds", "FB").upper())
    if name == "heavy":
        kw = _keywords(text, args, first=None, allowed={"frac", "factor", "stages", "seed"})
        return heavy(costs, microbatches, frac=_number(text, kw, "frac", 0.25), factor=_number(text, kw, "factor", 3.0),
                     stages=_integer(text, kw, "stages", 1), seed=_integer(text, kw, "seed", 0))
    raise BadInput(
        f"--vary '{text}' is not a variation: write jitter:0.3,seed=1, "
        "heavy:frac=0.25,factor=3,stages=2,seed=0 or table:FILE"
    )


def vary_tables(spec: str, costs: Costs, microbatches: int) -> Callable[[int], OpTable]:
    """Iteration k -> its table: a seeded variation (``jitter``, ``heavy``) is drawn anew each
    iteration with seed + k, as a real workload's heavy micro-batches and jitter change between
    batches; a table file is the same every iteration. BadInput if the spec does not parse."""
    first = parse_vary(spec, costs, microbatches)
    text = spec.strip()
    name, _, args = text.partition(":")
    if name not in ("jitter", "heavy"):
        return lambda k: first
    kw = _keywords(text, args, first="spread" if name == "jitter" else None,
                   allowed={"spread", "seed", "kinds"} if name == "jitter" else {"frac", "factor", "stages", "seed"})
    seed = _integer(text, kw, "seed", 0)
    rest = ",".join(f"{k}={v}" for k, v in kw.items() if k != "seed")
    cache: dict[int, OpTable] = {0: first}

    def table(k: int) -> OpTable:
        if k not in cache:
            cache[k] = parse_vary(f"{name}:{rest},seed={seed + k}", costs, microbatches)
        return cache[k]
    return table


def _keywords(text: str, args: str, first: Optional[str], allowed: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, part in enumerate(p.strip() for p in args.split(",") if p.strip()):
        key, eq, val = part.partition("=")
        if not eq and i == 0 and first:
            key, val = first, part
        elif not eq:
            raise BadInput(f"--vary '{text}': '{part}' should be key=value ({', '.join(sorted(allowed))})")
        key = key.strip()
        if key not in allowed:
            raise BadInput(f"--vary '{text}': unknown key '{key}' (known: {', '.join(sorted(allowed))})")
        if key in out:
            raise BadInput(f"--vary '{text}': '{key}' is given twice")
        out[key] = val.strip()
    return out


def _number(text: str, kw: dict, key: str, default: Optional[float] = None) -> float:
    if key not in kw:
        return default
    try:
        v = float(kw[key])
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        raise BadInput(f"--vary '{text}': {key}='{kw[key]}' is not a number")
    return v


def _integer(text: str, kw: dict, key: str, default: int) -> int:
    if key not in kw:
        return default
    try:
        return int(kw[key])
    except ValueError:
        raise BadInput(f"--vary '{text}': {key}='{kw[key]}' is not a whole number") from None
