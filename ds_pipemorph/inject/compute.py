"""Compute-straggler injection (testing and benchmarks only; never read by the detector or planner).

``pipemorph.inject.compute: {"2": 2.0}`` makes stage 2 a straggler: each of its F, B and W runs as
usual and then waits ``(factor - 1)`` times its own measured duration, so the op takes ``factor``
times as long. ``pipemorph.inject.compute_trace`` names a file of points
``[{iteration: k, factors: {"2": 2.0}}, ...]``: from ``train_batch`` k on (0 = the engine's first
call, the k of the NVTX range ``ITER<k>``), the point's factors hold; a stage the point does not name
runs at 1, and before the first point every stage does.

Why wait after the op instead of repeating its work: repeating would run the math again (on a real
model: more kernels, more memory traffic, and for B/W a second autograd pass that would change the
accumulated gradients), while waiting changes no number, so an injected run trains exactly as an
uninjected one. Scaling by the op's own measured time slows a real model and the emulated stage
(``inject.emulated``) alike, op by op, whatever each op costs. On an accelerator the op is
synchronized first, so the measured time is the device's, not the launch's.

The wait happens inside the engine's instruction, so it counts in the op's ``OpRecord`` (and in its
device events on a GPU): the profiler and the control loop see a slower stage, exactly as they would
with a co-located job stealing its compute. Iterations index the trace, not seconds: every rank then
applies a factor to the same ops of the same ``train_batch`` whatever its clock, and a test knows
which iteration is slowed however loaded the machine is (a time-indexed trace would switch in the
middle of an iteration, at a different op on every run).

The plug-in (``inject.plugin``) builds an injector only when the section asks for one and only on a
stage some factor above 1 touches; it is an engine hook (``runtime.hooks``) that follows F, B and W
and nothing else.
"""
from __future__ import annotations

import bisect
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..fileio import BadInput, check_ordered, load_model
from ..runtime import instructions as I
from ..runtime.config import PipeMorphConfigError
from ..runtime.hooks import EngineHooks, follow
from .section import StageFactors
from .emulated import sleep_until


class ComputePoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    iteration: int = Field(ge=0, description="train_batch calls before this point takes effect (0: the first)")
    factors: StageFactors = Field(default_factory=dict)


class ComputeTrace(BaseModel):
    """A compute trace file: ``points: [{iteration: 0, factors: {}}, {iteration: 3, factors: {"2": 2.0}}]``."""

    model_config = ConfigDict(extra="forbid")
    points: list[ComputePoint] = Field(min_length=1)

    @field_validator("points")
    @classmethod
    def _increasing(cls, v):
        check_ordered([p.iteration for p in v], "iterations", strict=True)
        return v


class ComputeSchedule:
    """The injected factor of every stage at every iteration: static, or stepped by a trace."""

    def __init__(self, static: dict[int, float], trace: Optional[ComputeTrace] = None):
        self.static = dict(static)
        self.trace = trace
        self._starts = [p.iteration for p in trace.points] if trace is not None else []

    def factor(self, stage: int, iteration: int) -> float:
        if self.trace is None:
            return self.static.get(stage, 1.0)
        i = bisect.bisect_right(self._starts, iteration) - 1
        return float(self.trace.points[i].factors.get(str(stage), 1.0)) if i >= 0 else 1.0

    def touches(self, stage: int) -> bool:
        """True if ``stage`` is ever slowed (a factor above 1 at some iteration)."""
        if self.trace is None:
            return self.static.get(stage, 1.0) > 1.0
        return any(p.factors.get(str(stage), 1.0) > 1.0 for p in self.trace.points)


def compute_schedule(inject_cfg, stages: int) -> Optional[ComputeSchedule]:
    """The compute injection ``pipemorph.inject`` asks for in a job of ``stages`` stages (None: none).

    Raises PipeMorphConfigError with one sentence for a stage the job does not have or a trace file
    that cannot be read or used."""
    where = f"a {stages}-stage pipeline has stages 0..{stages - 1}"
    static: dict[int, float] = {}
    for key, f in inject_cfg.compute.items():
        if int(key) >= stages:
            raise PipeMorphConfigError(f"ds_config pipemorph.inject.compute names stage {int(key)}, but {where}")
        static[int(key)] = f
    trace = None
    path = inject_cfg.compute_trace
    if path:
        if not Path(path).is_file():
            raise PipeMorphConfigError(f"ds_config pipemorph.inject.compute_trace: cannot read '{path}'")
        try:
            trace = load_model(path, ComputeTrace)
        except BadInput as e:
            raise PipeMorphConfigError(f"ds_config pipemorph.inject.compute_trace {e}") from None
        for p in trace.points:
            for key in p.factors:
                if int(key) >= stages:
                    raise PipeMorphConfigError(f"ds_config pipemorph.inject.compute_trace {path}: the point at "
                                               f"iteration {p.iteration} names stage {int(key)}, but {where}")
    schedule = ComputeSchedule(static, trace)
    if not any(schedule.touches(s) for s in range(stages)):
        return None  # every factor is 1: nothing to inject
    return schedule


class ComputeInjector(EngineHooks):
    """Slows one stage's F, B and W by its factor of the running iteration (see the module docstring).

    An engine hook: ``start_iteration`` runs at the start of each ``train_batch`` of the plan,
    ``after_op`` after each F, B and W. ``wrap(handlers, kinds)`` gives the same slowing to a plain
    handler map (the engine composes the hooks itself). ``sync`` (on an accelerator: its synchronize)
    runs after each slowed op, before it is measured. ``injected_s`` accumulates the seconds waited;
    ``factor`` is the running iteration's."""

    ops = frozenset({I.ForwardPass, I.BackwardInputPass, I.BackwardWeightPass})

    def __init__(self, schedule: ComputeSchedule, stage: int, sync: Optional[Callable[[], None]] = None):
        self.schedule = schedule
        self.stage = stage
        self.sync = sync
        self.iteration = -1  # no train_batch started yet
        self.factor = 1.0
        self.injected_s = 0.0

    def start_iteration(self, engine=None) -> None:
        self.iteration += 1
        self.factor = self.schedule.factor(self.stage, self.iteration)

    def after_op(self, engine, instruction, kwargs, started: float) -> None:
        factor = self.factor
        if factor <= 1.0:
            return
        if self.sync is not None:
            self.sync()
        extra = (factor - 1.0) * (time.perf_counter() - started)
        sleep_until(time.perf_counter(), extra * 1e3)
        self.injected_s += extra

    def wrap(self, handlers: dict, kinds: Iterable[type]) -> dict:
        kinds = tuple(kinds)
        return {k: (follow(k, h, [self.after_op]) if k in kinds else h) for k, h in handlers.items()}
