"""The orchestrator in the engine: measure every stage's all-reduce, decide on rank 0, re-map.

At each iteration boundary every rank contributes its ``ReduceGrads`` time, its stage's mean F, B
and W per micro-batch and its stage's gradient MB; the rows are all-gathered in the migration's
gloo vote group and rank 0 runs the torch-free ``control.orchestrate.Orchestrator`` (its placement
search is bounded by replays, but only one rank needs to run it). Rank 0 broadcasts the decision; a
decision is stored as ``engine.pending_remap``, and ``Orchestrated.train_batch`` re-maps right after
the ``train_batch`` that produced it (a re-mapping makes a new engine, which only the handle the
training loop holds can swap in).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..control.orchestrate import Orchestrator
from ..fileio import BadInput, load_model
from ..plan.linkmatrix import LinkMatrix
from ..plan.placement import Placement
from .config import PipeMorphConfigError
from .oprecords import fbw_ms_per_microbatch

logger = logging.getLogger(__name__)


class OrchestrateHook:
    def __init__(self, engine, caps: list[int]):
        cfg = engine.pipemorph.orchestrate
        try:
            matrix = load_model(cfg.matrix, LinkMatrix)
        except BadInput as e:
            raise PipeMorphConfigError(f"orchestrate.matrix: {e}") from None
        if matrix.world_size != dist.get_world_size():
            raise PipeMorphConfigError(f"orchestrate.matrix {cfg.matrix} is for {matrix.world_size} ranks; the job "
                                       f"has {dist.get_world_size()}")
        topo = engine.module._topo
        P, D = engine.num_stages, engine.grid.data_parallel_size
        self.placement = Placement.from_ranks([[topo.get_rank(pipe=s, data=d) for d in range(D)] for s in range(P)])
        self.cfg, self.caps, self.matrix = cfg, caps, matrix
        self.orchestrator: Optional[Orchestrator] = None  # built at the first boundary (gradient sizes gathered)

    def after_iteration(self, engine, records) -> None:
        S = engine.num_stages
        row = torch.zeros(5 * S, dtype=torch.float64)
        s = engine.stage_id
        row[s] = sum(r.end_ns - r.start_ns for r in records if r.op == "ReduceGrads") / 1e6
        row[S + 3 * s: S + 3 * s + 3] = torch.tensor(fbw_ms_per_microbatch(records, engine.micro_batches))
        row[4 * S + s] = sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 1e6
        table = engine.migrator.gather_max(row)
        group = engine.migrator.vote_group()
        box = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = self._decide(engine, table, S)
            except Exception as e:  # noqa: BLE001 - every rank waits in the broadcast: tell them, then fail
                box[0] = {"error": f"{type(e).__name__}: {e}"}
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is not None and "error" in box[0]:
            raise RuntimeError(f"orchestrate: rank 0 failed to decide: {box[0]['error']}")
        engine.pending_remap = None if box[0] is None else box[0]["ranks"]

    def _decide(self, engine, table, S: int) -> Optional[dict]:
        if self.orchestrator is None:
            grad = [self.cfg.grad_mb if self.cfg.grad_mb is not None else table[4 * S + k].item() for k in range(S)]
            self.orchestrator = Orchestrator(self.matrix, self.placement, engine.micro_batches, grad,
                                             self.cfg.chunk_mb, self.caps, self.cfg.noise, self.cfg.patience,
                                             self.cfg.min_gain)
        d = self.orchestrator.observe(table[:S].tolist(), table[S:4 * S].view(S, 3).tolist())
        if d is None:
            return None
        logger.warning(f"pipemorph: orchestrate: the all-reduce of stages took {[round(x, 1) for x in d.measured_allreduce_ms]} "
                       f"ms (fixed cost per all-reduce {d.overhead_ms:.1f} ms); re-mapping to {d.ranks} (predicted "
                       f"{d.current_ms:.0f} -> {d.predicted_ms:.0f} ms; decided in {d.seconds:.1f} s)")
        return {"ranks": d.ranks}
