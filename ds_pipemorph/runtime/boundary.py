"""The iteration boundary: one exchange for every control loop, typed decisions, one place applies them.

Three loops act between iterations: the adapter (re-plans for slow links, ``runtime.adapt``), the
rebalance loop (moves layers away from a slowed stage, ``runtime.rebalance_loop``) and the
orchestrator (re-maps ranks around a slow data-parallel link, ``runtime.orchestrate_loop``). Each is
a ``BoundaryLoop``: it contributes a fixed-width row of floats from this rank's op records, reads
every rank's row back and returns a typed decision or None. ``Boundary.exchange`` concatenates the
loops' rows and all-gathers them once per iteration in the migrator's gloo vote group (host tensors
on any backend, NCCL included), after a barrier so that waiting for the last rank to finish its
iteration is not counted as the loops' exchange. The engine applies what comes back in a fixed
order (``PipeMorphEngine._apply``): the adapter's ``Decision`` (plan, link routes), then a
``Migration`` (whose plan, if it brings one, is the last word), then a ``Remap``; the plan is
replaced once, there, on every rank alike.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

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
    width: int  # floats this loop adds to every rank's row

    def row(self, engine, records) -> Sequence[float]:
        """This rank's contribution (``width`` floats), from the iteration that just ended."""

    def decide(self, engine, table: torch.Tensor, sync_ms: float, exchange_ms: float):
        """Every rank's rows (``world x width``; the same table on every rank) -> a decision or None.
        ``sync_ms``/``exchange_ms``: what the barrier and the all-gather took."""


class Boundary:
    """The loops in the order their decisions apply; ``exchange`` runs them for one boundary."""

    def __init__(self, loops: Sequence[BoundaryLoop], group_of):
        self.loops = list(loops)
        self._group_of = group_of  # () -> the gloo group every rank is in (formed at the first call)

    def exchange(self, engine, records) -> list:
        """Every rank, at the same boundary: the loops' decisions (None where a loop has none)."""
        if not self.loops:
            return []
        parts = [torch.as_tensor(loop.row(engine, records), dtype=torch.float64) for loop in self.loops]
        for loop, part in zip(self.loops, parts):  # before the collective: a short row would hang every rank
            if part.shape != (loop.width,):
                raise RuntimeError(f"{type(loop).__name__} gave a boundary row of shape {tuple(part.shape)}, "
                                   f"not ({loop.width},)")
        row = torch.cat(parts)
        group = self._group_of()
        t = time.perf_counter_ns()
        dist.barrier(group=group)  # waiting for the last rank to finish its iteration is not the loops' cost
        sync_ms = (time.perf_counter_ns() - t) / 1e6
        t = time.perf_counter_ns()
        table = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(table, row, group=group)
        table = torch.stack(table)
        exchange_ms = (time.perf_counter_ns() - t) / 1e6
        out, start = [], 0
        for loop, part in zip(self.loops, parts):
            out.append(loop.decide(engine, table[:, start:start + len(part)], sync_ms, exchange_ms))
            start += len(part)
        return out
