"""When to move a slow data-parallel link into the pipeline (PipeMorph §6), torch-free.

The engine hands ``Orchestrator.observe`` each iteration's all-reduce time of every stage (its
``ReduceGrads``, the slowest replica) and every stage's F, B and W. From the link matrix
(``pipemorph profile-links --all-pairs``) and those op times, ``plan.place.predict`` predicts the iteration
time of the placement in force and of the best one: data-parallel rings priced by the matrix, slow
pairs put where the planner absorbs them. The orchestrator acts when both say so:

- **measured**: some stage's all-reduce took more than ``noise`` above what the best placement's
  ring for that stage would take, in each of the last ``patience`` iterations (a data-parallel
  straggler is seen, not only listed in a file). What a ring would take is the ring model's time
  (``plan.place.placement.allreduce_ms``) plus the fixed cost every all-reduce pays on this machine beyond
  that model (the collective's start-up, the wait for the slowest replica, CPU contention: on a real
  network, tens of ms against a model's few ms). That cost is read from the same iteration: the
  median, over the stages whose ring in force is already as fast as the best placement's (the
  matrix holds nothing slow in it), of measured minus modelled, at least 0; without such a stage
  it is 0. So a stage is a straggler only when its own all-reduce stands out, and a matrix that
  calls a link slow which is not (any more) triggers nothing;
- **predicted**: the best placement beats the one in force by at least ``min_gain``.

The answer is the placement (``ranks[stage][replica]``); the engine re-maps to it
(``runtime.remap``), then the control loop re-plans and delegates for the links now in the pipeline.
A placement once left is not returned to for the same matrix: the orchestrator acts at most once.

``observe`` is two parts: ``due`` (the history, the noise and patience of the detection: cheap and
deterministic, so every process fed the same numbers keeps the same state) and ``search`` (the
placements, run by one process when ``due`` says so; the others ``adopt`` what it changed).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..plan.files.linkmatrix import LinkMatrix
from ..plan.ir.profile import Costs
from ..plan.place.placement import Placement, allreduce_ms
from ..plan.place.predict import Job, Planner, place, predict

# The planner's effort per planned pipeline: bounded by replays, not time (same answer on any machine).
PLAN_EVALS = 200


@dataclass
class RemapDecision:
    ranks: list[list[int]]  # ranks[stage][replica]
    current_ms: float  # the placement in force, predicted
    predicted_ms: float  # the new one
    measured_allreduce_ms: list[float]  # per stage, mean over the iterations that triggered it
    predicted_allreduce_ms: list[float]  # per stage, in the new placement
    iteration: int
    overhead_ms: float = 0.0  # the fixed cost per all-reduce read from the last iteration (module docstring)
    seconds: float = 0.0  # the placement search for this decision, on the deciding rank


@dataclass
class Orchestrator:
    matrix: LinkMatrix
    placement: Placement
    microbatches: int
    grad_mb: list[float]
    chunk_mb: Optional[float] = None
    caps: Optional[list[int]] = None
    noise: float = 0.25
    patience: int = 2
    min_gain: float = 0.05
    iteration: int = 0
    done: bool = False
    history: list[list[float]] = field(default_factory=list)
    decisions: list[RemapDecision] = field(default_factory=list)
    _floor: Optional[list[float]] = None  # per stage: the all-reduce of the best placement
    overheads: list[float] = field(default_factory=list)  # the fixed cost read from each iteration in history

    def in_force_ms(self) -> list[float]:
        """Per stage: the ring model's all-reduce of the placement in force."""
        return [allreduce_ms(self.matrix, self.placement.dp_group(s), self.grad_mb[s], chunk_mb=self.chunk_mb)
                for s in range(self.placement.pp)]

    def overhead_ms(self, allreduce: Sequence[float]) -> float:
        """The fixed cost per all-reduce beyond the ring model, from one iteration (module docstring)."""
        if self._floor is None:
            return 0.0
        model = self.in_force_ms()
        fit = [allreduce[s] - model[s] for s in range(len(model)) if model[s] <= (1.0 + self.noise) * self._floor[s] + 1e-9]
        return max(0.0, statistics.median(fit)) if fit else 0.0

    @property
    def settled(self) -> bool:
        """Acted already, or every stage's last all-reduce within ``noise`` of what the best ring takes:
        no stage on its way to a straggler's ``patience`` iterations in a row."""
        if self.done:
            return True
        if self._floor is None or not self.history:
            return False
        last, o = self.history[-1], self.overheads[-1]
        return all(last[s] <= (1.0 + self.noise) * (self._floor[s] + o) + 1e-9 for s in range(self.placement.pp))

    def observe(self, allreduce: Sequence[float], stage_ms: Sequence[Sequence[float]]) -> Optional[RemapDecision]:
        """One iteration: ``allreduce[s]`` = ms of stage s's all-reduce, ``stage_ms[s]`` = its (F, B, W).
        ``due`` then, if it says so, ``search``: one process doing both parts."""
        return self.search(stage_ms) if self.due(allreduce) else None

    def due(self, allreduce: Sequence[float]) -> bool:
        """The cheap part of ``observe``, deterministic: count the iteration, keep ``allreduce`` and
        say whether a placement search is due: at the first ``patience`` iterations kept (what the
        best rings cost is planned then) and whenever a stage is a straggler. Processes that feed it
        the same numbers keep the same state; one of them runs ``search`` and the others ``adopt``."""
        k, self.iteration = self.iteration, self.iteration + 1
        if self.done or k == 0:  # the first iteration carries start-up work
            return False
        self.history = (self.history + [list(allreduce)])[-self.patience:]
        if len(self.history) < self.patience:
            return False
        if self._floor is None:
            return True
        self.overheads = [self.overhead_ms(h) for h in self.history]
        return self._straggler()

    def search(self, stage_ms: Sequence[Sequence[float]]) -> Optional[RemapDecision]:
        """After ``due`` said so: what the best rings cost (planned once), then, if a stage is a
        straggler, the best placement and whether it gains ``min_gain`` (the decision, or None)."""
        t0 = time.perf_counter()
        k = self.iteration - 1
        placed = None
        if self._floor is None:  # what the best rings cost: planned once, with the first costs measured
            placed = self._place(stage_ms)
            self._floor = placed[0].orchestrator.allreduce_ms
            self.overheads = [self.overhead_ms(h) for h in self.history]
            if not self._straggler():
                return None
        P = self.placement.pp
        res, job = placed if placed is not None else self._place(stage_ms)  # the same costs: place once
        best = res.orchestrator
        now = predict(self.placement, self.matrix, Planner(job, "full", budget_s=3600.0, max_evals=PLAN_EVALS))
        self.done = True  # acted on (or found nothing better): not again for this matrix
        if best.placement == self.placement or not best.iteration_ms < now.iteration_ms * (1.0 - self.min_gain):
            return None
        measured = [sum(h[s] for h in self.history) / len(self.history) for s in range(P)]
        d = RemapDecision(best.placement.as_lists(), now.iteration_ms, best.iteration_ms, measured,
                  [allreduce_ms(self.matrix, best.placement.dp_group(s), self.grad_mb[s], chunk_mb=self.chunk_mb)
                   for s in range(P)], k, self.overheads[-1], time.perf_counter() - t0)
        self.decisions.append(d)
        return d

    def searched(self) -> tuple[list[float], bool]:
        """What ``search`` changed that the processes which did not run it need: what the best rings
        cost and whether the orchestrator acted (``adopt`` takes them)."""
        return list(self._floor), self.done

    def adopt(self, floor: Sequence[float], done: bool) -> None:
        """Another process ran ``search`` after the same ``due``: take what it changed, so that this
        one's state (``settled``, the next ``due``) is that process's."""
        self._floor, self.done = list(floor), done
        self.overheads = [self.overhead_ms(h) for h in self.history]

    def _straggler(self) -> bool:
        """Some stage's all-reduce more than ``noise`` above its best ring (plus the fixed cost) in
        every iteration kept."""
        return any(all(h[s] > (1.0 + self.noise) * (self._floor[s] + o) + 1e-9 for h, o in zip(self.history, self.overheads))
                   for s in range(self.placement.pp))

    def _place(self, stage_ms: Sequence[Sequence[float]]):
        P = self.placement.pp
        f, b, w = ([float(stage_ms[s][j]) for s in range(P)] for j in range(3))
        job = Job(Costs(f=f, b=b, w=w, links=[0.0] * (P - 1)), self.microbatches, list(self.grad_mb), self.caps,
                  self.chunk_mb)
        # Only the orchestrator's placement is used here: no re-placement search (it would double the
        # time every rank waits for rank 0's decision).
        return place(self.matrix, P, self.placement.dp, job, max_evals=PLAN_EVALS, budget_s=3600.0,
                     replacement=False), job

    def moved(self, ranks: list[list[int]]) -> None:
        self.placement = Placement.from_ranks(ranks)

    def failed(self) -> None:
        """The re-mapping failed on some rank (every rank kept its coordinate): try again."""
        self.done, self.history = False, []
