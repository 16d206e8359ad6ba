"""The topology file of ``pipemorph place`` as a DeepSpeed ``ProcessTopology`` (docs/placement.md).

    from ds_pipemorph.runtime.topology_file import load_topology
    model = PipelineModule(layers=..., topology=load_topology("topology.yaml"), ...)

``ranks[stage][replica]`` of the file is the global rank at coordinate ``(pipe=stage,
data=replica)``. The default placement gives DeepSpeed's own ``PipeDataParallelTopology``; any
other gives a ``PlacedTopology``, a subclass whose coordinate → rank mapping is the file's, so
DeepSpeed's ``PipelineParallelGrid`` builds its data-parallel groups (one per stage) and pipeline
groups (one per replica) from the file.
"""
from __future__ import annotations

import os
from typing import Union

from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from ..fileio import load_model
from ..plan.place.placement import Placement, TopologyFile


class PlacedTopology(PipeDataParallelTopology):
    """``PipeDataParallelTopology(num_pp=P, num_dp=D)`` with ``ranks[stage][replica]`` as its ranks."""

    def __init__(self, ranks: list[list[int]]):
        placement = Placement.from_ranks(ranks)  # raises ValueError unless every rank is there once
        super().__init__(num_pp=placement.pp, num_dp=placement.dp)
        # Same coordinates in the same (row-major) order as DeepSpeed's, other ranks.
        self.mapping = {self.ProcessCoord(pipe=s, data=r): placement.grid[s][r]
                        for s in range(placement.pp) for r in range(placement.dp)}


def process_topology(topo: Union[TopologyFile, Placement]) -> PipeDataParallelTopology:
    """DeepSpeed's topology for a placement: the stock class for the default one."""
    p = topo.placement() if isinstance(topo, TopologyFile) else topo
    if p == Placement.default(p.pp, p.dp):
        return PipeDataParallelTopology(num_pp=p.pp, num_dp=p.dp)
    return PlacedTopology(p.as_lists())


def load_topology(path: Union[str, os.PathLike]) -> PipeDataParallelTopology:
    """Read a topology file (YAML or JSON); raises ``BadInput`` with one sentence when it is not one."""
    return process_topology(load_model(path, TopologyFile))
