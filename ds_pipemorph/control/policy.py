"""PipeMorph's control policy (§6): from one iteration's measurements to a ``Decision``.

Every iteration the runtime hands the policy what all ranks measured: per stage the F, B and W
times, per link the delay (``control.estimate``). The policy owns the straggler detector
(``control.detector``); when the detector asks for new target delays, the policy decides:

* keep the plan in force when the slow links are the same ones and, under the new delays, it is
  within ``KEEP_WITHIN`` of the lower bound (no search could gain more than that);
* else re-plan: at once with Alg. 2's closed-form warm-up (``react``, milliseconds), then with the
  deterministic search (``refine``), bounded by ``search_evals`` evaluations rather than by time so
  the same input gives the same plan on any machine; the runtime runs the search beside training
  and switches to its plan when it lands (``propose`` does both in one call). The plan in force stays,
  with the new targets, when every link keeps its route, the plan fits the memory the new delays
  allow and its replay under them is faster than the new plan's; after ``react`` the search then
  still runs (``Decision.refine``);
* model each direct link as its transport behaves (``direct``, one model for every link or one per
  link): where a send holds the training process until its message has crossed (NCCL; a link the
  sleep injector delays), one message in flight that blocks its sender (``Direct()``); where it does
  not (gloo's isend), one FIFO, the wire's, whose sender never waits (``Delegated(1)``). Plans,
  tolerances and the link-delay estimator use that model;
* route links by the delegation mode: "off" keeps every link direct, "always" delegates every link,
  "auto" delegates the links planned for a delay and keeps the others direct, but only links whose
  direct sends block: where they do not, a delegate adds copies and nothing the wire does not
  already give (a rate limit is shared by every queue on it), so "auto" keeps such a link direct;
* give each delegated link the delegate queues the new plan needs (``plan.sched.queues``), between what
  it has and the configured maximum; a running link grows only for a gain above ``GROW_GAIN`` of the
  iteration, since new delegates start while training runs.

The decision is split so that one rank can plan for all: ``observe`` (every rank, cheap, identical
input → identical answer) says whether a decision is due, ``react``/``refine``/``propose`` (one
rank) compute it without changing any state, ``adopt`` (every rank) takes it in. ``step`` does
``observe``, ``propose`` and ``adopt`` in one process.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional, Union

from ..plan.ir.links import DIRECT, LATENCY, Delegated, Direct, LinkModel, Route, per_link
from ..plan.ir.memory import MemoryBudget, caps_within, fit_budget, fits
from ..plan.ir.ops import Schedule, peak_inflight
from ..plan.ir.profile import Costs
from ..plan.sched.bounds import lower_bound_ms
from ..plan.sched.listsched import list_schedule
from ..plan.sched.queues import MAX_QUEUES, MIN_QUEUES, queues_needed
from ..plan.sched.search import search
from ..plan.sched.tolerance import link_tolerances
from ..plan.sched.warmup import adapted_warmup
from ..plan.sim.listsched_py import Policy as ListPolicy
from ..plan.sim.simulate import replay
from .detector import DetectorConfig, LinkDetector
from .modes import DELEGATION_MODES, DelegationMode

REPLAN_EVALS = 2000  # default search effort per re-plan: an evaluation bound, not a time bound (deterministic)
KEEP_WITHIN = 0.02  # keep the plan in force when it is this close to the lower bound under new delays
GROW_GAIN = 0.05  # add delegate queues to a running link only for a gain above this share of the iteration
TOLERANCE_RESOLUTION_MS = 0.1
DirectModels = Union[LinkModel, Sequence[LinkModel]]  # one model of a direct link for every link, or one per link


@dataclass(frozen=True)
class QueueSettings:
    """Delegate FIFOs per direction of a delegated link: ``start`` when a link is first delegated,
    growing to at most ``cap`` when its delay needs more (``plan.sched.queues.queues_needed``)."""

    start: int = MIN_QUEUES
    cap: int = MAX_QUEUES

    def __post_init__(self):
        if self.start < 1 or self.cap < self.start:
            raise ValueError(f"delegate queues: need 1 <= start <= cap, got start {self.start}, cap {self.cap}")


@dataclass(frozen=True)
class Decision:
    """What the engine applies at an iteration boundary, on every rank alike.

    ``plan``: the new plan, or None to keep the one in force. ``link_modes``: link -> its ``Route``
    (empty under delegation "off"); ``queues``: delegated link -> delegate FIFOs per
    direction. ``costs``: the op times and target delays (``costs.links``) planned for;
    ``tolerance_ms``: per link, the delay the plan absorbs; ``predicted_ms``: its replayed iteration
    time; ``reason``: one sentence for the log; ``refine``: the search may still find a faster plan
    for ``costs`` (the runtime runs it beside training).
    """

    plan: Optional[Schedule]
    link_modes: dict[int, Route]
    queues: dict[int, int]
    costs: Costs
    tolerance_ms: list[float]
    predicted_ms: float
    reason: str
    refine: bool = False

    @property
    def target_ms(self) -> list[float]:
        return list(self.costs.links)

    @property
    def replans(self) -> bool:
        return self.plan is not None


class ControlPolicy:
    """The control policy of one pipeline (``stages`` stages, ``microbatches`` per iteration). (The
    list scheduler's knobs are ``plan.Policy``; this is the control loop's.)"""

    def __init__(self, plan: Schedule, costs: Costs, microbatches: int, caps: Optional[Sequence[int]] = None,
                 every: int = 1, delegation: DelegationMode = "off", detector: DetectorConfig = DetectorConfig(),
                 queues: QueueSettings = QueueSettings(), search_evals: int = REPLAN_EVALS,
                 direct: DirectModels = DIRECT, units: Optional[Sequence[float]] = None, w_share: float = 1.0,
                 budget: Optional[MemoryBudget] = None):
        if delegation not in DELEGATION_MODES:
            raise ValueError(f"delegation must be one of {DELEGATION_MODES}, not {delegation!r}")
        if every < 1:
            raise ValueError(f"every must be >= 1, not {every}")
        self.S, self.N = len(plan), microbatches
        self.direct_models = _direct_models(direct, self.S - 1)  # per link
        # The caps and the activation memory per stage (``plan.ir.memory.MemoryBudget``), read when a
        # plan is made: every plan proposed keeps within them. ``budget`` is the engine's own object
        # (a grant known after start-up reaches the policy); else one from ``caps`` and ``units``.
        self.budget = budget if budget is not None else MemoryBudget(caps, units)
        self.w_share = w_share
        self.every = every
        self._observed = -1  # the last iteration the detector ran at (-1: not yet)
        self.search_evals = search_evals
        self.delegation = delegation
        self.queues = queues  # delegate FIFOs per delegated link direction
        self.link_queues = [queues.start] * (self.S - 1)  # what each link has (or gets when delegated)
        self.plan_in_force = plan
        self.costs = costs
        self.detector = LinkDetector(self.S - 1, detector)
        none = [0.0] * (self.S - 1)
        tol = link_tolerances(plan, costs, microbatches, resolution_ms=TOLERANCE_RESOLUTION_MS,
                              link_model=self._model(none, self.link_queues))
        self.detector.adopt(none, [t.replay_ms for t in tol])

    @property
    def caps(self) -> Optional[list[int]]:
        return None if self.budget.caps is None else list(self.budget.caps)

    @property
    def units(self) -> Optional[tuple[float, ...]]:
        return self.budget.units

    def rebase(self, plan: Schedule) -> None:
        """``plan`` is in force from now on, put there by the engine (a memory grant planned anew):
        the detector's tolerances follow it."""
        self.plan_in_force = plan
        planned = list(self.detector.planned_for)
        tol = link_tolerances(plan, self.costs.with_links(planned), self.N,
                              resolution_ms=TOLERANCE_RESOLUTION_MS, link_model=self._model(planned, self.link_queues))
        self.detector.adopt(planned, [t.replay_ms for t in tol])

    @property
    def direct_model(self) -> Union[LinkModel, list[LinkModel]]:
        """The model of direct links: one for every link when they agree, else the list per link."""
        models = self.direct_models
        return models[0] if models and all(m == models[0] for m in models) else list(models)

    def set_direct_model(self, direct: DirectModels) -> None:
        """Model direct links as ``direct`` (one model, or one per link) from now on (a transport
        wrapped after start-up, e.g. a test's delay injector, blocks its sender where the bare one did
        not); the detector's tolerances for the plan in force follow."""
        self.direct_models = _direct_models(direct, self.S - 1)
        self.rebase(self.plan_in_force)

    # -- the three steps ---------------------------------------------------------------------------
    def observe(self, iteration: int, f: Sequence[float], b: Sequence[float], w: Sequence[float],
                links: Sequence[Optional[float]]) -> Optional[Costs]:
        """Iteration ``iteration`` (0-based) measured F, B and W per stage (ms; negative: not seen) and
        a delay per link (ms; None: no message seen). Returns the costs to plan for (op times
        rounded to 0.5 ms, the detector's target delays) when a decision is due, else None.

        The first iteration (start-up, layouts) is not representative and the detector runs at most
        every ``every`` iterations: fed every iteration, after iterations every-1, 2*every-1, ...; fed
        fewer (the runtime's exchanges grow apart while nothing changes), at each one ``every`` or
        more iterations after the last it ran at."""
        if iteration == 0 or iteration - self._observed < self.every:
            return None
        self._observed = iteration
        target = self.detector.observe(list(links))
        if target is None:
            return None
        c = self.costs
        return Costs(_rounded(f, c.f), _rounded(b, c.b), _rounded(w, c.w), target)

    @property
    def settled(self) -> bool:
        """Measurements may come further apart: the detector has run and no link is on its way to a new
        target (``LinkDetector.settled``); or the detector runs every ``every`` > 1 iterations, whose
        runs ``next_run`` pins (its slow runs in a row are runs, not iterations, so what happens
        between them does not matter)."""
        return self._observed >= 0 and (self.every > 1 or self.detector.settled)

    @property
    def next_run(self) -> Optional[int]:
        """The iteration at which the detector runs next when fed every iteration (None when every
        iteration may be its turn, ``every`` = 1): an exchange there keeps its runs where they would
        be with an exchange every iteration."""
        if self.every == 1:
            return None
        return max(1, self._observed + self.every)

    def propose(self, costs: Costs) -> Decision:
        """The decision for ``costs`` (from ``observe``) with the search; changes nothing, so one rank
        can compute it for all."""
        kept = self._keep(costs)
        if isinstance(kept, Decision):
            return kept
        return self._better_of(self._replan(costs, self._searched(costs), f"re-planned: {kept}"))

    def react(self, costs: Costs) -> Decision:
        """The first reaction to ``costs``: keep the plan in force when it is close enough, else
        Alg. 2's closed-form warm-up turned into an order by one list-scheduling pass (milliseconds),
        unless the plan in force replays faster under ``costs``, fits their memory and keeps every
        link's route (then kept). After either, ``refine`` (the search, run beside training) may still
        find a faster one; a plan kept by ``_keep`` (near the lower bound) is not searched again."""
        kept = self._keep(costs)
        if isinstance(kept, Decision):
            return kept
        warmup = adapted_warmup(costs, self.N, caps=self._caps_for(list(costs.links)))
        plan = list_schedule(costs, self.N, warmup, policy=ListPolicy(units=self.units, w_share=self.w_share))
        return replace(self._better_of(self._replan(costs, plan, f"closed-form warm-up: {kept}")), refine=True)

    def _better_of(self, proposed: Decision) -> Decision:
        """``proposed`` (a new plan for its costs), or a decision that keeps the plan in force when the
        links keep their routes (a kept plan changes nothing in the transport), that plan fits the memory
        allowed under the new delays and its replay is faster than the new one's."""
        costs = proposed.costs
        target = list(costs.links)
        if self._link_modes(target) != self._link_modes(list(self.detector.planned_for)) or \
                not self._fits(self.plan_in_force, target):
            return proposed
        model = self._model(target, self.link_queues)
        now = replay(self.plan_in_force, costs, self.N, link_model=model).iteration_ms
        if proposed.predicted_ms <= now + 1e-6:  # a tie: the new plan, planned for these delays
            return proposed
        return self._kept(costs, now, f"{now:.1f} ms under the new delays, the new plan "
                                      f"{proposed.predicted_ms:.1f} ms ({proposed.reason})")

    def _kept(self, costs: Costs, now_ms: float, why: str) -> Decision:
        """The decision that keeps the plan in force for ``costs`` (its replay: ``now_ms``): the links'
        modes and tolerances under them, the queues each link has."""
        target = list(costs.links)
        tol = link_tolerances(self.plan_in_force, costs, self.N, resolution_ms=TOLERANCE_RESOLUTION_MS,
                              link_model=self._model(target, self.link_queues))
        modes = self._link_modes(target)
        return Decision(None, modes, self._queues_of(modes, self.link_queues), costs, [t.replay_ms for t in tol],
                        now_ms, f"kept the plan in force: {why}")

    def _fits(self, plan: Schedule, target: list[float]) -> bool:
        """``plan`` keeps within the caps and the memory budget allowed under ``target``."""
        caps = self._caps_for(target)
        if caps is not None and any(p > c for p, c in zip(peak_inflight(plan), caps)):
            return False
        return self.units is None or fits(plan, self.units, self.w_share)

    def refine(self, costs: Costs) -> Decision:
        """After ``react``'s plan was adopted for ``costs``: the search's plan when it is faster than
        the plan in force, else a decision that keeps it. Changes nothing (runs beside training)."""
        model = self._model(list(costs.links), self.link_queues)
        now = replay(self.plan_in_force, costs, self.N, link_model=model).iteration_ms
        found = self._searched(costs)
        better = self._replan(costs, found, "refined by the search")
        if better.predicted_ms < now - 1e-6:
            return better
        return self._kept(costs, now, f"the search found nothing faster than {now:.1f} ms")

    def _keep(self, costs: Costs) -> Union[Decision, str]:
        """A decision that keeps the plan in force, when the slow links are the same ones and it is
        within ``KEEP_WITHIN`` of the lower bound under the new delays; else why not (for the log)."""
        target = list(costs.links)
        old_slow, new_slow = _slow(self.detector.planned_for), _slow(target)
        if old_slow != new_slow:
            return f"slow links {old_slow} -> {new_slow}"
        model = self._model(target, self.link_queues)
        kept = replay(self.plan_in_force, costs, self.N, link_model=model).iteration_ms
        bound = lower_bound_ms(costs, self.N, caps=self._caps_for(target))
        if kept > (1 + KEEP_WITHIN) * bound:
            return (f"the plan in force would take {kept:.1f} ms, more than {KEEP_WITHIN:.0%} above the "
                    f"lower bound {bound:.1f} ms")
        return self._kept(costs, kept, f"{kept:.1f} ms under the new delays, within {KEEP_WITHIN:.0%} of the "
                                       f"lower bound {bound:.1f} ms")

    def _searched(self, costs: Costs) -> Schedule:
        """The deterministic search's plan for ``costs`` (``search_evals`` replays at most)."""
        target = list(costs.links)
        return search(costs, self.N, caps=self._caps_for(target), budget_s=600.0, seed=0, exact=False,
                      max_evals=self.search_evals,
                      link_model=[m if d else LATENCY for d, m in zip(self._direct(target), self.direct_models)],
                      units=self.units, w_share=self.w_share).schedule

    def _replan(self, costs: Costs, plan: Schedule, reason: str) -> Decision:
        """The decision that adopts ``plan`` for ``costs``: its queues, tolerances and replayed time."""
        if self.units is not None:
            plan = fit_budget(plan, self.units, ratio=self.w_share)
        target = list(costs.links)
        queues = self._size_queues(plan, costs, self._direct(target))
        model = self._model(target, queues)
        tol = [t.replay_ms for t in link_tolerances(plan, costs, self.N, resolution_ms=TOLERANCE_RESOLUTION_MS,
                                                    link_model=model)]
        predicted = replay(plan, costs, self.N, link_model=model).iteration_ms
        modes = self._link_modes(target)
        return Decision(plan, modes, self._queues_of(modes, queues), costs, tol, predicted, reason)

    def adopt(self, decision: Decision) -> None:
        """Take ``decision`` in (every rank, the same one): the plan, the queues, the detector's new
        targets and tolerances."""
        for link, k in decision.queues.items():
            self.link_queues[link] = k
        self.detector.adopt(decision.target_ms, decision.tolerance_ms)
        self.costs = decision.costs
        if decision.plan is not None:
            self.plan_in_force = decision.plan

    def step(self, iteration: int, f: Sequence[float], b: Sequence[float], w: Sequence[float],
             links: Sequence[Optional[float]]) -> Optional[Decision]:
        """``observe``, then ``propose`` and ``adopt`` when a decision is due (one process)."""
        costs = self.observe(iteration, f, b, w, links)
        if costs is None:
            return None
        decision = self.propose(costs)
        self.adopt(decision)
        return decision

    # -- the links as they run now -----------------------------------------------------------------
    def link_model(self) -> list:
        """The simulator's link model of the plan in force: the link's direct model (``Direct()`` or one
        FIFO, ``Delegated(1)``) for a direct link, ``Delegated(k)`` for a delegated one with its k queues."""
        return self._model(self.detector.planned_for, self.link_queues)

    def fifos(self) -> list[Optional[int]]:
        """Per link, the FIFOs whose sender does not wait it runs with now, as ``estimate.link_delays``
        wants: a delegated link's queues, 1 for a direct link whose sends do not block, None for a
        direct link whose sender waits."""
        return [m.queues if isinstance(m, Delegated) else None for m in self.link_model()]

    @property
    def may_delegate(self) -> bool:
        """A slow link may move to the delegates: "always", or "auto" where some link's direct sends block."""
        return self.delegation == "always" or (self.delegation == "auto"
                                               and any(isinstance(m, Direct) for m in self.direct_models))

    # -- rules -------------------------------------------------------------------------------------
    def _direct(self, target: list[float]) -> list[bool]:
        """Per link, whether it runs direct under ``target``."""
        if self.delegation == "always":
            return [False] * len(target)
        if self.delegation == "auto":  # a link whose direct sends do not block: a delegate gains nothing
            return [d <= 0 or not isinstance(m, Direct) for d, m in zip(target, self.direct_models)]
        return [True] * len(target)  # "off"

    def _link_modes(self, target: list[float]) -> dict[int, Route]:
        """Links the engine routes: every link under "always" (listed so that its queue count can
        grow), every link under "auto" (delegated when planned for a delay), none under "off"."""
        if self.delegation == "off":
            return {}
        return {i: Route.DIRECT if d else Route.DELEGATED for i, d in enumerate(self._direct(target))}

    def _model(self, target: list[float], queues: Sequence[int]) -> list:
        return [m if d else Delegated(k) for d, k, m in zip(self._direct(target), queues, self.direct_models)]

    @staticmethod
    def _queues_of(modes: dict[int, Route], queues: Sequence[int]) -> dict[int, int]:
        return {i: queues[i] for i, m in modes.items() if m is Route.DELEGATED}

    def _size_queues(self, plan: Schedule, costs: Costs, direct: list[bool]) -> list[int]:
        """Per link, the queues it gets under ``plan``: a delegated link the fewest (at least what it
        has, at most ``queues.cap``) with which its delegates keep pace (``plan.sched.queues.queues_needed``),
        but a link grows only when that gains more than ``GROW_GAIN`` of the iteration; a direct link
        keeps its count."""
        have = self.link_queues
        model: list = [m if d else LATENCY for d, m in zip(direct, self.direct_models)]
        for i, d in enumerate(direct):
            if not d:
                model[i] = Delegated(queues_needed(plan, costs, self.N, i, link_model=model, lo=have[i],
                                                   hi=max(have[i], self.queues.cap)))
        out = list(have)
        for i, d in enumerate(direct):
            if d:
                continue
            if model[i].queues > have[i]:
                kept = Delegated(have[i])
                now = replay(plan, costs, self.N, link_model=[*model[:i], kept, *model[i + 1:]]).iteration_ms
                grown = replay(plan, costs, self.N, link_model=model).iteration_ms
                if grown > (1 - GROW_GAIN) * now:
                    model[i] = kept
            out[i] = model[i].queues
        return out

    def _caps_for(self, target: list[float]) -> Optional[list[int]]:
        """§4.2: stages next to a delegated slow link stage their activations in host memory, so their
        cap is relaxed to N (the pipeline's micro-batch count), within the memory budget: what the
        forward saved for the backward stays on the device whatever the link."""
        if self.caps is None or self.delegation == "off":
            return self.caps
        caps = list(self.caps)
        room = [self.N] * self.S if self.units is None else [min(self.N, c) for c in caps_within(self.units)]
        for i, (d, direct) in enumerate(zip(target, self._direct(target))):
            if d > 0 and not direct:
                caps[i], caps[i + 1] = room[i], room[i + 1]
        return caps


def _direct_models(direct: DirectModels, links: int) -> list[LinkModel]:
    """One model per link, from one for every link or one per link (``plan.ir.links.per_link``)."""
    models = list(per_link(direct, links))
    for m in models:
        if m not in (DIRECT, Delegated(1)):
            raise ValueError(f"a direct link is Direct() (its sender waits) or Delegated(1) (one FIFO), not {m!r}")
    return models


def _slow(delays: Sequence[float]) -> list[int]:
    return [i for i, d in enumerate(delays) if d > 0]


def _rounded(raw: Sequence[float], previous: Sequence[float]) -> list[float]:
    """Op times to 0.5 ms (stable plans); an op never seen keeps its previous estimate."""
    return [old if ms < 0 else max(0.5, round(ms * 2) / 2) for ms, old in zip(raw, previous)]
