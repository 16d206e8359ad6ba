"""A placement of ranks on the pipeline x data-parallel grid, what it costs on a link matrix, and
the topology file that carries it to the runtime (docs/placement.md).

``grid[s][r]`` is the global rank that runs stage ``s`` of pipeline replica ``r``; DeepSpeed's
``PipeDataParallelTopology(num_pp=P, num_dp=D)`` (axes ``['pipe', 'data']``, row-major) is the
default placement ``grid[s][r] = s * D + r``. What a placement decides:

- pipeline links: replica ``r``'s link ``s`` joins ``grid[s][r]`` and ``grid[s + 1][r]``; its
  delay ``c_s`` for the planner is that pair's latency, plus ``activation_mb`` / bandwidth when a
  message size is given (otherwise transfer time is taken to be part of the profiled op times);
- data-parallel rings: stage ``s``'s gradients are all-reduced over the ranks ``grid[s][*]``.
  ``torch.distributed.new_group`` sorts a group's ranks and a ring all-reduce (gloo's) passes
  data along the group's rank order: ascending global rank, then back to the first.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..files.linkmatrix import LinkMatrix

BRUTE_FORCE_REPLICAS = 6  # up to this many replicas the closest relabelling is found by trying all


@dataclass(frozen=True)
class Placement:
    """``grid[stage][replica] = rank``; every rank of ``0..P*D-1`` exactly once."""

    grid: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        ranks = sorted(r for row in self.grid for r in row)
        if not self.grid or len({len(row) for row in self.grid}) != 1 or ranks != list(range(len(ranks))):
            raise ValueError(f"a placement holds every rank 0..P*D-1 once in a P x D grid, not {self.grid}")

    @property
    def pp(self) -> int:
        return len(self.grid)

    @property
    def dp(self) -> int:
        return len(self.grid[0])

    @staticmethod
    def default(pp: int, dp: int) -> "Placement":
        """DeepSpeed's ``PipeDataParallelTopology``: rank = stage * D + replica."""
        return Placement(tuple(tuple(s * dp + r for r in range(dp)) for s in range(pp)))

    @staticmethod
    def from_ranks(ranks: list[list[int]]) -> "Placement":
        return Placement(tuple(tuple(int(x) for x in row) for row in ranks))

    def pipeline(self, replica: int) -> list[int]:
        """The ranks of replica ``replica``'s stages, stage 0 first."""
        return [row[replica] for row in self.grid]

    def dp_group(self, stage: int) -> list[int]:
        """The ranks holding stage ``stage``, in replica order."""
        return list(self.grid[stage])

    def link_delays(self, matrix: LinkMatrix, replica: int, activation_mb: float = 0.0) -> list[float]:
        """The planner's ``links_ms`` of one replica: for each pair of neighbouring stages its
        latency, plus ``activation_mb`` / bandwidth (GB/s is MB per ms)."""
        p = self.pipeline(replica)
        return [matrix.latency(p[s], p[s + 1]) + (activation_mb / matrix.bandwidth(p[s], p[s + 1]) if activation_mb else 0.0)
                for s in range(len(p) - 1)]

    def moved(self) -> int:
        """How many grid positions hold another rank than in the default placement."""
        D = self.dp
        return sum(1 for s, row in enumerate(self.grid) for r, x in enumerate(row) if x != s * D + r)

    def relabelled(self, order: tuple[int, ...]) -> "Placement":
        """The same placement with replica ``order[r]`` renamed ``r`` (nothing it costs changes)."""
        return Placement(tuple(tuple(row[o] for o in order) for row in self.grid))

    def closest_to_default(self) -> "Placement":
        """The relabelling of the replicas that moves the fewest ranks from the default (the
        first such grid in lexicographic order); beyond ``BRUTE_FORCE_REPLICAS`` replicas, each
        replica named after the default replica most of its ranks belong to, where possible."""
        D, grid = self.dp, self.grid
        # miss[r][h]: positions of replica r that would differ from the default if it were named h
        miss = [[sum(1 for s, row in enumerate(grid) if row[r] != s * D + h) for h in range(D)] for r in range(D)]
        if D <= BRUTE_FORCE_REPLICAS:
            cost = {o: sum(miss[o[h]][h] for h in range(D)) for o in itertools.permutations(range(D))}
            fewest = min(cost.values())
            return min((self.relabelled(o) for o, c in cost.items() if c == fewest), key=lambda p: p.grid)
        home = [min(range(D), key=lambda h: miss[r][h]) for r in range(D)]
        if len(set(home)) != D:
            return self
        return self.relabelled(tuple(sorted(range(D), key=lambda r: home[r])))

    def as_lists(self) -> list[list[int]]:
        return [list(row) for row in self.grid]


def ring_links(ranks: list[int]) -> list[tuple[int, int]]:
    """The links of the all-reduce ring over ``ranks``: ascending rank order, closed at the end."""
    ring = sorted(ranks)
    D = len(ring)
    if D < 2:
        return []
    if D == 2:
        return [(ring[0], ring[1])]
    return [(ring[i], ring[(i + 1) % D]) for i in range(D)]


def allreduce_ms(matrix: LinkMatrix, ranks: list[int], grad_mb: float, *, chunk_mb: Optional[float] = None) -> float:
    """A ring all-reduce of ``grad_mb`` MB over ``ranks``, in ms (bulk-synchronous ring model).

    Reduce-scatter then all-gather: 2(D−1) steps; in each, every rank sends one part of G/D MB
    to its successor on the ring (``ring_links``) and a step ends when its slowest transfer ends.
    A part travels as k = ⌈(G/D) / chunk_mb⌉ messages, one in flight per link (k = 1 without
    ``chunk_mb``), each paying the link's latency once:

        T = 2(D−1) · max over ring links (a, b) of ( k · latency(a, b) + (G/D) / bandwidth(a, b) )

    Bandwidth in GB/s is MB per ms. One rank or no gradients: no all-reduce, 0 ms."""
    links = ring_links(ranks)
    if not links or grad_mb <= 0:
        return 0.0
    D = len(ranks)
    part = grad_mb / D
    k = math.ceil(part / chunk_mb) if chunk_mb else 1
    return 2 * (D - 1) * max(k * matrix.latency(a, b) + part / matrix.bandwidth(a, b) for a, b in links)


class TopologyFile(BaseModel):
    """The topology file ``pipemorph place`` writes: ``ranks[stage][replica]`` = global rank.
    Extra information (``predicted``, ``links_ms``, ...) may follow; the runtime reads only
    ``axes``, ``dims`` and ``ranks``."""

    model_config = ConfigDict(extra="allow")
    version: Literal[1] = 1
    axes: tuple[Literal["pipe"], Literal["data"]] = ("pipe", "data")  # DeepSpeed's PipeDataParallelTopology axes
    dims: tuple[int, int]  # (P, D)
    ranks: list[list[int]] = Field(min_length=1)

    @model_validator(mode="after")
    def _grid(self) -> "TopologyFile":
        P, D = self.dims
        if P < 1 or D < 1:
            raise ValueError(f"dims: {P} stages x {D} replicas; both must be at least 1")
        if len(self.ranks) != P or any(len(row) != D for row in self.ranks):
            raise ValueError(f"ranks: expected {P} rows (one per stage) of {D} ranks (one per replica), as dims says")
        seen = sorted(x for row in self.ranks for x in row)
        if seen != list(range(P * D)):
            missing = sorted(set(range(P * D)) - set(seen))
            what = f"rank {missing[0]} is missing" if missing else "a rank appears twice or is outside 0..P*D-1"
            raise ValueError(f"ranks: every rank 0..{P * D - 1} must appear once; {what}")
        return self

    def placement(self) -> Placement:
        return Placement.from_ranks(self.ranks)
