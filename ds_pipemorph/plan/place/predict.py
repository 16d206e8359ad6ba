"""The orchestrator's placement (PipeMorph §6, Fig. 19): keep slow links out of data-parallel rings.

A slow link inside a data-parallel ring slows every all-reduce; on a pipeline link the planner can
absorb it. ``place`` predicts three ways of running a job on a link matrix:

- ``baseline``: DeepSpeed's default placement (rank = stage * D + replica), the static ``zb`` order;
- ``replacement``: re-placement only (Falcon): the placement that is fastest with the static order;
- ``orchestrator``: placement and PipeMorph planning together: the placement that is fastest once
  its pipeline is planned for the link delays that placement induces.

Predicted iteration time of a placement under one order (docs/placement.md):

    T = max over stages s of ( max over replicas r of end(s, r) + allreduce(s) )

``end(s, r)``: when stage s ends its last op in replica r's pipeline, replayed under that replica's
link delays (``Placement.link_delays``); ``allreduce(s)``: ``placement.allreduce_ms`` over stage s's
ranks. DeepSpeed reduces gradients after the pipeline has drained on a stage, so the all-reduce does
not overlap the pipeline, and stage s's ring waits for its slowest replica.

Every replica runs the same order (one plan per job, as the ``pipemorph`` ds_config section
gives). The static order is the list scheduler's with ZB-H1 warm-up (S − s), or the caps when given,
planned for no link delays (the runtime's ``zb``). A planner proposes orders planned for the
element-wise largest delay of each link over the replicas; a placement is predicted with each
proposed order and keeps the fastest, so planning never predicts slower than the static order.
``quick`` proposes the greedy pass with Alg. 1 and Alg. 2 warm-ups, ``full`` adds the planner's
search (``plan.sched.search``, heuristics only: no MILP). The orchestrator scores every placement with ``quick`` and predicts the
best ``FINALISTS`` (and the re-placement's and the default placement) with ``full``.

Link model: with ``direct`` a slow link under the static order is ``Direct`` (one message in
flight, the sender blocks: head-of-line blocking) and the orchestrator's orders run on delegated
links (two queues); without it every link is pure latency.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..files.linkmatrix import LinkMatrix
from ..ir.links import DIRECT, LATENCY, Delegated, per_link
from ..ir.ops import Schedule, warmup_counts
from ..ir.profile import Costs
from ..sched.baselines import zb_h1_warmup
from ..sched.listsched import list_schedule
from ..sched.search import search
from ..sched.warmup import adapted_warmup, initial_warmup
from ..sim import native
from ..sim.simulate import replay
from .placement import Placement, allreduce_ms
from .placement_search import EXACT_MAX_PLACEMENTS, best_placements, placements_modulo_renaming

FINALISTS = 5  # placements the orchestrator plans fully (the best by the quick planner)
DELEGATED = Delegated(queues=2)


@dataclass(frozen=True)
class Job:
    """What a placement is predicted for: op times per stage (their link delays are ignored),
    micro-batches, gradient MB per stage, memory caps, all-reduce message size (``chunk_mb``),
    pipeline message size (``activation_mb``) and whether slow links are ``direct``."""

    costs: Costs
    microbatches: int
    grad_mb: list[float]
    caps: Optional[list[int]] = None
    chunk_mb: Optional[float] = None
    activation_mb: float = 0.0
    direct: bool = False

    def caps_or_n(self) -> list[int]:
        n = self.microbatches
        return [min(c, n) for c in (self.caps or [n] * self.costs.stages)]

    def at(self, links: tuple[float, ...]) -> Costs:
        return self.costs.with_links(list(links))


@dataclass
class Prediction:
    """Predicted iteration of one placement under one way of planning."""

    placement: Placement
    iteration_ms: float
    pipeline_ms: float  # the slowest replica's pipeline alone
    allreduce_ms: list[float]  # per stage
    links_ms: list[list[float]]  # per replica, per pipeline link
    planned_links_ms: list[float]  # what the chosen order was planned for ([] for the static order)
    link_model: str  # how the chosen order's slow links queue
    schedule: Schedule = field(repr=False, default_factory=list)

    @property
    def warmup(self) -> list[int]:
        return warmup_counts(self.schedule)


class Planner:
    """One way of planning (``static``, ``quick`` or ``full``); proposed orders and their replays
    are cached by link delays."""

    def __init__(self, job: Job, kind: str, *, budget_s: float = 1.0, max_evals: Optional[int] = None, seed: int = 0):
        if kind not in ("static", "quick", "full"):
            raise ValueError(f"a planner is static, quick or full, not {kind!r}")
        self.job, self.kind, self.budget_s, self.max_evals, self.seed = job, kind, budget_s, max_evals, seed
        n, S = job.microbatches, job.costs.stages
        warm = zb_h1_warmup(S, n) if job.caps is None else job.caps_or_n()
        self.static = (list_schedule(job.at((0.0,) * (S - 1)), n, warm), DIRECT if job.direct else LATENCY, ())
        self.model = DELEGATED if job.direct else LATENCY  # the planned orders' link model
        self._cands: dict = {}
        self._ends: dict = {}
        self._enc: dict = {}  # (links, candidate) -> the compiled replay's encoding of that order

    def candidates(self, links: tuple[float, ...]) -> list[tuple[Schedule, object, tuple]]:
        """(order, link model, delays it was planned for) proposed for a pipeline with these delays;
        the static order first."""
        if self.kind == "static":
            return [self.static]
        if links not in self._cands:
            job, n, caps = self.job, self.job.microbatches, self.job.caps_or_n()
            costs = job.at(links)
            out = [self.static]
            if self.model != self.static[1]:
                out.append((self.static[0], self.model, ()))
            for x in (initial_warmup(caps), adapted_warmup(costs, n, caps=caps)):
                out.append((list_schedule(costs, n, x), self.model, links))
            if self.kind == "full":
                res = search(costs, n, caps=caps, budget_s=self.budget_s, seed=self.seed, exact=False,
                             max_evals=self.max_evals, link_model=self.model)
                out.append((res.schedule, self.model, links))
            self._cands[links] = out
        return self._cands[links]

    def stage_ends(self, links: tuple[float, ...], i: int, replica_links: tuple[float, ...]) -> list[float]:
        """When each stage ends its last op: candidate ``i`` for ``links``, replayed under ``replica_links``."""
        key = (links if self.kind != "static" else (), i, replica_links)
        if key not in self._ends:
            sched, model, _ = self.candidates(links)[i]
            costs = self.job.at(replica_links)
            ends = self._native_ends(key[:2], sched, costs, model)
            if ends is None:
                tl = replay(sched, costs, self.job.microbatches, link_model=model)
                ends = [0.0] * len(sched)
                for sl in tl.slots:
                    ends[sl.stage] = max(ends[sl.stage], sl.end)
            self._ends[key] = ends
        return self._ends[key]

    def _native_ends(self, order_key, sched: Schedule, costs: Costs, model) -> Optional[list[float]]:
        """``stage_ends`` from the compiled replay's raw slot arrays, the order encoded once (the
        same floats as ``replay``'s slots, without making a Slot per op: on a measured link matrix,
        where every pair differs, the placement search replays tens of thousands of times). None
        where the compiled core is missing or the order is stuck (``replay`` then runs and raises)."""
        if native.lib() is None:
            return None
        n, S = self.job.microbatches, len(sched)
        if order_key not in self._enc:
            self._enc[order_key] = native.encode(sched, n)
        enc = self._enc[order_key]
        if enc is None:
            return None
        got = native.replay(enc, costs, n, False, per_link(model, S - 1), slots=True)
        if got is None or got[0] != 0:
            return None
        ss, _, _, se = got[5]
        ends = [0.0] * S
        for s, e in zip(ss, se):
            if e > ends[s]:
                ends[s] = e
        return ends


def predict(placement: Placement, matrix: LinkMatrix, planner: Planner) -> Prediction:
    """Predicted iteration time of ``placement`` with the fastest order ``planner`` proposes
    (model in the module docstring; ties go to the order proposed first)."""
    job = planner.job
    P, D = placement.pp, placement.dp
    per_replica = [tuple(placement.link_delays(matrix, r, job.activation_mb)) for r in range(D)]
    planned = tuple(max(v[i] for v in per_replica) for i in range(P - 1))
    ar = [allreduce_ms(matrix, placement.dp_group(s), job.grad_mb[s], chunk_mb=job.chunk_mb) for s in range(P)]
    best = None
    for i in range(len(planner.candidates(planned))):
        ends = [planner.stage_ends(planned, i, v) for v in per_replica]
        t = max(max(e[s] for e in ends) + ar[s] for s in range(P))
        if best is None or t < best[0]:
            best = (t, i, max(max(e) for e in ends))
    t, i, pipe = best
    sched, model, planned_for = planner.candidates(planned)[i]
    return Prediction(placement, t, pipe, ar, [list(v) for v in per_replica], list(planned_for), str(model), sched)


@dataclass
class PlaceResult:
    baseline: Prediction
    replacement: Optional[Prediction]  # None when ``place`` was asked for the orchestrator only
    orchestrator: Prediction
    exact: bool  # whether every placement was tried (else swap local search)

    def ratios(self) -> dict[str, float]:
        """Speed-ups: re-placement over baseline, orchestrator over re-placement and over baseline."""
        if self.replacement is None:
            raise ValueError("no re-placement prediction: place(..., replacement=False) skipped it")
        b, r, o = self.baseline.iteration_ms, self.replacement.iteration_ms, self.orchestrator.iteration_ms
        div = lambda x, y: x / y if y > 0 else 1.0  # noqa: E731
        return {"replacement_vs_baseline": div(b, r), "orchestrator_vs_replacement": div(r, o),
                "orchestrator_vs_baseline": div(b, o)}


def check(matrix: LinkMatrix, pp: int, dp: int, job: Job) -> None:
    """Raise ValueError naming the first thing that does not fit together."""
    W = matrix.world_size
    if pp < 1 or dp < 1:
        raise ValueError(f"--pp and --dp must be at least 1, got {pp} and {dp}")
    if pp * dp != W:
        raise ValueError(f"{pp} stages x {dp} replicas is {pp * dp} ranks but the link matrix is for {W} ranks")
    if job.costs.stages != pp:
        raise ValueError(f"the op times are for {job.costs.stages} stages but --pp is {pp}")
    if len(job.grad_mb) != pp:
        raise ValueError(f"gradient sizes: expected {pp} values (one per stage), got {len(job.grad_mb)}")
    if any(g < 0 for g in job.grad_mb) or job.activation_mb < 0 or (job.chunk_mb is not None and job.chunk_mb <= 0):
        raise ValueError("gradient and activation sizes must be >= 0 MB and the all-reduce message size positive")


def place(matrix: LinkMatrix, pp: int, dp: int, job: Job, *, budget_s: float = 1.0, max_evals: Optional[int] = None,
          exact: Optional[bool] = None, seed: int = 0, search_budget_s: float = 10.0,
          replacement: bool = True) -> PlaceResult:
    """Baseline, re-placement only and the full orchestrator for ``matrix`` (module docstring).
    ``budget_s`` / ``max_evals``: the planner's search per planned pipeline; ``exact``: enumerate
    every placement (default: when there are at most ``EXACT_MAX_PLACEMENTS`` up to renaming the
    replicas), else swap local search for ``search_budget_s`` seconds per objective.
    ``replacement=False`` skips the re-placement search (half the work on a measured matrix, whose
    pairs all differ so that few replays are shared): ``result.replacement`` is None and the
    orchestrator's finalists are the quick planner's and the default placement."""
    check(matrix, pp, dp, job)
    is_exact = placements_modulo_renaming(pp, dp) <= EXACT_MAX_PLACEMENTS if exact is None else exact
    static, quick = Planner(job, "static"), Planner(job, "quick")
    full = Planner(job, "full", budget_s=budget_s, max_evals=max_evals, seed=seed)

    def best(planner: Planner, top: int) -> list[Placement]:
        found = best_placements(pp, dp, lambda p: predict(p, matrix, planner).iteration_ms, top=top,
                                exact=is_exact, seed=seed, budget_s=search_budget_s)
        return [p for p, _ in found]

    default = Placement.default(pp, dp)
    baseline = predict(default, matrix, static)
    replaced = predict(best(static, 1)[0], matrix, static) if replacement else None
    finalists = best(quick, FINALISTS)
    for p in ((replaced.placement,) if replaced is not None else ()) + (default,):
        if p not in finalists:
            finalists.append(p)
    scored = [predict(p, matrix, full) for p in finalists]
    orchestrator = min(scored, key=lambda x: (round(x.iteration_ms, 6), x.placement.moved(), x.placement.grid))
    return PlaceResult(baseline, replaced, orchestrator, is_exact)
