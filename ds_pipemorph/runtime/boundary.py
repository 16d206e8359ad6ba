"""The iteration boundary: one exchange for every control loop, typed decisions, one place applies them.

Three loops act between iterations: the adapter (re-plans for slow links, ``runtime.adapt``), the
rebalance loop (moves layers away from a slowed stage, ``runtime.rebalance_loop``) and the
orchestrator (re-maps ranks around a slow data-parallel link, ``runtime.orchestrate_loop``). Each is
a ``BoundaryLoop``: it contributes a fixed-width row of floats from this rank's op records, reads
every rank's row back and returns a typed decision or None. ``Boundary.exchange`` concatenates the
loops' rows and all-gathers them in one collective in the migrator's gloo vote group (host tensors
on any backend, NCCL included), after a barrier so that waiting for the last rank to finish its
iteration is not counted as the loops' exchange. The engine applies what comes back in a fixed
order (``PipeMorphEngine._apply``): the adapter's ``Decision`` (plan, link routes), then a
``Migration`` (whose plan, if it brings one, is the last word), then a ``Remap``; the plan is
replaced once, there, on every rank alike.

Not every iteration ends with an exchange: the exchange costs the same on any model, so while no
loop acts and every loop says it is ``quiet`` the gap to the next one doubles, up to ``max_gap``
iterations, and falls back to one iteration as soon as anything changes (``control.exchange``: a
slow link is acted on at most ``max_gap - 1`` iterations later than with an exchange every
iteration). The rows are the last iteration's (a change the loops act on lasts several
iterations); the iterations in between only pass their records to ``skip``. Every rank takes
the same gap from what the exchange gave all of them (every iteration exchanges while
``pipemorph.compare`` runs; a loop may name the iteration it needs next, ``due_by``); the row
starts with the iteration, checked on every rank, so ranks that ever meet in exchanges of
different iterations stop with a message instead of reading each other's rows (a rank that skips
an exchange its peers entered waits in its next point-to-point message instead, up to
``timeout_s``). Without any loop (no ``adaptive`` control loop, no rebalance, no
orchestrator) nothing is exchanged at all.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..control.exchange import MAX_GAP, ExchangeSchedule
from ..plan.ir.ops import Schedule


@dataclass(frozen=True)
class Migration:
    """Move layers so that stage s holds ``parts[s]..parts[s+1]-1``; ``plan`` (or None: keep the plan
    in force) runs from the next iteration if the migration succeeds on every rank; ``event``: the
    rebalance loop's record of what it predicted."""

    parts: list[int]
    plan: Optional[Schedule]
    event: dict


@dataclass(frozen=True)
class Remap:
    """Re-map after this ``train_batch``: ``ranks[stage][replica]`` (run by ``runtime.engine_handle.EngineHandle``)."""

    ranks: list[list[int]]


class BoundaryLoop(Protocol):
    """``row`` and ``decide`` at every exchange; ``skip`` at every other boundary (optional: a loop
    without it keeps nothing of those iterations); ``quiet`` after ``decide`` (optional: a loop
    without it is never quiet, so every iteration exchanges)."""

    width: int  # floats this loop adds to every rank's row

    def row(self, engine, records) -> Sequence[float]:
        """This rank's contribution (``width`` floats), from the iteration that just ended."""

    def decide(self, engine, table: torch.Tensor, sync_ms: float, exchange_ms: float):
        """Every rank's rows (``world x width``; the same table on every rank) -> a decision or None.
        ``sync_ms``/``exchange_ms``: what the barrier and the all-gather took."""

    def skip(self, engine, records) -> None:
        """An iteration that ends without an exchange: what the loop keeps of it (no collective)."""

    def quiet(self) -> bool:
        """After ``decide``: nothing this loop watches is on its way to a decision, so the next
        exchange may wait. The same answer on every rank (from the table and state fed by it only)."""

    def due_by(self) -> Optional[int]:
        """Optional, after ``decide``: the iteration this loop needs the next exchange at, if it acts
        only at some iterations (None: any). The same on every rank, as ``quiet``."""


class Boundary:
    """The loops in the order their decisions apply; ``exchange`` runs them for one boundary."""

    def __init__(self, loops: Sequence[BoundaryLoop], group_of, max_gap: int = MAX_GAP):
        self.loops = list(loops)
        self._skips = [loop.skip for loop in self.loops if hasattr(loop, "skip")]
        self._group_of = group_of  # () -> the gloo group every rank is in (formed at the first call)
        self.schedule = ExchangeSchedule(max_gap)
        self.iteration = -1  # of the boundary running now (0-based)
        self.exchanged: list[int] = []  # the iterations that ended with an exchange

    def exchange(self, engine, records) -> list:
        """Every rank, at the same boundary: the loops' decisions (None where a loop has none, and
        for every loop at a boundary without an exchange)."""
        if not self.loops:
            return []
        self.iteration += 1
        if not self.schedule.due(self.iteration):
            for skip in self._skips:
                skip(engine, records)
            return [None] * len(self.loops)
        out = self._exchange(engine, records)
        self.exchanged.append(self.iteration)
        quiet = all(d is None for d in out) and all(map(_quiet, self.loops)) and not _comparing(engine)
        self.schedule.exchanged(self.iteration, quiet, _due_by(self.loops))
        return out

    def _exchange(self, engine, records) -> list:
        parts = [torch.as_tensor(loop.row(engine, records), dtype=torch.float64) for loop in self.loops]
        for loop, part in zip(self.loops, parts):  # before the collective: a short row would hang every rank
            if part.shape != (loop.width,):
                raise RuntimeError(f"{type(loop).__name__} gave a boundary row of shape {tuple(part.shape)}, "
                                   f"not ({loop.width},)")
        row = torch.cat([torch.tensor([float(self.iteration)], dtype=torch.float64), *parts])
        group = self._group_of()
        t = time.perf_counter_ns()
        dist.barrier(group=group)  # waiting for the last rank to finish its iteration is not the loops' cost
        sync_ms = (time.perf_counter_ns() - t) / 1e6
        t = time.perf_counter_ns()
        table = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(table, row, group=group)
        table = torch.stack(table)
        exchange_ms = (time.perf_counter_ns() - t) / 1e6
        self._check_iterations(table[:, 0])
        out, start = [], 1
        for loop, part in zip(self.loops, parts):
            out.append(loop.decide(engine, table[:, start:start + len(part)], sync_ms, exchange_ms))
            start += len(part)
        return out

    def _check_iterations(self, column: torch.Tensor) -> None:
        """Every rank exchanged after the same iteration, or no rank reads the table."""
        at = [int(x) for x in column.tolist()]
        if any(i != self.iteration for i in at):
            raise RuntimeError(f"rank {dist.get_rank()}: the control loops' exchange after iteration {self.iteration} "
                               f"met other ranks after iterations {at} (per rank): the ranks disagree on when "
                               f"the loops exchange")


def _comparing(engine) -> bool:
    """``pipemorph.compare`` alternates sides every iteration: an exchange at every iteration while it
    runs, or exchanges spaced 4 or 8 apart would all land on one side of its cycle (A B A' B), charge
    their cost to that side only and sample one schedule only. ``done`` is set by iteration count, the
    same on every rank."""
    compare = getattr(engine, "compare", None)
    return compare is not None and not compare.done


def _due_by(loops) -> Optional[int]:
    """The earliest iteration a loop needs the next exchange at (``BoundaryLoop.due_by``), if any."""
    due = [d for d in (getattr(loop, "due_by", lambda: None)() for loop in loops) if d is not None]
    return min(due, default=None)


def _quiet(loop) -> bool:
    quiet = getattr(loop, "quiet", None)
    return quiet is not None and quiet()
