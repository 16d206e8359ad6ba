"""What one ``pipemorph bench`` run measures: the pipeline, the delay scenarios and the schedules."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..plan.ir.lower import DISPATCHES, Dispatch

SCHEDULES = ("stock-1f1b", "zb", "zb-delegated", "pipemorph")
LABELS = {  # short: the table must fit an 80-column terminal
    "stock-1f1b": "stock 1F1B",
    "zb": "static zb",
    "zb-delegated": "delegation only",
    "pipemorph": "PipeMorph",
}
NOTES = {
    "stock-1f1b": "DeepSpeed's own PipelineEngine and TrainSchedule, fused backward",
    "zb": "PipeMorphEngine, ZB-H1 warm-up S-s, planned for no delay, within the memory budget",
    "zb-delegated": "static zb with every link delegated (staging rings + delegate processes), no re-plan",
    "pipemorph": "adaptive: Alg. 1 warm-up within the memory budget, measures links in-run, re-plans, slow links "
                 "go delegated",
}


class Scenario(BaseModel):
    """One delay setting: static delays per link, or a delay trace replayed from each row's first
    iteration (then ``links_ms`` holds the trace's mean delays, which the predicted column uses)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    links_ms: list[float]
    trace: Optional[str] = None


def budget_text(budget: Optional[float]) -> str:
    """How a table names a row's memory: ``1x stock`` (the default), ``2x stock``, ``no limit``."""
    return "no limit" if budget is None else f"{budget:g}x stock"


class BenchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stages: int = Field(ge=2)
    microbatches: int = Field(ge=1)
    op_ms: float = Field(gt=0)
    scenarios: list[Scenario] = Field(min_length=1)
    schedules: list[str] = Field(min_length=1)
    iterations: int = Field(ge=1)
    warmup: int = Field(ge=0)
    progress_file: str
    out: str
    # Our engine's rows run once per dispatch ("ready": the plan is a hint, RRFP); stock 1F1B once.
    dispatches: list[str] = Field(default_factory=lambda: ["ordered"], min_length=1)
    # Per-op time variation (``plan.sim.variation``: jitter:S, heavy:..., table:FILE), drawn anew each iteration.
    vary: Optional[str] = None
    # A workload of its own instead of the emulated stage (``bench.plain_sleep``: "plain-sleep"); not with vary.
    workload: Optional[str] = None
    # Our engine's ``memory.budget`` (a multiple of stock 1F1B's activation memory); None: no limit.
    budget: Optional[float] = 1.0

    @model_validator(mode="after")
    def _shapes(self) -> "BenchSpec":
        for sc in self.scenarios:
            if len(sc.links_ms) != self.stages - 1:
                raise ValueError(f"scenario {sc.name}: {len(sc.links_ms)} delays for {self.stages - 1} links")
            if any(c < 0 for c in sc.links_ms):
                raise ValueError(f"scenario {sc.name}: delays must be >= 0 ms")
        for s in self.schedules:
            if s not in SCHEDULES:
                raise ValueError(f"unknown schedule '{s}': choose from {', '.join(SCHEDULES)}")
        if self.workload is not None and self.workload != "plain-sleep":
            raise ValueError(f"unknown workload '{self.workload}': choose plain-sleep or none")
        if self.workload is not None and self.vary:
            raise ValueError(f"workload {self.workload} sets its own op times: leave vary out")
        for d in self.dispatches:
            if d not in DISPATCHES:
                raise ValueError(f"unknown dispatch '{d}': choose from {', '.join(DISPATCHES)}")
        self.dispatches = [Dispatch(d) for d in self.dispatches]  # read once: compared as the type from here
        return self

    def rows(self) -> list[tuple[str, str]]:
        """(schedule, dispatch) of every row of a scenario, in order."""
        return [(s, d) for s in self.schedules for d in ([Dispatch.ORDERED] if s == "stock-1f1b" else self.dispatches)]
