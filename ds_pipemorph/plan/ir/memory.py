"""Activation memory of a plan, against stock 1F1B's, and plans kept within a budget.

A micro-batch's activations are held on a stage from its ``F`` to its ``B`` (what ``F`` saved for the
backward) and then, in part, from its ``B`` to its ``W`` (what the weight gradients still need). With
one micro-batch's ``F``-to-``B`` activations as the unit, a stage holding ``h`` micro-batches between
``F`` and ``B`` and ``w`` between ``B`` and ``W`` holds ``h + ratio * w`` units, where ``ratio`` is
the share of the activations that ``B`` leaves for ``W``: the engine plans with 1 for the generic
graph split (``W`` keeps at most ``F``'s retained graph) and as if fused for a checkpointed job, and
logs what it measured. Stock DeepSpeed 1F1B (fused backward)
holds at most ``S - s`` units on stage ``s``: that is the reference a ``budget`` factor multiplies.

``fit_budget`` makes any plan keep within a per-stage budget by moving ``W`` ops earlier in their
stage's order, in front of the ``F`` or ``B`` that would exceed it. A ``W`` depends only on its own ``B``
(earlier in the row) and sends nothing, so the plan stays valid and deadlock-free; only the order of
one stage's own compute changes. Forwards held between ``F`` and ``B`` are bounded by the warm-up
caps (``caps_within``), which the planners already respect.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from .ops import Kind, Op, Schedule

# One tolerance for every memory comparison: budgets and capacities written to files with nine
# significant digits still hold what they were written to hold.
EPS = 1e-6


def stock_units(stages: int) -> list[int]:
    """Stock 1F1B's peak activations per stage, in micro-batches: ``S - s``."""
    return [stages - s for s in range(stages)]


def budget_units(stages: int, factor: float) -> list[float]:
    """The per-stage budget ``factor`` times stock 1F1B's, in units of one micro-batch's activations."""
    return [factor * u for u in stock_units(stages)]


def units_of_bytes(grant: Sequence[float], f_bytes: Sequence[int], most: float) -> list[float]:
    """A grant in bytes per stage as budget units: ``grant[s] / f_bytes[s]`` (one unit is one
    micro-batch's ``F``-to-``B`` activations on that stage), at most ``most`` (a stage whose ``F``
    saves nothing for ``B`` is held back by nothing but the caps)."""
    return [most if f <= 0 else min(most, g / f) for g, f in zip(grant, f_bytes)]


@dataclass
class MemoryBudget:
    """The activation-memory limits of a job, one object every planner and dispatcher reads when it
    plans (not a copy taken at start-up): per stage, the budget in micro-batches' activations
    (``units``; None: no limit) and the most micro-batches held between ``F`` and ``B`` (``caps``;
    None: no cap). A grant known only once the first iteration measured its bytes replaces both in
    place (``grant``), at an iteration boundary, on every rank alike; ``mib`` then says what it
    was in MiB per stage (None: a factor or a count, not bytes)."""

    caps: Optional[tuple[int, ...]]
    units: Optional[tuple[float, ...]] = None
    mib: Optional[tuple[float, ...]] = None

    def __post_init__(self) -> None:
        self.caps = None if self.caps is None else tuple(self.caps)
        self.units = None if self.units is None else tuple(self.units)
        self.mib = None if self.mib is None else tuple(self.mib)

    def grant(self, other: "MemoryBudget") -> None:
        """Take ``other``'s limits in place: every holder of this object reads them from now on."""
        self.caps, self.units, self.mib = other.caps, other.units, other.mib


class OverBudget(ValueError):
    """A stage's order holds more micro-batches between ``F`` and ``B`` than its budget allows, with
    no ``W`` to move: ``held`` micro-batches against ``units``."""

    def __init__(self, stage: int, held: int, units: float):
        super().__init__(f"stage {stage} holds {held} micro-batches between F and B, more than its "
                         f"budget of {units:.3g}")
        self.stage, self.held, self.units = stage, held, units

    def __reduce__(self):  # crosses processes (a search beside training) as it was raised
        return OverBudget, (self.stage, self.held, self.units)


def caps_within(units: Sequence[float]) -> list[int]:
    """The most micro-batches each stage may hold between ``F`` and ``B`` within ``units``."""
    return [max(0, math.floor(u + EPS)) for u in units]


def peak_units(schedule: Schedule, ratio: float = 1.0) -> list[float]:
    """Per stage, the most activation units held at once (``F``-to-``B`` ones count 1, ``B``-to-``W``
    ones ``ratio``), read off the order. A ``W`` that follows its ``B`` directly, as a fused backward
    runs, frees at once."""
    out = []
    for row in schedule:
        h = w = 0
        peak = 0.0
        for op in row:
            k = op.kind
            if k == Kind.F:
                h += 1
            elif k == Kind.B:
                h -= 1
                w += 1
            elif k == Kind.W:
                w -= 1
                continue
            peak = max(peak, h + ratio * w)
        out.append(peak)
    return out


def row_fits(row, units: float, ratio: float = 1.0) -> bool:
    """Whether one stage's order keeps the rule ``fit_budget`` enforces: room for every F, and for
    every B while a W is pending."""
    limit = units + EPS
    h = w = 0
    for op in row:
        k = op.kind
        if k == Kind.F:
            if h + 1 + ratio * w > limit:
                return False
            h += 1
        elif k == Kind.B:
            if w and h - 1 + ratio * (w + 1) > limit:
                return False
            h -= 1
            w += 1
        elif k == Kind.W:
            w -= 1
    return True


def fits(schedule: Schedule, units: Sequence[float], ratio: float = 1.0) -> bool:
    return all(row_fits(row, units[s], ratio) for s, row in enumerate(schedule))


def fit_budget(schedule: Schedule, units: Sequence[float], *, ratio: float = 1.0) -> Schedule:
    """``schedule`` with, on each stage, the pending ``W`` ops (oldest ``B`` first) moved in front of an
    ``F`` or a ``B`` that would otherwise exceed ``units[s]``; rows that fit are returned as they are.
    (A ``B`` with no ``W`` pending is left where it is: its own ``W`` can only follow it.)

    Raises ``OverBudget`` when a stage holds more forwards between ``F`` and ``B`` than its budget allows
    even with no ``W`` pending (its warm-up is deeper than the budget: a planner bug or a plan file
    for a larger budget)."""
    out: Schedule = []
    for s, row in enumerate(schedule):
        limit = units[s] + EPS
        if row_fits(row, units[s], ratio):
            out.append(list(row))
            continue
        new: list[Op] = []
        pending: list[Op] = []  # W ops whose B ran, in B order, not placed yet
        placed = set()

        def flush(after) -> None:
            while pending and after(len(pending)) > limit:
                w = pending.pop(0)
                new.append(w)
                placed.add(w)

        h = 0
        for op in row:
            k = op.kind
            if k == Kind.F:
                flush(lambda n: h + 1 + ratio * n)
                if h + 1 > limit:
                    raise OverBudget(s, round(max(peak_units([row], 0.0))), units[s])
                h += 1
                new.append(op)
            elif k == Kind.B:
                flush(lambda n: h - 1 + ratio * (n + 1))
                h -= 1
                new.append(op)
                pending.append(Op(Kind.W, op.mb))
            elif k == Kind.W:
                if op in placed:
                    continue
                pending.remove(op)
                new.append(op)
            else:
                new.append(op)
        out.append(new)
    return out
