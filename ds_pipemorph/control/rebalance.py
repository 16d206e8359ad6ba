"""When and where to move layers away from a slowed stage (DynPipe's loop, for zero-bubble plans).

Torch-free: the engine hands ``Rebalancer.observe`` each iteration's measured F, B and W of every
stage (ms per micro-batch; with data parallelism, the slowest replica of the stage, since the
pipeline waits for it) and gets back a ``Rebalance`` (new stage boundaries and the plan for them)
or None. The first iteration carries start-up work and is never measured.

- **What a layer should cost.** A layer profile (``docs/partition.md``) if one is given: then a
  stage slowed from the first iteration is seen slowed at once. Otherwise learned from the
  ``warmup`` iterations after the first (averaged), by comparing stages with each other
  (``learn_layer_costs``). The assumption: layers of one class (the engine's layer signature:
  the layer's type and its parameters' shapes, or a function's name and the module it computes
  with) cost the same on every stage. It fails where the activations' shapes change with depth
  (a downsampling CNN whose stages keep the channel count, a funnel or pooling transformer) or
  where a layer's work depends on its input (an MoE layer's routing): a stage holding the
  earlier, dearer layers then reads as slow from the start, and one holding the later ones as
  fast. Give a layer profile there (``rebalance.layer_profile``). A class held by several
  stages, one of which holds nothing else (nothing that counts, see below), costs per layer what
  it costs on such a stage: the median one (the lower of the two middle ones), so one stage
  slowed from the start, or one that happens to run fast, does not set it. Such a stage then
  shows its slowdown from the start. Every other layer (an embedding, a head, a class no stage
  holds alone, or every layer when no class is shared across stages) takes a part of what its
  stage's time leaves once its classed layers are paid, in proportion to weights (parameter
  counts; evenly where none of those layers has any), as all layers did before classes: that
  part of a stage is assumed healthy, so a stage slowed from the start is missed where no class
  is shared (each stage then shows 1), and a stage's different layers (an embedding) are never
  mistaken for a slowdown. A layer with neither weight nor class (the engine's modules without
  parameters: an activation, a dropout) joins no class and costs nothing on a stage with other
  layers, so activations between blocks do not keep a stage from holding its blocks alone; the
  engine gives a function without a module (a flatten lambda) neither either. A function layer
  computing with a module (a head using the embedding another layer holds) has a class of its own
  and counts even without weight, so a stage holding it with blocks does not hold the blocks
  alone; it takes its share of what its stage's time leaves (beside blocks only, all of it).
- **Detection.** A stage's slowdown is its measured F + B + W over what its layers should cost. The
  current partition was chosen for some slowdowns (all 1 at the start); when a stage's slowdown
  sits more than ``noise`` away from its own, on the same side (above: a straggler appears, or
  was there from the start; below: it recovers), in each of the last ``patience`` iterations,
  the loop acts.
- **Prediction.** The slowdown a stage will see is the mean over those iterations (persistence: on
  this machine's interference data the learned predictor, ``control.interference``, did not beat
  it). The slowdown belongs to the rank, whatever layers it holds, so a candidate partition's stage
  s costs the sum of its layers' times times stage s's predicted factor.
- **Choice.** Live migration moves layers between neighbouring stages, so the candidates are the
  partitions one step reaches (each boundary within its neighbours' old positions; tied layers stay
  put): ``best_step`` takes ``plan.partition``'s optimum under those factors when it is within
  reach, else the best reachable one (every one scored; past ``REACHABLE_EXACT`` of them, a
  descent, which may stop short of the best). A
  later detection continues the way. The step is proposed only if its predicted iteration beats
  the current partition's, under the same factors, by ``min_gain``. Either way the predicted factors become the reference, so one
  change is acted on once.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Optional, Sequence

from ..fileio import BadInput
from ..plan.ir.ops import Schedule
from ..plan.partition.layer_profile import LayerProfile
from ..plan.partition.partition import block_shifts, evaluate, partition
from ..plan.partition.parts import check_parts, layer_moves, owner
from ..plan.sched.search import search

# The plan for a new partition: a deterministic search (stopped by evaluations, never by the clock,
# so every rank that runs it gets the same plan).
PLAN_EVALS = 300
# Partitions one migration step reaches, up to which every one is scored (well under a second on
# small profiles, a few seconds at most).
REACHABLE_EXACT = 2000


@dataclass
class Rebalance:
    parts: list[int]
    slowdown: list[float]  # predicted per stage
    current_ms: float  # the partition in force, under the predicted slowdowns
    predicted_ms: float  # the proposed one (its best greedy plan, replayed)
    plan: Schedule  # planned for the proposed partition under the predicted stage times
    iteration: int  # observations so far (0-based index of the iteration that triggered it)


@dataclass
class Rebalancer:
    stages: int
    microbatches: int
    parts: list[int]
    caps: list[int]  # per-stage cap on in-flight activations the plans keep
    noise: float = 0.15
    patience: int = 2
    min_gain: float = 0.05
    warmup: int = 2
    profile: Optional[LayerProfile] = None
    pinned: tuple = ()  # layers that never change stage (tied ones)
    iteration: int = 0
    reference: list[float] = field(default_factory=list)  # slowdowns the current partition was chosen for
    history: list[list[float]] = field(default_factory=list)  # the last ``patience`` iterations' slowdowns
    decisions: list[Rebalance] = field(default_factory=list)
    _learning: list[list[tuple[float, float, float]]] = field(default_factory=list)
    _before: list[float] = field(default_factory=list)  # the reference before the last decision
    _caps_here: bool = False  # the profile's memory is ``caps`` (``set_caps`` replaces it)

    def __post_init__(self) -> None:
        self.parts = check_parts(list(self.parts), stages=self.stages)
        if len(self.caps) != self.stages:
            raise BadInput(f"caps: expected {self.stages} values (one per stage), got {len(self.caps)}")
        if self.profile is not None:
            self.profile = self._with_caps(self.profile)
            self.profile.check(self.parts)
        self.reference = [1.0] * self.stages

    # -- per iteration --------------------------------------------------------------------------
    def observe(self, stage_ms: Sequence[Sequence[float]], layer_weight: Optional[Sequence[float]] = None,
                layer_class: Optional[Sequence[Hashable]] = None) -> Optional[Rebalance]:
        """One iteration: ``stage_ms[s]`` = (F, B, W) ms per micro-batch of stage s;
        ``layer_weight[l]`` = parameter count of layer l (for a function, of the module it
        computes with), ``layer_class[l]`` = its class (equal for layers assumed to cost the same
        wherever they run; 0 or None: none). Both are used only while learning layer costs;
        without classes each stage's time is split among its own layers."""
        if len(stage_ms) != self.stages:
            raise BadInput(f"stage_ms: expected {self.stages} stages, got {len(stage_ms)}")
        k, self.iteration = self.iteration, self.iteration + 1
        if k == 0:  # start-up work: neither a layer's cost nor a slowdown
            return None
        if self.profile is None:
            self._learning.append([tuple(float(x) for x in row) for row in stage_ms])
            if len(self._learning) == self.warmup:
                self.profile = self._learned(layer_weight, layer_class)
            return None
        slow = self.slowdowns(stage_ms)
        self.history = (self.history + [slow])[-self.patience:]
        if len(self.history) < self.patience or not any(self._drifted(s) for s in range(self.stages)):
            return None
        predicted = [sum(h[s] for h in self.history) / len(self.history) for s in range(self.stages)]
        self._before, self.history, self.reference = self.reference, [], predicted
        return self._propose(predicted, k)

    def _drifted(self, s: int) -> bool:
        """Stage s sat more than ``noise`` away from its reference, on the same side, in each of
        the last ``patience`` iterations (a straggler is one stage that stays slow, not noise
        that visits a different stage each iteration)."""
        r = self.reference[s]
        above = all(h[s] > r * (1.0 + self.noise) for h in self.history)
        below = all(h[s] < r / (1.0 + self.noise) for h in self.history)
        return above or below

    def slowdowns(self, stage_ms: Sequence[Sequence[float]]) -> list[float]:
        """Per stage: measured F + B + W over what its layers cost in the profile."""
        costs = self.profile.costs(self.parts)
        out = []
        for s, row in enumerate(stage_ms):
            expected = costs.f[s] + costs.b[s] + costs.w[s]
            out.append(sum(row) / expected if expected > 0 else 1.0)
        return out

    def moved(self, parts: list[int]) -> None:
        """The engine moved to ``parts`` (every rank did). Slowdowns seen on the old partition no
        longer count, nor, while layer costs are still being learned, the iterations measured on it
        (their stage times cannot be split over the new partition's layers)."""
        self.parts = check_parts(list(parts), stages=self.stages)
        self.history = []
        if self.profile is None:
            self._learning = []

    def failed(self) -> None:
        """The migration of the last decision failed (every rank kept its layers): the partition
        is still the one chosen for the previous slowdowns, so the next iterations detect again."""
        self.reference = self._before

    # -- choosing ---------------------------------------------------------------------------------
    def _propose(self, predicted: list[float], k: int) -> Optional[Rebalance]:
        lp = self.profile
        step, step_ms = best_step(lp, self.parts, predicted, self.pinned)
        if step == self.parts:
            return None
        now_ms = evaluate(lp, self.parts, slowdown=predicted)
        if not step_ms < now_ms * (1.0 - self.min_gain):
            return None
        costs = lp.costs(step, slowdown=predicted)
        caps = [c if c is not None else self.microbatches for c in lp.caps(step)]
        plan = search(costs, self.microbatches, caps=caps, budget_s=3600.0, max_evals=PLAN_EVALS).schedule
        decision = Rebalance(step, predicted, now_ms, step_ms, plan, k)
        self.decisions.append(decision)
        return decision

    def set_caps(self, caps: Sequence[int]) -> None:
        """The in-flight caps the plans keep from now on (a memory grant known after start-up); a
        profile that took the caps from here (learned, or given without a memory limit) takes the new ones."""
        caps = list(caps)
        if caps == list(self.caps):
            return
        self.caps = caps
        if self.profile is not None and self._caps_here:
            self.profile = self._with_caps(self.profile, replace=True)

    def _with_caps(self, lp: LayerProfile, replace: bool = False) -> LayerProfile:
        """The profile with the engine's in-flight caps where it sets no memory limit of its own."""
        if not replace and (lp.memory.capacity_mb is not None or lp.memory.max_inflight is not None):
            return lp
        self._caps_here = True
        data = lp.model_dump()
        data["memory"] = {"max_inflight": list(self.caps)}
        data["microbatches"] = self.microbatches
        return LayerProfile.model_validate(data)

    def _learned(self, layer_weight: Optional[Sequence[float]],
                 layer_class: Optional[Sequence[Hashable]]) -> LayerProfile:
        n, L = len(self._learning), self.parts[-1]
        mean = [tuple(sum(it[s][j] for it in self._learning) / n for j in range(3)) for s in range(self.stages)]
        weight = [1.0] * L if layer_weight is None else [max(0.0, float(x)) for x in layer_weight]
        if len(weight) != L:
            raise BadInput(f"layer_weight: expected {L} values (one per layer), got {len(weight)}")
        if layer_class is not None and len(layer_class) != L:
            raise BadInput(f"layer_class: expected {L} values (one per layer), got {len(layer_class)}")
        per = learn_layer_costs(mean, self.parts, weight, layer_class)
        self._caps_here = True
        return LayerProfile.model_validate({
            "stages": self.stages, "microbatches": self.microbatches,
            "layers": {"forward_ms": [c[0] for c in per], "backward_input_ms": [c[1] for c in per],
                       "backward_weight_ms": [c[2] for c in per]},
            "memory": {"max_inflight": list(self.caps)}})


Cost = tuple[float, float, float]  # F, B, W ms per micro-batch


def learn_layer_costs(stage_ms: Sequence[Cost], parts: list[int], weight: Sequence[float],
                      layer_class: Optional[Sequence[Hashable]] = None) -> list[Cost]:
    """Per layer, what it costs when healthy, from each stage's measured (F, B, W) under ``parts``.

    A layer of a class some stage holds alone (``class_costs``) costs that class's reference;
    every other layer shares what its stage's time leaves after those (never below 0), by
    ``weight`` (evenly if its stage has none). Without classes, or with none shared across stages,
    this is each stage's time split among its own layers by weight, the same as before classes."""
    classes = _classes(layer_class, len(weight))
    counted = [_counted(weight, classes, range(parts[s], parts[s + 1])) for s in range(len(parts) - 1)]
    known = class_costs(stage_ms, counted, classes)
    per: list[Cost] = [(0.0, 0.0, 0.0)] * len(weight)
    for s, layers in enumerate(counted):
        classed = [l for l in layers if classes[l] in known]
        for l in classed:
            per[l] = known[classes[l]]
        left = [max(0.0, stage_ms[s][j] - sum(known[classes[l]][j] for l in classed)) for j in range(3)]
        rest = [l for l in layers if classes[l] not in known]
        for l, share in _shares(rest, weight):
            per[l] = (left[0] * share, left[1] * share, left[2] * share)
    return per


def class_costs(stage_ms: Sequence[Cost], counted: Sequence[list[int]],
                classes: Sequence[Optional[Hashable]]) -> dict:
    """Per class held by more than one stage and alone by at least one: what one of its layers
    costs on a stage holding nothing else, the median of those stages by F + B + W (the lower of
    the two middle ones, so with two stages the faster one). A class one stage holds teaches
    nothing across stages, and a stage that holds several classes cannot say which costs what."""
    holders: dict = {}
    for s, layers in enumerate(counted):
        for c in {classes[l] for l in layers} - {None}:
            holders.setdefault(c, []).append(s)
    alone: dict = {}
    for s, layers in enumerate(counted):
        held = {classes[l] for l in layers}
        if len(held) == 1 and None not in held:
            c = held.pop()
            if len(holders[c]) > 1:
                alone.setdefault(c, []).append(tuple(x / len(layers) for x in stage_ms[s]))
    return {c: _lower_median(costs) for c, costs in alone.items()}


def _lower_median(costs: list[Cost]) -> Cost:
    ranked = sorted(costs, key=sum)
    return ranked[(len(ranked) - 1) // 2]


def _counted(weight: Sequence[float], classes: Sequence[Optional[Hashable]], layers: range) -> list[int]:
    """A stage's layers that take part of its time: those with a weight or a class, or all if none
    has either. A layer with neither (an activation or a dropout between blocks) is taken as free,
    so that stages of blocks and activations still hold their blocks alone; a function layer with
    a module has a class, since it may cost as much as a block (a head's matmul) and must not read
    as the blocks' slowdown."""
    held = [l for l in layers if weight[l] > 0 or classes[l] is not None]
    return held or list(layers)


def _classes(layer_class: Optional[Sequence[Hashable]], L: int) -> list[Optional[Hashable]]:
    """Each layer's class, None for none (0 or None given: the engine's modules without parameters)."""
    if layer_class is None:
        return [None] * L
    return [c if c else None for c in layer_class]


def _shares(layers: list[int], weight: Sequence[float]) -> Iterator[tuple[int, float]]:
    total = sum(weight[l] for l in layers)
    for l in layers:
        yield l, (weight[l] / total if total > 0 else 1.0 / len(layers))


def reachable(old: list[int], pinned: Sequence[int] = ()) -> Iterator[list[int]]:
    """Every partition one migration step reaches from ``old``: each boundary within its
    neighbours' old positions (so every layer moves at most to a neighbouring stage), no stage
    empty, no ``pinned`` layer (a tied one) on another stage."""
    S, L = len(old) - 1, old[-1]
    windows = [range(old[s - 1], old[s + 1] + 1) for s in range(1, S)]
    for cut in itertools.product(*windows):
        parts = [0, *cut, L]
        if all(a < b for a, b in zip(parts, parts[1:])) and all(owner(old, l) == owner(parts, l) for l in pinned):
            yield parts


def best_step(lp: LayerProfile, old: list[int], slowdown: list[float],
              pinned: Sequence[int] = ()) -> tuple[list[int], float]:
    """A partition one migration step reaches, and its ``evaluate`` score under ``slowdown``: the
    global optimum (``plan.partition``) when it is within reach; else, when at most
    ``REACHABLE_EXACT`` partitions are reachable, the best of them (ties: the current one, then
    the first in ``reachable`` order); past that, a good one, not proven best: a descent by
    ``block_shifts`` from the optimum's boundaries clamped into reach."""
    score = lambda p: evaluate(lp, p, slowdown=slowdown)  # noqa: E731
    best = partition(lp, slowdown=slowdown).parts
    if _within(old, best, pinned):
        return best, score(best)
    few = list(itertools.islice(reachable(old, pinned), REACHABLE_EXACT + 1))
    if len(few) <= REACHABLE_EXACT:
        found, found_ms = old, score(old)
        for p in few:
            t = score(p)
            if t < found_ms - 1e-9:
                found, found_ms = p, t
        return found, found_ms
    S = len(old) - 1
    start = [0] + [min(max(best[s], old[s - 1]), old[s + 1]) for s in range(1, S)] + [old[-1]]
    found = start if _within(old, start, pinned) else old
    found_ms = score(found)
    improved = True
    while improved:
        improved = False
        for p in block_shifts(found):
            if _within(old, p, pinned):
                t = score(p)
                if t < found_ms - 1e-9:
                    found, found_ms, improved = p, t, True
                    break
    return found, found_ms


def _within(old: list[int], parts: list[int], pinned: Sequence[int]) -> bool:
    try:
        check_parts(parts, layers=old[-1], stages=len(old) - 1)
        layer_moves(old, parts)
    except BadInput:
        return False
    return all(owner(old, l) == owner(parts, l) for l in pinned)
